"""The checkpoint service (contract §5): documents in, published chunks out, resume points.

- `POST /documents` (headers `X-Rank`, `X-Chunk-Index`): one document or a
  JSON array; 200 only once they are durable; duplicates counted, not
  rewritten; 400 malformed, 409 chunk complete, 413 too large, 507 disk
  full, and in each case nothing of the request is written;
- `POST /chunks/{i}/complete` (header `X-Rank`): the job's last chunk;
- `GET /resume` (header `X-Rank`): where a restarted job carries on, and
  where the proxy publishes (`output`, `output_filename`), so that a job can
  check that its own idea of the output is the proxy's.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import orjson

from app.checkpoints.documents import Document, DocumentError
from app.checkpoints.manager import (
    CheckpointDurabilityError,
    CheckpointManager,
    ChunkCompleteError,
    PublicationBacklog,
    RecordsPerChunkMismatch,
)
from app.checkpoints.output import is_remote
from app.checkpoints.publish import ChunkFileGone, PublishError
from app.checkpoints.resume import docs_to_skip
from app.service.asgi import Receive, Scope, check_integers, check_json_cost, read_body
from app.service.errors import BadRequest, ChunkConflict, InsufficientStorage, OutputUnavailable, ProxyError
from app.service.keys import MAX_RANK, parse_int, rank_of, single_header
from app.service.services import UNWRITABLE_ERRNOS, Services, checkpoints_unwritable
from app.store.cache import CacheWriteError
from app.store.durable import is_disk_full, refusal_reason

logger = logging.getLogger(__name__)

_FIELDS = frozenset({"id", "text", "media", "metadata"})
#: How long `GET /resume` waits for the rank's writes under way (a write's fsync takes milliseconds; a
#: stream of writes from another job on the rank is not waited for beyond this).
RESUME_SETTLE_S = 5.0

#: One route's work: (services, scope, receive) -> the JSON object it answers 200 with.
Work = Callable[[Services, Scope, Receive], Awaitable[dict[str, Any]]]


async def manager_of(services: Services, rank: int) -> CheckpointManager:
    try:
        return await services.checkpoints.get(rank)
    except RecordsPerChunkMismatch as exc:
        raise ChunkConflict(str(exc)) from exc
    except PublishError as exc:  # a chunk its restore found complete: its documents stay checkpointed
        raise publication_error(exc, services, rank, "nothing of this request was written") from exc


def declared_total(scope: Scope) -> int | None:
    """`X-Total-Documents`: how many documents the job has for this rank, for progress and ETA; kept once
    the request succeeds (a refused request leaves nothing behind, not even a rank in `/stats`)."""
    raw = single_header(scope["headers"], b"x-total-documents", "X-Total-Documents")
    return None if raw is None else parse_int(raw, "X-Total-Documents")


def keep_total(services: Services, rank: int, total: int | None) -> None:
    if total is not None:
        services.metrics.rank(rank).total_documents = total


def declared_ranks(scope: Scope, rank: int) -> int | None:
    """`X-Total-Ranks`: how many ranks the job has (datatrove's world_size), so that the proxy can say when
    every one of them is finished; a rank that is not below it is refused (400), as 0 is."""
    raw = single_header(scope["headers"], b"x-total-ranks", "X-Total-Ranks")
    if raw is None:
        return None
    total = parse_int(raw, "X-Total-Ranks", maximum=MAX_RANK + 1)
    if total == 0:
        raise BadRequest("X-Total-Ranks must be at least 1: the job's ranks", param="X-Total-Ranks")
    if rank >= total:
        raise BadRequest(
            f"X-Total-Ranks {total} says the job's ranks are 0..{total - 1}, but X-Rank is {rank}",
            param="X-Total-Ranks",
        )
    return total


def keep_ranks(services: Services, total: int | None) -> None:
    if total is not None:
        services.metrics.total_ranks = total


async def post_documents(services: Services, scope: Scope, receive: Receive) -> dict[str, Any]:
    rank = rank_of(scope)
    total = declared_total(scope)
    raw_chunk = single_header(scope["headers"], b"x-chunk-index", "X-Chunk-Index")
    if raw_chunk is None:
        raise BadRequest("X-Chunk-Index is required: the chunk the documents belong to", param="X-Chunk-Index")
    chunk_index = parse_int(raw_chunk, "X-Chunk-Index")
    documents = parse_documents(await read_body(scope, receive, services.settings.max_body_bytes))
    manager = await manager_of(services, rank)
    if not services.metrics.rank(rank).known:
        services.note_progress(rank, manager)  # where the rank stood: what this write publishes is counted
    try:
        outcome = await manager.write_documents(documents, rank, chunk_index, services.checkpoints.publisher)
    except DocumentError as exc:
        raise BadRequest(str(exc)) from exc
    except ChunkCompleteError as exc:
        raise ChunkConflict(str(exc)) from exc
    except PublicationBacklog as exc:
        failure = exc.failure
        raise OutputUnavailable(
            f"rank {rank}: {exc}; nothing of this request was written, send it again later "
            f"(output: {public_output(services.settings.output)})",
            retry_after_s=failure.retry_in_s() if failure is not None else 1.0,
        ) from exc
    except PublishError as exc:
        raise publication_error(
            exc,
            services,
            rank,
            "the documents are stored, and sending this request again is harmless (they count as duplicates)",
        ) from exc
    except CacheWriteError as exc:
        if is_disk_full(exc.__cause__):
            raise cache_full(
                exc.__cause__,
                services,
                "the documents are stored, but the request cache could not be updated after a chunk was "
                "published (nothing needs to be sent again)",
            ) from exc
        raise
    except OSError as exc:
        raise storage_error(exc, services) from exc
    counters = services.metrics.rank(rank)
    if outcome.written:  # a new run of a finished rank
        services.metrics.unfinish(rank)
    counters.documents += outcome.written
    counters.done_documents += outcome.written
    counters.duplicates += outcome.duplicates
    services.note_progress(rank, manager)
    keep_total(services, rank, total)
    cache = services.caches.opened(rank)
    if cache is not None:
        for document in documents:
            await cache.mark_document_complete(document.id)
    return {
        "rank": rank,
        "chunk_index": chunk_index,
        "written": outcome.written,
        "duplicates": outcome.duplicates,
        "chunk_count": outcome.chunk_count,
        "chunk_complete": outcome.chunk_complete,
        "last_chunk_index": outcome.last_chunk_index,
    }


def publication_error(exc: PublishError, services: Services, rank: int, stored: str) -> ProxyError:
    """Complete chunks not published (they stay checkpointed, and are retried in the background): 503
    with `Retry-After`, naming the disk or output that refused them and its error (full, refusing,
    stalled: the job client retries it); 500 if a chunk's checkpoint file is gone (no retry helps)."""
    cause = exc.__cause__
    if isinstance(cause, ChunkFileGone):  # the chunk is forgotten: a retry is answered, not this again
        return ProxyError(str(exc))
    manager = services.checkpoints.opened(rank)
    failure = manager.publication_failure if manager is not None else None
    full = is_disk_full(cause)
    if exc.where == str(services.settings.checkpoints_dir):  # recording it in last_chunk failed
        where = f"recorded in the checkpoints dir {exc.where}{' (its disk is full: free space there)' if full else ''}"
    else:
        where = f"published to the output {exc.where}{' (its disk is full: free space there)' if full else ''}"
    return OutputUnavailable(
        f"rank {rank}'s complete chunks cannot be {where} now: {exc}. They stay checkpointed and are retried "
        f"in the background; {stored}",
        retry_after_s=failure.retry_in_s() if failure is not None else 1.0,
    )


def storage_error(exc: OSError, services: Services) -> ProxyError:
    """507 for a full disk (nothing was written, retry once space is freed), 500 for anything else."""
    if isinstance(exc, CheckpointDurabilityError):
        # The rank stays refused while this proxy has it open: a restarted job would only get this again.
        return ProxyError(f"{exc}; here, that means: restart inferproxy serve, then the job")
    if is_disk_full(exc):
        return InsufficientStorage(
            f"the checkpoints disk is full ({refusal_reason(exc)}); nothing of this request was written: "
            f"free space under {services.settings.checkpoints_dir} and send it again"
        )
    if exc.errno in UNWRITABLE_ERRNOS:  # remounted read-only, permissions taken away
        return checkpoints_unwritable(exc, services.settings.checkpoints_dir)
    logger.exception("checkpoint storage failed")
    return ProxyError(f"checkpoint storage failed: {exc}")


def cache_full(refused: OSError | sqlite3.Error, services: Services, message: str) -> InsufficientStorage:
    """507 for a chunk published whose rows a full disk kept in the request cache (rows nothing asks for
    again): `message` says what is done and what to do, this adds which disk is full."""
    return InsufficientStorage(
        f"{message}: the checkpoints disk is full ({refusal_reason(refused)}), free space under "
        f"{services.settings.checkpoints_dir}"
    )


def parse_documents(body: bytes) -> list[Document]:
    """One document or a JSON array of them, each validated; the first fault is named, nothing kept."""
    check_json_cost(body)
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"the body must be a document or a JSON array of documents: {exc}") from None
    check_integers(body, "the body")  # read exactly: a document is written as it came, or refused
    items = data if isinstance(data, list) else [data]
    if not items:
        raise BadRequest("the array of documents is empty")
    documents = []
    for position, item in enumerate(items):
        where = f"document {position}" if isinstance(data, list) else "the document"
        if not isinstance(item, dict):
            raise BadRequest(f"{where} must be a JSON object, got {type(item).__name__}")
        unknown = set(item) - _FIELDS
        if unknown:
            raise BadRequest(f"{where} has unknown fields {sorted(unknown)}: a document is {sorted(_FIELDS)}")
        doc_id, text = item.get("id"), item.get("text")
        if not isinstance(doc_id, str) or not doc_id:
            raise BadRequest(f"{where}: id must be a non-empty string, got {doc_id!r}", param="id")
        if not isinstance(text, str):
            raise BadRequest(f"{where} ({doc_id!r}): text must be a string, got {type(text).__name__}", param="text")
        media, metadata = item.get("media", []), item.get("metadata", {})
        if not isinstance(media, list):
            raise BadRequest(f"{where} ({doc_id!r}): media must be a list", param="media")
        if not isinstance(metadata, dict):
            raise BadRequest(f"{where} ({doc_id!r}): metadata must be an object", param="metadata")
        documents.append(Document(text=text, id=doc_id, media=media, metadata=metadata))
    return documents


