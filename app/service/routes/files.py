"""OpenAI's Files API (docs/contract.md, "Files"): the files batches read, kept in `Services.files`.

- `POST /v1/files`: a multipart/form-data body with the fields `purpose` (`batch`), `file` (the upload,
  with a filename) and, if it expires, `expires_after[anchor]` and `expires_after[seconds]`, parsed as it
  arrives by `python_multipart`'s push parser and written to disk piece by piece: an upload is never held
  whole in memory (`max_body_bytes` does not apply to it, `max_file_bytes` does: 413), and one refused,
  malformed or cut short leaves nothing behind;
- `GET /v1/files` (`purpose`, `limit`, `order`, `after`), `GET /v1/files/{id}`, `GET /v1/files/{id}/content`
  (the bytes as stored, streamed from disk), `DELETE /v1/files/{id}`.

Answers are OpenAI's shapes (`FileObject`, its list, `{"id", "object", "deleted"}`), errors the proxy's
envelope: an id that names no file is 404 "No such File object: ID", as OpenAI words it. So is one that has
expired: its bytes are removed then (or by `remove_expired`, every few minutes), but those of a running
batch's input, kept until the batch no longer reads it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from dataclasses import asdict
from typing import Any, BinaryIO
from urllib.parse import parse_qsl, quote, unquote_to_bytes

from python_multipart.exceptions import FormParserError, MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.responses import Response

from app.service.asgi import ClientGone, Receive, Scope, Send, header, shown_value
from app.service.errors import BadRequest, InsufficientStorage, NotFound, PayloadTooLarge, ProxyError
from app.service.services import UNWRITABLE_ERRNOS, Services, checkpoints_unwritable
from app.store.durable import UnsafeFileError, is_disk_full, open_regular, refusal_reason
from app.store.files import FileStore, FileTooLarge, FileWriter, StoredFile, is_file_id
from app.tasks import cancel_and_wait

logger = logging.getLogger(__name__)

#: The purposes an upload may have: the Batch API's input files.
PURPOSES = ("batch",)
#: Bytes of the parts that are not the file (`purpose`, and fields a client adds, which are ignored).
MAX_FIELD_BYTES = 64 << 10
#: What a body may hold beyond its file's bytes (boundaries, part headers, small fields) before 413.
MAX_OVERHEAD_BYTES = 1 << 20
MAX_FILENAME_BYTES = 1024
#: The file's bytes gathered before they are written (in a thread): few thread hops, little memory.
WRITE_BYTES = 1 << 20
#: The pieces a file's content is read and sent in.
READ_BYTES = 1 << 20
MAX_LIST = 10_000
#: OpenAI's `expires_after`: its only anchor, and the seconds after it, 1 hour to 30 days.
ANCHOR = "created_at"
EXPIRES_AFTER_S = (3600, 2_592_000)
EXPIRES_FIELDS = ("expires_after[anchor]", "expires_after[seconds]")
#: python_multipart's logger: it logs a WARNING for each malformed body it is fed, just before it raises the
#: error the route answers with a 400 that says the same; a client could write the log full with them.
PARSER_LOG = logging.getLogger("python_multipart.multipart")


def file_object(stored: StoredFile) -> dict[str, Any]:
    """OpenAI's `FileObject` of a stored file."""
    return {"object": "file", **asdict(stored), "status": "processed", "status_details": None}


def no_such_file(file_id: str) -> NotFound:
    return NotFound(f"No such File object: {file_id[:100]} (GET /v1/files lists the files there are)", param="file_id")


def missing(services: Services, file_id: str) -> NotFound:
    """The 404 of a file `get` did not find; if it has expired, its bytes are removed now (in a thread)."""
    if services.files.get(file_id, expired_too=True) is not None:
        remove_expired(services, [file_id])
    return no_such_file(file_id)


