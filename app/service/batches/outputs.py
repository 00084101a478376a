"""A batch's output and error files: their lines built from its answers, written once it ends, copied to
the object-store output.

An output line is OpenAI's (`{"id": "batch_req_...", "custom_id", "response", "error"}`), its ids stable
when a line runs again (its batch's serial and its line number); the files hold each input line's first
result only, and an expired batch's error file names its lines not run. Nothing here holds engine state:
the engine calls these with its file store and settings.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Iterator
from typing import Any

import orjson

from app.checkpoints.output import scrub
from app.checkpoints.publish import upload_whole
from app.service.batches.running import Lines, Running
from app.service.settings import Settings
from app.store.batches import BatchRecord, Result
from app.store.cache import StoredResponse
from app.store.durable import UnsafeFileError, open_to_read
from app.store.files import FileStore

logger = logging.getLogger(__name__)


async def upload(files: FileStore, settings: Settings, record: BatchRecord, file_ids: list[str]) -> None:
    """The batch's files copied to the object-store output too, each whole or absent there (one PUT),
    as `<output>/batches/<filename>`; tried again with backoff until they are (the batch stays
    `finalizing` meanwhile: its files are safe under the checkpoints dir)."""
    for file_id in file_ids:
        stored = files.get(file_id)
        assert stored is not None, "written just before"
        attempt = 0
        while True:
            try:
                where = await asyncio.to_thread(
                    upload_whole, settings.output, str(files.path(file_id)), f"batches/{stored.filename}"
                )
                logger.info("batch %s: %s copied to %s", record.id, stored.filename, where)
                break
            except Exception as exc:
                wait = min(2.0**attempt, settings.publish_retry_max_s)
                reason = scrub(str(exc), settings.output)
                logger.warning(
                    "batch %s: copying %s to the output failed (%s); again in %g s",
                    record.id,
                    stored.filename,
                    reason,
                    wait,
                )
                attempt += 1
                await asyncio.sleep(wait)


def write_files(files: FileStore, batch: Running) -> tuple[bool, bool]:
    """The output and error files of an ended batch from its results.jsonl, each under the id reserved for
    it (a file already there is kept: written before a crash); whether each has lines."""
    record = batch.record
    assert record.output_file_id is not None
    assert record.error_file_id is not None
    expired = expired_lines(files, batch) if record.ending == "expired" else iter(())
    wrote = [False, False]
    for index, (file_id, ok) in enumerate(((record.output_file_id, True), (record.error_file_id, False))):
        if files.get(file_id) is not None:
            wrote[index] = True
            continue
        lines = itertools.chain(_once(batch.dir.outputs(), ok), () if ok else expired)
        first = next(lines, None)
        if first is None:
            continue  # a file without lines is not written: its id is null
        name = f"{record.id}_{'output' if ok else 'error'}.jsonl"
        with files.writing(name, "batch_output", file_id=file_id) as out:
            piece = [first]
            for item in lines:
                piece.append(item)
                if len(piece) >= 1024:
                    out.write(b"\n".join(piece) + b"\n")
                    piece = []
            if piece:
                out.write(b"\n".join(piece) + b"\n")
        wrote[index] = True
    return wrote[0], wrote[1]


def expired_lines(files: FileStore, batch: Running) -> Iterator[bytes]:
    """The error lines of an expired batch's lines not run, from its input file."""
    try:
        f = open_to_read(files.path(batch.record.input_file_id))
    except (FileNotFoundError, UnsafeFileError):  # the input lost: its lines not run cannot be named
        return
    with f:
        for number, raw in enumerate(f, 1):
            if raw.strip() and not batch.is_done(number):
                custom_id = orjson.loads(raw)["custom_id"]
                message = "This request could not be executed before the completion window expired."
                yield failure_result(batch.record.serial, number, custom_id, "batch_expired", message).out


def _once(outputs: Iterator[tuple[int, bool, bytes]], ok: bool) -> Iterator[bytes]:
    """The output (or error) lines of results, each input line's first result only."""
    seen = Lines()
    for line, went_ok, out in outputs:
        if line not in seen:
            seen.add(line)
            if went_ok == ok:
                yield out


def _ids(serial: int, number: int) -> str:
    """The hex digits of a line's ids: its batch's serial and its line number (stable when it runs again)."""
    return f"{serial & (2**64 - 1):016x}{number & 0xFFFFFFFF:08x}"


def answer_result(
    serial: int, number: int, custom_id: str, answer: StoredResponse, headers: dict[bytes, bytes]
) -> Result:
    """The output line of an answer, its body as the upstream sent it when it is JSON (not parsed and written
    again), else as a string."""
    ids = _ids(serial, number)
    given = headers.get(b"x-request-id")
    request_id = orjson.dumps(given.decode("latin-1") if given else "req_" + ids)
    tokens: tuple[int, int] | None = None
    try:
        parsed = orjson.loads(answer.body)
    except orjson.JSONDecodeError:
        body = orjson.dumps(answer.body.decode("utf-8", "replace"))
    else:
        body = answer.body.strip() if b"\n" not in answer.body.strip() else orjson.dumps(parsed)
        tokens = _tokens(parsed)
    out = (
        b'{"id":"batch_req_%s","custom_id":%s,"response":{"status_code":%d,"request_id":%s,"body":%s},"error":null}'
        % (
            ids.encode(),
            orjson.dumps(custom_id),
            answer.status,
            request_id,
            body,
        )
    )
    # a 2xx that is no JSON (an HTML page, nothing) is no answer of the endpoint's: the error file's
    return Result(number, 200 <= answer.status < 300 and tokens is not None, tokens or (0, 0), out)


def failure_result(serial: int, number: int, custom_id: str, code: str, message: str) -> Result:
    """The error-file line of a line that got no answer: `code` and `message` say why."""
    out = {
        "id": "batch_req_" + _ids(serial, number),
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }
    return Result(number, False, (0, 0), orjson.dumps(out))


def _tokens(body: Any) -> tuple[int, int]:
    """(prompt, completion) tokens of an answer's `usage`, (0, 0) without one."""
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return 0, 0
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    return (max(prompt, 0) if isinstance(prompt, int) else 0), (
        max(completion, 0) if isinstance(completion, int) else 0
    )


def add_tokens(usage: dict[str, int], tokens: tuple[int, int]) -> None:
    """`tokens` (prompt, completion) added to a batch's `usage` counts."""
    usage["input_tokens"] = usage.get("input_tokens", 0) + tokens[0]
    usage["output_tokens"] = usage.get("output_tokens", 0) + tokens[1]
    usage["total_tokens"] = usage["input_tokens"] + usage["output_tokens"]