def check_last(manager: CheckpointManager, chunk_index: int) -> None:
    """`ChunkConflict` if chunks after `chunk_index` hold documents (written, or published and not yet reached
    by `last_chunk`): the rank's last chunk is complete once its files are removed, theirs with them."""
    later = sorted(
        {i for i in manager.per_chunk_counts if i > chunk_index}
        | {i for i in manager.new_completed_chunks if i > chunk_index}
    )
    if later and chunk_index > manager.last_chunk_index:
        shown = ", ".join(map(str, later[:10])) + (", ..." if len(later) > 10 else "")
        raise ChunkConflict(
            f"chunk {chunk_index} cannot be the rank's last: chunks after it ({shown}) hold documents, which "
            f"completing it would delete; complete the last chunk written to ({later[-1]}), nothing was changed"
        )


async def complete_chunk(services: Services, scope: Scope, receive: Receive) -> dict[str, Any]:
    chunk_index = parse_int(scope["path_params"]["i"].encode(), "chunk index")
    rank = rank_of(scope)
    total, ranks = declared_total(scope), declared_ranks(scope, rank)
    check_last(await manager_of(services, rank), chunk_index)
    try:
        manager = await services.checkpoints.complete(rank, chunk_index)
    except PublishError as exc:
        raise publication_error(exc, services, rank, "send this request again to know when it is done") from exc
    except CacheWriteError as exc:
        if is_disk_full(exc.__cause__):
            raise cache_full(
                exc.__cause__,
                services,
                f"chunk {chunk_index} is marked complete, but the request cache could not be updated after a "
                f"chunk was published (send this request again to finish)",
            ) from exc
        raise
    except OSError as exc:
        raise storage_error(exc, services) from exc
    services.note_progress(rank, manager)
    keep_total(services, rank, total)
    keep_ranks(services, ranks)
    if manager.last_chunk_index == chunk_index:  # the last chunk published, the working files gone
        services.metrics.finish(rank)
    return {
        "rank": rank,
        "last_chunk_index": manager.last_chunk_index,
        "pending": sorted(manager.new_completed_chunks),
    }