def remove_expired(services: Services, file_ids: list[str] | None = None) -> None:
    """Remove the files that have expired (of `file_ids`, or all), but the inputs batches still read (in a
    thread: it reads the metadata of each file and each batch)."""
    keep = services.batches.inputs_read() if services.batches is not None else set()
    for file_id in services.files.remove_expired(keep=keep, file_ids=file_ids):
        logger.info("removed %s: it expired", file_id)
    if file_ids is None:  # the periodic sweep: what crashes left half-written too, once surely abandoned
        for name in services.files.sweep_half_written():
            logger.info("removed %s: half-written by an upload or an output cut short", name)


# -- POST /v1/files ---------------------------------------------------------------------------


def parser_errors_only(record: logging.LogRecord) -> bool:
    """The parser's lines kept: its errors, not its warnings about the body (each one the client's 400)."""
    return record.levelno >= logging.ERROR


def boundary_of(scope: Scope) -> bytes:
    given = header(scope, b"content-type")
    kind, options = parse_options_header(given)
    if kind != b"multipart/form-data":
        raise BadRequest(
            f"an upload is a multipart/form-data body with the fields `file` and `purpose`, got Content-Type "
            f"{(given or b'(none)').decode('latin-1')[:100]!r}",
            param="Content-Type",
        )
    boundary = options.get(b"boundary")
    if not boundary:
        raise BadRequest("Content-Type multipart/form-data needs its boundary parameter", param="Content-Type")
    return boundary


