"""The input: opened as a stream (a local file or an fsspec URL), an object-store one checked before anything
else, read once for its identity (and copied into the state), and refused in one line when it cannot run."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, Protocol

import orjson
import xxhash

from app.checkpoints.output import bounded, install_hint, is_remote, redact_url, scrub
from app.service.batches.answers import ENDPOINTS
from app.service.batches.validation import ARRAY, check_input
from app.tools.run_batch.errors import RunBatchError, Stopped
from app.tools.run_batch.state import Identity

#: Bad lines named in the one line that refuses an input.
SHOWN_ERRORS = 3
PIECE = 1 << 20


@contextlib.contextmanager
def open_input(url: str) -> Iterator[IO[bytes]]:
    """The input's bytes, as a stream: a local file or an fsspec URL; a one-line error if it cannot be read."""
    shown = redact_url(url)
    try:
        if is_remote(url):
            import fsspec

            opened: Any = fsspec.open(url, "rb")
            stream = opened.open()
        else:
            stream = open(url.removeprefix("file://"), "rb")  # noqa: SIM115 - closed below
    except ImportError:
        raise RunBatchError(f"-i {shown} is a URL: install fsspec and its filesystem (pip install 's3fs')") from None
    except FileNotFoundError:
        if url == "-":  # a rerun carries on from the same input, which a pipe cannot give twice
            raise RunBatchError("-i -: run-batch reads a file, not standard input: write it to a file first") from None
        raise RunBatchError(f"-i {shown}: no such file") from None
    except IsADirectoryError:
        raise RunBatchError(f"-i {shown} is a folder: give the batch file (JSONL) in it") from None
    except Exception as exc:  # OSError, or an object store client's own (botocore's ClientError, ...)
        reason = scrub(f"{type(exc).__name__}: {exc}".replace("\n", " "), url)
        raise RunBatchError(f"-i {shown} cannot be read ({reason})") from None
    with stream:
        yield stream


def check_remote_input(url: str, *, timeout_s: float = 30.0) -> None:
    """An object-store INPUT must be there and readable with the credentials at hand, said in one line
    before anything else: fsspec's clients raise their own errors (botocore's NoCredentialsError, ...), after
    retrying for a while, hence a daemon thread and a bound (as `check_output` does for an output)."""
    shown = redact_url(url)

    def probe() -> Any:
        import fsspec

        fs, path = fsspec.core.url_to_fs(url)
        return fs.info(path)

    outcome = bounded(probe, timeout_s, name="check-input")
    if outcome is None:
        raise RunBatchError(f"-i {shown} did not answer within {timeout_s:g} s: check the URL and the endpoint")
    found, error = outcome
    if isinstance(error, ImportError):
        raise RunBatchError(f"-i {shown} is a URL: {install_hint(url)}")
    if isinstance(error, FileNotFoundError):
        raise RunBatchError(f"-i {shown}: no such object (check the URL and the endpoint)")
    if error is not None:
        reason = scrub(f"{type(error).__name__}: {error}".replace("\n", " "), url)
        raise RunBatchError(f"-i {shown} cannot be reached ({reason}): check the URL, the endpoint and the credentials")
    if isinstance(found, dict) and found.get("type") == "directory":
        raise RunBatchError(f"-i {shown} is a folder: give the batch file (JSONL) in it")


class Sink(Protocol):
    def write(self, data: bytes, /) -> object: ...


def scan_input(url: str, into: Sink | None, stop: threading.Event) -> Identity:
    """Read the input once, as a stream: its identity, the endpoint its first line names, and a copy `into`."""
    hasher = xxhash.xxh3_128()
    size, endpoint, endpoint_line = 0, None, 0
    with open_input(url) as f:
        for number, raw in enumerate(f, 1):
            if stop.is_set():
                raise Stopped
            hasher.update(raw)
            size += len(raw)
            if into is not None:
                into.write(raw)
            if endpoint is None and raw.strip():
                with contextlib.suppress(orjson.JSONDecodeError):
                    line = orjson.loads(raw)
                    if isinstance(line, dict) and isinstance(line.get("url"), str):
                        endpoint, endpoint_line = line["url"], number
    return Identity(size, hasher.hexdigest(), endpoint, endpoint_line)


def refusal(shown: str, identity: Identity, path: Path) -> str | None:
    """Why the input copied to `path` cannot run (one line naming its first bad lines), or None."""
    known = identity.endpoint in ENDPOINTS
    # with no endpoint to check against, checked against any: the bad lines named all the same, the url aside
    checked = check_input(path, identity.endpoint if identity.endpoint is not None and known else ENDPOINTS[0])
    if checked.not_json_lines == ARRAY:
        return f"-i {shown} {ARRAY}"
    if checked.not_json_lines is not None:
        return f"-i {shown} {checked.not_json_lines} (run-batch reads plain JSON Lines)"
    if identity.endpoint is None:
        problems = [e for e in checked.errors if e["code"] != "mismatched_url"]
        if problems:
            shown_errors = "; ".join(f"line {e['line']}: {e['message']}" for e in problems[:SHOWN_ERRORS])
            return f"-i {shown} holds no request, nothing was sent: {shown_errors}"
        return f"-i {shown} holds no request: one JSON object per line, {{custom_id, method, url, body}}"
    if not known:
        return (
            f"-i {shown}: line {identity.endpoint_line} asks for url {identity.endpoint!r}: run-batch sends "
            f"{', '.join(ENDPOINTS)}"
        )
    mixed = next((e for e in checked.errors if e["code"] == "mismatched_url"), None)
    if mixed is not None:
        other = str(mixed["message"]).rpartition(", got ")[2]
        return (
            f"-i {shown} mixes endpoints: line {identity.endpoint_line} asks for {identity.endpoint}, line "
            f"{mixed['line']} for {other}; one endpoint per file: split it by `url`. Nothing was sent"
        )
    if checked.bad:
        shown_errors = "; ".join(f"line {e['line']}: {e['message']}" for e in checked.errors[:SHOWN_ERRORS])
        more = f" (and {checked.bad - SHOWN_ERRORS:,} more)" if checked.bad > SHOWN_ERRORS else ""
        lines = "1 bad line" if checked.bad == 1 else f"{checked.bad:,} bad lines"
        return f"-i {shown} has {lines}, nothing was sent: {shown_errors}{more}"
    if not checked.lines:
        return f"-i {shown} holds no request: one JSON object per line, {{custom_id, method, url, body}}"
    return None
