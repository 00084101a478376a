"""A batch's input file checked before anything of it runs (contract §12): every line a JSON object with a
`custom_id` unique in the file, `method` POST, `url` the batch's endpoint, and a `body` object that does
not ask for a stream. Read line by line, never whole; duplicates found through a Bloom filter of the ids'
hashes, then a second pass over the few lines it flags."""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import xxhash

from app.service.asgi import json_kind
from app.store.durable import open_to_read

#: The errors a failed batch names (OpenAI's `errors.data`), the first ones of the file.
MAX_ERRORS = 100
#: As an `X-Doc-Id` may be: a line's answers are kept under its `custom_id`.
MAX_CUSTOM_ID_BYTES = 1024
#: The start of a file that tells whether it is text at all.
HEAD_BYTES = 1024
GZIP_MAGIC = b"\x1f\x8b"


@dataclass
class Checked:
    """What the check found: the lines to run, and the errors of the first bad lines."""

    lines: int = 0
    bad: int = 0
    errors: list[dict[str, Any]] = field(default_factory=list)
    #: Why the file is no JSON Lines at all, to follow its name (`is gzip-compressed: gunzip it`), or None.
    not_json_lines: str | None = None

    def error(self, line: int, code: str, message: str, param: str | None = None) -> None:
        self.bad += 1
        self.errors.append({"code": code, "line": line, "message": message, "param": param})
        if len(self.errors) >= 2 * MAX_ERRORS:  # the first lines' kept, wherever a pass found them
            self.errors.sort(key=lambda e: e["line"])
            del self.errors[MAX_ERRORS:]