class Upload:
    """One multipart body, parsed as it arrives: its `purpose`, and its `file` streamed into the store.

    The parser's callbacks run inside `feed`'s `parser.write`, on the event loop: they gather the file's
    bytes, which `feed` then writes in a thread, `WRITE_BYTES` at a time.
    """

    def __init__(self, store: FileStore, boundary: bytes, limit: int) -> None:
        self.store = store
        self.limit = limit
        self.received = 0
        self.headers: dict[bytes, bytes] = {}
        self.header_name = bytearray()
        self.header_value = bytearray()
        self.field: str | None = None  # the name of the part being read, if not the file
        self.seen: set[str] = set()  # the names of the fields read so far, but the file
        self.value = bytearray()
        self.field_bytes = 0
        self.purpose: str | None = None
        self.expires: dict[str, bytes] = {}  # the `expires_after[...]` fields, as sent
        self.writer: FileWriter | None = None
        self.in_file = False
        self.pending: list[bytes] = []
        self.pending_size = 0
        self.file_bytes = 0
        self.ended = False
        self.committing = False
        PARSER_LOG.addFilter(parser_errors_only)  # once: the same function is not added again
        try:
            self.parser = MultipartParser(
                boundary,
                {
                    "on_part_begin": self.headers.clear,
                    "on_header_field": lambda data, start, end: self.header_name.extend(data[start:end]),
                    "on_header_value": lambda data, start, end: self.header_value.extend(data[start:end]),
                    "on_header_end": self.on_header_end,
                    "on_headers_finished": self.on_headers_finished,
                    "on_part_data": self.on_part_data,
                    "on_part_end": self.on_part_end,
                    "on_end": self.on_end,
                },
            )
        except FormParserError as exc:  # a boundary too long
            raise BadRequest(f"Content-Type's boundary is refused: {exc}", param="Content-Type") from None

    # -- the parser's callbacks --

    def on_header_end(self) -> None:
        self.headers[bytes(self.header_name).lower()] = bytes(self.header_value).strip(b" \t")
        self.header_name.clear()
        self.header_value.clear()

    def on_headers_finished(self) -> None:
        disposition, options = parse_options_header(self.headers.get(b"content-disposition"))
        name = options.get(b"name")
        if disposition != b"form-data" or name is None:
            raise BadRequest('each part of the form needs Content-Disposition: form-data; name="..."')
        if name != b"file":
            self.field = name.decode("latin-1")
            if self.field in self.seen:  # which one counts would be a guess: refused, whichever it is
                raise BadRequest(f"the form holds two `{self.field}` fields: send each field once", param=self.field)
            self.seen.add(self.field)
            return
        if self.writer is not None:
            raise BadRequest("the form holds two `file` fields: upload one file per request")
        filename = starred_filename(self.headers.get(b"content-disposition") or b"") or options.get(b"filename")
        if not filename:
            raise BadRequest('the `file` field needs a filename (Content-Disposition: ...; filename="input.jsonl")')
        if len(filename) > MAX_FILENAME_BYTES:
            raise BadRequest(f"the filename is {len(filename)} bytes long; at most {MAX_FILENAME_BYTES}: shorten it")
        try:
            decoded = filename.decode()
        except UnicodeDecodeError:
            decoded = filename.decode("latin-1")
        self.writer = self.store.start(decoded, self.purpose or PURPOSES[0], limit=self.limit)
        self.in_file = True

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self.in_file:
            self.pending.append(data[start:end])
            self.pending_size += end - start
            self.file_bytes += end - start
            if self.file_bytes > self.limit:  # as soon as it is known, not once the pending bytes are written
                raise FileTooLarge(f"the file exceeds {self.limit} bytes")
            return
        self.field_bytes += end - start
        if self.field_bytes > MAX_FIELD_BYTES:
            raise BadRequest(f"the form's fields but `file` hold over {MAX_FIELD_BYTES} bytes: send `purpose` only")
        if self.field == "purpose" or self.field in EXPIRES_FIELDS:
            self.value.extend(data[start:end])

    def on_part_end(self) -> None:
        if self.in_file:
            self.in_file = False
        elif self.field == "purpose":
            self.purpose = check_purpose(bytes(self.value))
        elif self.field in EXPIRES_FIELDS:
            self.expires[self.field] = bytes(self.value)
        self.value.clear()
        self.field = None

    def on_end(self) -> None:
        self.ended = True

    # -- driven by the route --

    async def feed(self, chunk: bytes) -> None:
        self.received += len(chunk)
        if self.received > self.limit + MAX_OVERHEAD_BYTES:
            raise FileTooLarge("the body is larger than max_file_bytes")
        if self.ended:
            return  # an epilogue after the closing boundary: ignored, as RFC 2046 says
        try:
            self.parser.write(chunk)
        except MultipartParseError as exc:
            raise BadRequest(f"the body is not valid multipart/form-data: {exc}") from None
        if self.pending_size >= WRITE_BYTES:
            await self.flush()

    async def flush(self) -> None:
        pieces, self.pending, self.pending_size = self.pending, [], 0
        if pieces and self.writer is not None:
            await asyncio.to_thread(write_all, self.writer, pieces)

    async def finish(self) -> StoredFile:
        if not self.ended:
            raise BadRequest(
                "the body ends before the form's closing boundary: the upload was cut short, send it again"
            )
        if self.writer is None:
            raise BadRequest("the form has no `file` field: send the upload as `file`, with a filename")
        if self.purpose is None:
            raise BadRequest(f"the form has no `purpose` field: send purpose={PURPOSES[0]}", param="purpose")
        expires_after = check_expires_after(self.expires)
        await self.flush()
        self.writer.purpose = self.purpose
        self.writer.expires_after = expires_after
        self.committing = True  # from here the commit keeps the file or removes it, whatever happens here
        return await asyncio.shield(asyncio.to_thread(self.store.commit, self.writer))

    def abandon(self) -> None:
        if self.writer is not None and not self.committing:
            self.writer.abandon()


def write_all(writer: FileWriter, pieces: list[bytes]) -> None:
    for piece in pieces:
        writer.write(piece)


def check_purpose(raw: bytes) -> str:
    purpose = raw.decode("utf-8", "replace")
    if purpose not in PURPOSES:
        accepted = " or ".join(PURPOSES)
        raise BadRequest(
            f"purpose must be {accepted} (a file for the Batch API), got {purpose[:100]!r}", param="purpose"
        )
    return purpose