async def get_resume(services: Services, scope: Scope, receive: Receive) -> dict[str, Any]:
    rank = rank_of(scope)
    total, ranks = declared_total(scope), declared_ranks(scope, rank)
    registry = services.checkpoints
    if registry.opened(rank) is not None or registry.has_working_files(rank):
        manager = await manager_of(services, rank)
        try:
            # Complete chunks waiting (left by a crash, or by an output that failed) are tried now.
            await manager.publish_pending(rank)
            # Chunks published may have gone from the output since the rank was opened.
            await registry.check_open_output(rank)
            # A job killed just after a write and started again asks before that write is done: it counts.
            await manager.writes_settled(RESUME_SETTLE_S)
            records_per_chunk, last = manager.records_per_chunk, manager.last_chunk_index
            skip, processed = manager.resume_state()
        except PublishError as exc:
            raise publication_error(
                exc, services, rank, "this answer is given once they are (the job client retries it)"
            ) from exc
        except CheckpointDurabilityError as exc:  # a failed fsync: what the rank holds is known after a restart
            raise storage_error(exc, services) from exc
        services.note_progress(rank, manager)
    else:
        # Nothing in progress for this rank: answer from last_chunk (or the output) alone, opening nothing.
        records_per_chunk, last = services.settings.records_per_chunk, await registry.last_chunk(rank)
        skip, processed = docs_to_skip(last, records_per_chunk), []
        counters = services.metrics.rank(rank)
        if not counters.known:  # else counted as it was written: a finished job's last chunk may be short
            counters.known, counters.known_at, counters.known_done = True, time.time(), skip
            counters.done_documents = skip
        counters.last_chunk_index = last
    keep_total(services, rank, total)
    keep_ranks(services, ranks)
    return {
        "rank": rank,
        "records_per_chunk": records_per_chunk,
        "last_chunk_index": last,
        "docs_to_skip": skip,
        "processed_ids": processed,  # sorted already
        "output": public_output(services.settings.output),
        "output_filename": services.settings.output_filename,
    }


def public_output(output: str) -> str:
    """The output as a job may see it: a local folder made absolute (against the proxy's working
    directory), a URL without the credentials, query or fragment it may carry."""
    if not is_remote(output):
        return os.path.abspath(output.removeprefix("file://"))
    parts = urlsplit(output)
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))