class IdFilter:
    """The ids seen, as a Bloom filter of their hashes (two bits each, about 16 bits a line): a few MB for a
    million lines, where a set of them would take a hundred. `add` says whether the id may have been seen
    (rarely wrongly: the second pass, `_name_duplicates`, looks at the ids themselves)."""

    def __init__(self, file_bytes: int) -> None:
        size = 1 << max(20, min(28, (file_bytes // 4).bit_length()))  # bits: ~4 per byte, 32 MB at most
        self.bits = bytearray(size // 8)
        self.mask = size - 1

    def add(self, digest: int) -> bool:
        bits, mask = self.bits, self.mask
        a, b = digest & mask, (digest >> 31) & mask
        seen = bool(bits[a >> 3] & (1 << (a & 7))) and bool(bits[b >> 3] & (1 << (b & 7)))
        bits[a >> 3] |= 1 << (a & 7)
        bits[b >> 3] |= 1 << (b & 7)
        return seen


def not_text(head: bytes) -> str | None:
    """Why a file starting with `head` (its first `HEAD_BYTES`) is no JSON Lines at all, or None."""
    if head.startswith(GZIP_MAGIC):
        return "is gzip-compressed: gunzip it"
    if b"\0" in head:
        return "is not text: its first KB holds NUL bytes"
    if head.startswith(codecs.BOM_UTF8):  # what some Windows editors save: no JSON begins with it
        return "begins with a byte-order mark (EF BB BF): save it as UTF-8 without one"
    try:  # a character cut at the end of the head is no error, one cut at the end of the file is
        codecs.getincrementaldecoder("utf-8")().decode(head, final=len(head) < HEAD_BYTES)
    except UnicodeDecodeError:
        return "is not UTF-8 text (its first KB is not): give the batch file, in UTF-8"
    return None


def looks_like_an_array(raw: bytes, record: Any) -> bool:
    """Whether the first line that is not blank opens one JSON array of the requests (a file written with
    `json.dump(requests, f)`, pretty-printed or not) rather than holding one request."""
    return raw.lstrip().startswith(b"[") and (record is None or isinstance(record, list))


ARRAY = "looks like one JSON array, not one request per line: write one JSON object per line (jq -c '.[]' does)"


def line_problem(record: Any, endpoint: str) -> tuple[str, str, str | None] | None:
    """What is wrong with one parsed line: (code, message, param), or None."""
    if not isinstance(record, dict):
        return "invalid_json_line", f"the line must be a JSON object, got {json_kind(record)}", None
    custom_id = record.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return "missing_custom_id", "the line needs a `custom_id`, a non-empty string", "custom_id"
    if len(custom_id.encode("utf-8", "surrogatepass")) > MAX_CUSTOM_ID_BYTES:
        return (
            "invalid_custom_id",
            f"`custom_id` is {len(custom_id.encode('utf-8', 'surrogatepass'))} bytes; at most {MAX_CUSTOM_ID_BYTES}",
            "custom_id",
        )
    if record.get("method") != "POST":
        return "invalid_method", f'`method` must be "POST", got {record.get("method")!r}', "method"
    if record.get("url") != endpoint:
        return (
            "mismatched_url",
            f"`url` must be the batch's endpoint {endpoint!r}, got {record.get('url')!r}",
            "url",
        )
    body = record.get("body")
    if not isinstance(body, dict):
        return "invalid_body", "`body` must be a JSON object (the request as sent to the endpoint)", "body"
    if "stream" in body and body["stream"] is not None and body["stream"] is not False:  # 0 is no False here
        return "stream_not_supported", "`body.stream` must be false or absent: a batch's answers are whole", "body"
    try:
        orjson.dumps(body)  # what is sent upstream and hashed: orjson writes at most 254 levels of nesting
    except TypeError:
        return "invalid_body", "`body` is nested too deep to be sent (at most 254 levels)", "body"
    return None


def check_input(path: Path, endpoint: str) -> Checked:
    """Check every line of the file at `path` (blank lines are skipped, but counted in line numbers)."""
    checked = Checked()
    seen = IdFilter(path.stat().st_size)
    maybe_twice: set[int] = set()
    with open_to_read(path) as f:
        checked.not_json_lines = not_text(f.read(HEAD_BYTES))
        f.seek(0)
        first = True
        for number, raw in enumerate(f, 1):
            if checked.not_json_lines is not None:
                # every line would be bad, each for the same reason: the file's is the one said
                checked.error(number, "invalid_json_line", f"the file {checked.not_json_lines}")
                break
            if not raw.strip():
                continue
            try:
                record = orjson.loads(raw)
            except orjson.JSONDecodeError as exc:
                if first and looks_like_an_array(raw, None):
                    checked.not_json_lines = ARRAY
                    checked.error(number, "invalid_json_line", f"the file {ARRAY}")
                    break
                checked.error(number, "invalid_json_line", _not_json(exc))
                first = False
                continue
            if first and looks_like_an_array(raw, record):
                checked.not_json_lines = ARRAY
                checked.error(number, "invalid_json_line", f"the file {ARRAY}")
                break
            first = False
            problem = line_problem(record, endpoint)
            if problem is not None:
                checked.error(number, *problem)
                continue
            checked.lines += 1
            digest = xxhash.xxh3_64_intdigest(record["custom_id"].encode())
            if seen.add(digest):
                maybe_twice.add(digest)
    if maybe_twice:
        _name_duplicates(path, maybe_twice, checked)
    checked.errors.sort(key=lambda e: e["line"])
    del checked.errors[MAX_ERRORS:]
    return checked


def _not_json(exc: orjson.JSONDecodeError) -> str:
    if "UTF-8" in exc.msg:  # orjson's "str is not valid UTF-8: surrogates not allowed" for any bad byte
        return "the line is not UTF-8 text"
    return f"the line is not valid JSON: {exc.msg} at column {exc.colno}"


def _name_duplicates(path: Path, digests: set[int], checked: Checked) -> None:
    """A second pass over the lines whose ids' hashes met twice: the ids that really repeat, each at every
    line after its first."""
    first: dict[str, int] = {}
    with open_to_read(path) as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                record = orjson.loads(raw)
            except orjson.JSONDecodeError:
                continue
            custom_id = record.get("custom_id") if isinstance(record, dict) else None
            if not isinstance(custom_id, str) or xxhash.xxh3_64_intdigest(custom_id.encode()) not in digests:
                continue
            if custom_id in first:
                checked.error(
                    number,
                    "duplicate_custom_id",
                    f"`custom_id` {custom_id!r} is used on line {first[custom_id]} already: each line needs its own",
                    "custom_id",
                )
                checked.lines -= 1
            else:
                first[custom_id] = number