def check_expires_after(given: dict[str, bytes]) -> int | None:
    """The seconds after `created_at` at which the upload expires (OpenAI's `expires_after`), None if the form
    has neither of its fields."""
    if not given:
        return None
    anchor_field, seconds_field = EXPIRES_FIELDS
    low, high = EXPIRES_AFTER_S
    for name in EXPIRES_FIELDS:
        if name not in given:
            raise BadRequest(
                f"expires_after needs both {anchor_field}={ANCHOR} and {seconds_field} ({low} to {high}): the form "
                f"has no {name}",
                param=name,
            )
    anchor = given[anchor_field].decode("utf-8", "replace")
    if anchor != ANCHOR:
        raise BadRequest(
            f"{anchor_field} must be {ANCHOR} (the only anchor there is), got {anchor[:100]!r}", param=anchor_field
        )
    seconds = given[seconds_field].decode("utf-8", "replace")
    if not (seconds.isascii() and seconds.isdigit() and len(seconds) <= 10 and low <= int(seconds) <= high):
        raise BadRequest(
            f"{seconds_field} must be an integer from {low} (1 hour) to {high} (30 days), got {seconds[:100]!r}",
            param=seconds_field,
        )
    return int(seconds)


async def create(services: Services, scope: Scope, receive: Receive) -> dict[str, Any]:
    """Store the upload; its `FileObject`."""
    boundary = boundary_of(scope)
    limit = services.settings.max_file_bytes
    declared = header(scope, b"content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limit + MAX_OVERHEAD_BYTES:
        raise too_large(limit)
    upload = Upload(services.files, boundary, limit)
    try:
        try:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ClientGone
                await upload.feed(message.get("body", b""))
                if not message.get("more_body"):
                    break
            stored = await upload.finish()
        except BaseException:
            upload.abandon()
            raise
    except FileTooLarge:
        raise too_large(limit) from None
    except OSError as exc:
        refused = storage_refused(exc, services)
        if refused is None:
            raise
        raise refused from exc
    logger.info("stored %s (%d bytes, %r, purpose %s)", stored.id, stored.bytes, stored.filename, stored.purpose)
    return file_object(stored)


def too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"the file exceeds max_file_bytes ({limit} bytes), and nothing of it was kept: split it into smaller "
        f"files, or raise max_file_bytes"
    )


def storage_refused(exc: OSError, services: Services) -> ProxyError | None:
    """What to answer for a write of an upload that the disk refused (507 full, 503 read-only), if one of those."""
    where = services.files.root
    if is_disk_full(exc):
        logger.warning("an upload could not be stored: the disk of %s is full (%s)", where, exc)
        return InsufficientStorage(
            f"the upload cannot be stored: the checkpoints disk is full ({refusal_reason(exc)}), and nothing of "
            f"it was kept; free space under {where}, then upload it again"
        )
    if exc.errno in UNWRITABLE_ERRNOS:
        return checkpoints_unwritable(exc, services.settings.checkpoints_dir, "the upload cannot be stored: ")
    return None


# -- the other routes -------------------------------------------------------------------------


def listing(services: Services, scope: Scope) -> dict[str, Any]:
    """OpenAI's list of files, as the query string asks (`purpose`, `limit`, `order`, `after`)."""
    query = dict(parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True))
    raw_limit = query.get("limit", str(MAX_LIST))
    if not (raw_limit.isascii() and raw_limit.isdigit() and 1 <= int(raw_limit) <= MAX_LIST):
        raise BadRequest(f"limit must be an integer from 1 to {MAX_LIST}, got {raw_limit[:40]!r}", param="limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise BadRequest(f"order must be asc or desc (by created_at), got {order[:40]!r}", param="order")
    after = query.get("after")
    if after is not None and not is_file_id(after):
        raise BadRequest(
            f"after must be a file id (the last_id of the page before), got {shown_value(after)}", param="after"
        )
    limit = int(raw_limit)
    found = services.files.list(
        purpose=query.get("purpose"), after=after, limit=limit + 1, newest_first=order == "desc"
    )
    page = [file_object(stored) for stored in found[:limit]]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(found) > limit,
    }


def retrieve(services: Services, file_id: str) -> dict[str, Any]:
    stored = services.files.get(file_id)
    if stored is None:
        raise missing(services, file_id)
    return file_object(stored)


def delete(services: Services, file_id: str) -> dict[str, Any]:
    stored = services.files.delete(file_id)
    if stored is None:
        raise missing(services, file_id)
    logger.info("deleted %s (%r)", stored.id, stored.filename)
    return {"id": stored.id, "object": "file", "deleted": True}


def opened(services: Services, file_id: str) -> tuple[StoredFile, int]:
    """The file and a descriptor of its bytes, open before the answer starts (a delete meanwhile is no matter)."""
    stored = services.files.get(file_id)
    if stored is None:
        raise missing(services, file_id)
    try:
        return stored, open_regular(str(services.files.path(file_id)), os.O_RDONLY)
    except FileNotFoundError:
        raise no_such_file(file_id) from None
    except UnsafeFileError as exc:  # a link put in its place: never read through, as if it were gone
        logger.warning("%s", exc)
        raise no_such_file(file_id) from None


def content_size(services: Services, file_id: str) -> tuple[StoredFile, int]:
    """The file and the size of its bytes, for a HEAD of its content."""
    stored, fd = opened(services, file_id)
    try:
        return stored, os.fstat(fd).st_size
    finally:
        os.close(fd)


def content_headers(stored: StoredFile, size: int) -> list[tuple[bytes, bytes]]:
    """The headers of a file's content, `size` bytes (its GET's and its HEAD's)."""
    return [
        (b"content-type", b"application/octet-stream"),
        (b"content-length", str(size).encode()),
        (b"content-disposition", f"attachment; filename*=utf-8''{quote(stored.filename)}".encode()),
    ]


class FileContent(Response):
    """A stored file's bytes, read and sent `READ_BYTES` at a time (each read in a thread), until the client
    leaves: then no more is read (neither server fails a `send` to a client gone, `http.disconnect` says it)."""

    def __init__(self, stored: StoredFile, fd: int) -> None:
        super().__init__(media_type="application/octet-stream")  # the headers are `__call__`'s
        self.stored = stored
        self.fd = fd

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gone = asyncio.ensure_future(disconnected(receive))
        try:
            with os.fdopen(self.fd, "rb", buffering=0) as file:
                await self.stream(file, send, gone)
        finally:
            await cancel_and_wait(gone)

    async def stream(self, file: BinaryIO, send: Send, gone: asyncio.Future[None]) -> None:
        size = os.fstat(file.fileno()).st_size
        await send({"type": "http.response.start", "status": 200, "headers": content_headers(self.stored, size)})
        left = size
        while left > 0:
            if gone.done():
                logger.info(
                    "%s: the client left after %d of its %d bytes; no more is read", self.stored.id, size - left, size
                )
                return
            piece = await asyncio.to_thread(file.read, min(READ_BYTES, left))
            if not piece:
                break  # shortened since: the server cuts the answer, which the client sees as incomplete
            left -= len(piece)
            try:
                await send({"type": "http.response.body", "body": piece, "more_body": left > 0})
            except OSError:  # a server of ASGI 2.4 says a client gone so
                return
        if left > 0 or size == 0:
            await send({"type": "http.response.body", "body": b""})


async def disconnected(receive: Receive) -> None:
    """Once the client is gone (what is left of the request's body, if any, ignored)."""
    while (await receive())["type"] != "http.disconnect":
        pass


#: RFC 6266's `filename*=charset'language'percent-encoded` (RFC 8187), which python-multipart leaves out.
_STARRED = re.compile(rb"""(?:^|;)\s*filename\*\s*=\s*([A-Za-z0-9!#$&+.^_`|~-]+)'[A-Za-z0-9-]*'([^\s;]+)""")


def starred_filename(disposition: bytes) -> bytes | None:
    """The part's `filename*` as UTF-8 bytes (it takes precedence over `filename`, RFC 6266), if it has one
    that decodes; else None."""
    found = _STARRED.search(disposition)
    if found is None:
        return None
    try:
        return unquote_to_bytes(found.group(2)).decode(found.group(1).decode("ascii")).encode()
    except (LookupError, UnicodeDecodeError):
        return None
