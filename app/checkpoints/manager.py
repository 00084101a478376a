"""`CheckpointManager` and `RequestCache`: datatrove's checkpointing, durable and fast.

The classes keep the constructors, methods, return values, attributes and
on-disk files of `datatrove.pipeline.inference.checkpointing`, so either can
stand in for the other and resume the other's checkpoints::

    <checkpoints_local_dir>/<rank:05d>/chunk_<i:05d>.jsonl   one document per line
    <checkpoints_local_dir>/<rank:05d>/replay.sqlite3        RequestCache
    <checkpoints_local_dir>/last_chunk/<rank:05d>.txt        last_chunk_index

plus `checkpoint_meta.json`, recording `records_per_chunk` for the resume check.

The manager decides what is written where and when a chunk completes; the
rest has a module each: `app.store.layout` (every path), `app.checkpoints.chunk` (all the
state of one chunk), `app.checkpoints.chunkfiles` (opening chunk files and their fsync),
`app.checkpoints.resume` (reading checkpoints back, the `records_per_chunk` check),
`app.checkpoints.publish` (the one publisher of chunks).

Where datatrove can lose or repeat work, these do not:

- a document id already written to a chunk is not written or counted again
  (`write_document` reports it as a duplicate), so a chunk completes on
  `records_per_chunk` *distinct* documents and never early;
- appends are fsynced (`fsync="always"`, one fsync shared by concurrent
  writers) before `write_document` returns, and a failed append leaves no
  torn line; a torn last line left by a crash is dropped on resume;
- a completing chunk moves `last_chunk/<rank>.txt` (replaced atomically)
  *before* its chunk file and cache rows are deleted, so a crash between
  steps never makes the job generate a finished chunk again;
- resuming with another `records_per_chunk` fails with a clear error
  instead of silently shifting every chunk boundary;
- resuming validates every unfinished chunk file before anything is written
  or counted, reading it line by line and keeping ids, not documents; only
  a writer that needs the documents again gets them, one chunk at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import shutil
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from app.checkpoints.chunk import Chunk, ChunkState
from app.checkpoints.chunkfiles import CheckpointDurabilityError, ChunkFiles, FsyncPolicy
from app.checkpoints.documents import Document, DocumentLike, OutputWriter, encode_document, is_removed
from app.checkpoints.output import redact_url
from app.checkpoints.publish import ChunkFileGone, PublicationAbandoned, PublishError, chunk_file_gone, in_daemon_thread
from app.checkpoints.resume import (
    ChunkScan,
    RecordsPerChunkMismatch,
    check_records_per_chunk,
    docs_to_skip,
    read_chunk_file,
    read_chunk_ids,
    read_last_chunk,
    sorted_processed_ids,
)
from app.store.cache import CacheWriteError, RequestCache
from app.store.durable import atomic_write_bytes, fsync_dir, fsync_file
from app.store.layout import META_FILENAME, CheckpointsLayout, RankPaths

__all__ = [
    "META_FILENAME",
    "BatchOutcome",
    "CheckpointDurabilityError",
    "CheckpointManager",
    "ChunkCompleteError",
    "Document",
    "PublicationBacklog",
    "PublicationFailure",
    "RecordsPerChunkMismatch",
    "RequestCache",
    "WriteOutcome",
]

logger = logging.getLogger(__name__)

D = TypeVar("D", bound=DocumentLike)
_SHOWN_CHUNKS = 10  # incomplete chunks named in a warning
#: How long `close` waits for a publication it gave up to notice (it checks between 1 MiB pieces).
_ABANDON_WAIT_S = 5.0
#: How long a caller that publishes what is pending (a resume point, the last chunk's completion) waits for a
#: publication under way before it is told the output stalls (503, asked again): an upload may hang for ever.
PUBLICATION_WAIT_S = 30.0


class ChunkCompleteError(ValueError):
    """A document was sent to a chunk that is already complete."""


@dataclass(frozen=True, slots=True)
class PublicationFailure:
    """Why the rank's complete chunks are not published: the last attempt's error, and when the next is."""

    chunk_index: int
    reason: str
    error: PublishError
    since: float  # time.time() of the first failure in a row
    attempts: int
    failed_at: float  # time.monotonic() of the last attempt's end
    retry_at: float  # time.monotonic() of the next attempt

    def retry_in_s(self) -> float:
        return max(0.0, self.retry_at - time.monotonic())


class PublicationBacklog(RuntimeError):
    """`max_waiting_chunks` complete chunks of the rank wait for the output: new documents are refused
    (nothing written) until some are published. `failure` says why they wait, if an attempt failed."""

    def __init__(self, message: str, *, failure: PublicationFailure | None) -> None:
        super().__init__(message)
        self.failure = failure


@dataclass(frozen=True, slots=True)
class BatchOutcome:
    """What `write_documents` did."""

    written: int
    duplicates: int
    chunk_index: int
    chunk_count: int
    chunk_complete: bool
    last_chunk_index: int


@dataclass(frozen=True, slots=True)
class WriteOutcome:
    """What `write_document` did (datatrove's returns None; callers may ignore this)."""

    written: bool
    chunk_index: int
    chunk_count: int
    chunk_complete: bool
    last_chunk_index: int

    @property
    def duplicate(self) -> bool:
        return not self.written


class CheckpointManager:
    """Groups a rank's documents into chunks on disk and publishes complete chunks in order.

    One instance serves one rank at a time, as in datatrove. `fault` is a
    test hook called with the name of each step of chunk completion
    (`output_closed`, `last_chunk_written`, `chunk_file_deleted`,
    `cache_rows_dropped`); raising from it simulates a crash there.

    By default a write that completes a chunk publishes it before it returns,
    as datatrove's does. With `publish_in_background` (the proxy's), complete
    chunks are published by a task of their own while the rank's writes go on
    into the next chunks: a publication that fails is retried with backoff
    (`retry_backoff_s`, doubling up to `max_retry_backoff_s`) and whenever a
    caller asks (`publish_pending`), `publication_failure` saying why meanwhile;
    past `max_waiting_chunks` complete chunks waiting, new documents wait up to
    `backlog_wait_s` for a working output to catch up, and are refused
    (`PublicationBacklog`) while it fails or past that wait. `close` waits for a publication under way, or gives
    it up, before it returns.
    """

    def __init__(
        self,
        checkpoints_local_dir: str | None = None,
        records_per_chunk: int = 6000,
        request_cache: RequestCache | None = None,
        *,
        fsync: FsyncPolicy = "always",
        document_factory: Callable[[dict[str, Any]], DocumentLike] = Document.from_dict,
        fault: Callable[[str], None] | None = None,
        publish_in_background: bool = False,
        max_waiting_chunks: int | None = None,
        backlog_wait_s: float = 10.0,
        retry_backoff_s: float = 1.0,
        max_retry_backoff_s: float = 60.0,
    ) -> None:
        if checkpoints_local_dir is not None:
            checkpoints_local_dir = checkpoints_local_dir.removeprefix("file://")
            if "://" in checkpoints_local_dir:
                raise ValueError(f"checkpoints_local_dir must be a local directory, got {checkpoints_local_dir!r}")
        if records_per_chunk <= 0:
            raise ValueError("records_per_chunk must be positive")
        if fsync not in ("always", "never"):
            raise ValueError(f"fsync must be 'always' or 'never', got {fsync!r}")
        self.checkpoints_local_dir = checkpoints_local_dir
        self.records_per_chunk = records_per_chunk
        self.request_cache = request_cache
        self.fsync: FsyncPolicy = fsync
        self.document_factory = document_factory
        self.fault = fault
        self.publish_in_background = publish_in_background
        self.max_waiting_chunks = max_waiting_chunks
        self.backlog_wait_s = backlog_wait_s
        self.retry_backoff_s = retry_backoff_s
        self._writing = 0  # `write_documents` calls under way, until their fsync
        self._no_writes = asyncio.Event()
        self._no_writes.set()
        self.max_retry_backoff_s = max_retry_backoff_s
        #: Why the complete chunks waiting are not published, while the last attempt failed.
        self.publication_failure: PublicationFailure | None = None

        self.checkpoint_file_lock = asyncio.Lock()
        self.last_chunk_index = -1

        # Each chunk's whole state, from its first write or completion (`_chunk`) until it is finished (`_drop`).
        self._chunks: dict[int, Chunk] = {}
        self._chunk_files = ChunkFiles(fsync)
        self._meta_checked = False
        self._publish_lock = asyncio.Lock()
        self._publisher: asyncio.Task[None] | None = None  # publishing in the background, retrying
        self._retry_now = asyncio.Event()  # wakes the publisher from its backoff
        self._published = asyncio.Event()  # set (and replaced) as a chunk is published or a publication fails
        self._closing = False
        self._gone: BaseException | None = None  # a chunk forgotten as its file was gone, not said yet
        #: The output writer last given (a write, a restore): told of a chunk published with no document.
        self._writer: OutputWriter | None = None
        self._attempt_started = 0.0  # when the last publication attempt began (time.monotonic)

    # ------------------------------------------------------------ chunk state

    @property
    def per_chunk_counts(self) -> Counter[int]:
        """datatrove's attribute, read-only here: the documents in each chunk not yet finished."""
        return Counter({index: chunk.count for index, chunk in self._chunks.items() if chunk.count})

    @property
    def new_completed_chunks(self) -> set[int]:
        """datatrove's attribute, read-only here: the chunks published that `last_chunk` has not reached."""
        return {index for index, chunk in self._chunks.items() if chunk.state is ChunkState.PUBLISHED}

    @property
    def file_locks(self) -> Mapping[int, asyncio.Lock]:
        """datatrove's attribute, read-only here: each known chunk's lock."""
        return {index: chunk.lock for index, chunk in self._chunks.items()}

    def _chunk(self, chunk_index: int) -> Chunk:
        """The chunk's state, created OPEN the first time it is asked for."""
        chunk = self._chunks.get(chunk_index)
        if chunk is None:
            chunk = self._chunks[chunk_index] = Chunk(chunk_index)
        return chunk

    def _drop(self, chunk: Chunk) -> None:
        """Forget all of the chunk's state at once: finished (`last_chunk` moved over it), or its file gone."""
        if self._chunks.get(chunk.index) is chunk:
            del self._chunks[chunk.index]

    async def _locked_chunk(self, chunk_index: int) -> Chunk:
        """The chunk's state with its lock taken (the caller releases it): the state current once the lock
        is had, not one dropped while this waited for it."""
        while True:
            chunk = self._chunk(chunk_index)
            await chunk.lock.acquire()
            if self._chunks.get(chunk_index) is chunk:
                return chunk
            chunk.lock.release()

    def _ready_chunks(self) -> list[Chunk]:
        """The chunks with all their documents whose output is not closed yet, in order."""
        return sorted((c for c in self._chunks.values() if c.state is ChunkState.READY), key=lambda c: c.index)

    def _any_ready(self) -> bool:
        return any(chunk.state is ChunkState.READY for chunk in self._chunks.values())

    # ----------------------------------------------------------------- writing

    async def write_document(
        self, document: DocumentLike, rank: int, chunk_index: int, output_writer_context: OutputWriter
    ) -> WriteOutcome:
        """Checkpoint `document` into `chunk_index` and write it to the output.

        Returns once the line is durable under the fsync policy. A document id
        already in the chunk is neither written nor counted (`written=False`).
        Raises `DocumentError` for a document that cannot be serialised,
        `ChunkCompleteError` for a chunk already complete, `OSError` when the
        disk refuses the append; in each case nothing is written or counted.
        """
        batch = await self.write_documents([document], rank, chunk_index, output_writer_context)
        return WriteOutcome(
            written=batch.written == 1,
            chunk_index=chunk_index,
            chunk_count=batch.chunk_count,
            chunk_complete=batch.chunk_complete,
            last_chunk_index=batch.last_chunk_index,
        )

    async def write_documents(
        self, documents: Sequence[DocumentLike], rank: int, chunk_index: int, output_writer_context: OutputWriter
    ) -> BatchOutcome:
        """Checkpoint several documents of one chunk with one append and one fsync: all or nothing.

        Ids already in the chunk (or repeated in `documents`) are counted as
        duplicates and not written. Raises, with nothing written or counted:
        `DocumentError` for a document that cannot be serialised,
        `ChunkCompleteError` if the chunk is complete or the new documents
        would overfill it, `OSError` if the disk refuses the append. A chunk
        they complete that cannot be published raises `PublishError`: the
        documents are stored, and the next write or completion retries it.
        """
        self._writing += 1
        self._no_writes.clear()
        try:
            return await self._write_documents(documents, rank, chunk_index, output_writer_context)
        finally:
            self._writing -= 1
            if not self._writing:
                self._no_writes.set()

    async def writes_settled(self, timeout_s: float) -> None:
        """Until the writes under way (received, maybe not yet durable) are done, or `timeout_s` passes: a
        resume point read then counts what a job killed just after sending wrote, durably, and nothing
        that is not on disk yet."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._no_writes.wait(), timeout_s)

    async def _write_documents(
        self, documents: Sequence[DocumentLike], rank: int, chunk_index: int, output_writer_context: OutputWriter
    ) -> BatchOutcome:
        lines = [encode_document(document) for document in documents]
        self._chunk_files.check_usable()
        self._writer = output_writer_context
        if self.checkpoints_local_dir is None:
            # datatrove's behaviour without checkpoints: output only, nothing remembered.
            for document in documents:
                if not is_removed(document):
                    output_writer_context.write(document, rank=rank, chunk_index=chunk_index)
            chunk = self._chunk(chunk_index)
            chunk.count += len(documents)
            return BatchOutcome(len(documents), 0, chunk_index, chunk.count, False, -1)
        deadline = time.monotonic() + self.backlog_wait_s
        while True:
            await self._wait_for_room(deadline)
            chunk = await self._locked_chunk(chunk_index)
            try:
                ids = chunk.ids
                fresh: dict[str, int] = {}  # id -> position in `documents`, first occurrence
                for position, document in enumerate(documents):
                    if document.id in ids or document.id in fresh:
                        self._warn_duplicate(document.id, chunk)
                    else:
                        fresh[document.id] = position
                if fresh:
                    self._check_open_chunk(chunk)
                    if self._backlogged(deadline):
                        continue  # others filled the room first: wait again, the chunk's lock let go
                    room = self.records_per_chunk - chunk.count
                    if len(fresh) > room:
                        raise ChunkCompleteError(
                            f"chunk {chunk_index} has room for {room} more documents (records_per_chunk="
                            f"{self.records_per_chunk}), this request brings {len(fresh)}: the rest belong in the next"
                        )
                    data = lines[0] if len(lines) == 1 else b"".join(lines[position] for position in fresh.values())
                    self._ensure_meta()
                    file = chunk.file
                    if file is None:
                        file = chunk.file = await self._chunk_files.open(self._paths(rank).chunk_file(chunk_index))
                    file.append(data)
                    try:
                        for position in fresh.values():
                            if not is_removed(documents[position]):
                                output_writer_context.write(documents[position], rank=rank, chunk_index=chunk_index)
                    except BaseException:
                        file.truncate(file.size - len(data))
                        raise
                    if chunk.output is None:
                        first = documents[next(iter(fresh.values()))]
                        name = output_writer_context._get_output_filename(first, rank, chunk_index=chunk_index)
                        chunk.output = (output_writer_context, name)
                    ids.update(fresh)
                    chunk.unsynced.update(fresh)
                    chunk.count += len(fresh)
                    if chunk.count == self.records_per_chunk:
                        # Decided here, under the lock: a caller cancelled below cannot lose it.
                        chunk.mark_ready()
                # The count and whether it is complete, read together: read after the fsync below, a
                # chunk other writers filled meanwhile was "complete" beside this write's count of 1.
                count = chunk.count
                complete = chunk.state is not ChunkState.OPEN or chunk_index <= self.last_chunk_index
                appended = set(chunk.unsynced)  # this write's and those before it: durable with its fsync
            finally:
                chunk.lock.release()
            break
        # Outside the chunk lock, so the chunk's other writers share this fsync.
        await self._chunk_files.make_durable(chunk.file)
        chunk.unsynced -= appended
        if self._publication_due():
            if self.publish_in_background:
                self._start_publisher(rank)
            else:
                # Shielded: once started, publishing finishes even if this caller is cancelled.
                await asyncio.shield(self._publish_ready(rank))
        return BatchOutcome(
            written=len(fresh),
            duplicates=len(documents) - len(fresh),
            chunk_index=chunk_index,
            chunk_count=count,
            chunk_complete=complete,
            last_chunk_index=self.last_chunk_index,
        )

    def busy(self) -> bool:
        """Whether a write, a publication or a completion is under way, or a complete chunk is about to be
        published. A chunk waiting for an output that failed is not: the rank may be released meanwhile,
        the chunk staying in its checkpoints for the next owner to publish."""
        return bool(
            self._writing  # a write waiting for its fsync holds no lock, and must not see its file closed
            or (self._any_ready() and self.publication_failure is None)
            or self._publish_lock.locked()
            or self.checkpoint_file_lock.locked()
            or any(chunk.lock.locked() for chunk in self._chunks.values())
        )

    def waiting_chunks(self) -> list[int]:
        """The complete chunks not yet published, in order."""
        return [chunk.index for chunk in self._ready_chunks()]

    def _publication_due(self) -> bool:
        # the latter: a chunk published whose last_chunk could not be recorded
        after = self._chunks.get(self.last_chunk_index + 1)
        return self._any_ready() or (after is not None and after.state is ChunkState.PUBLISHED)

    async def _wait_for_room(self, deadline: float) -> None:
        """Past `max_waiting_chunks` chunks waiting for an output that works but is slower than the writes,
        wait (until `deadline`) for it to catch up, as a write waiting for its upload would: the writers
        are slowed down, not refused. An output that fails is not waited for (`_backlogged`)."""
        limit = self.max_waiting_chunks
        if limit is None or not self.publish_in_background:
            return
        while len(self._ready_chunks()) >= limit and self.publication_failure is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._published.wait(), remaining)

    def _signal_published(self) -> None:
        self._published.set()
        self._published = asyncio.Event()

    def _backlogged(self, deadline: float) -> bool:
        """Whether a write of new documents must wait for room (`_wait_for_room`) before it is taken; past
        the deadline, or while publications fail, `PublicationBacklog` refuses it instead."""
        limit = self.max_waiting_chunks
        if limit is None:
            return False
        waiting = len(self._ready_chunks())
        if waiting < limit:
            return False
        failure = self.publication_failure
        if failure is None and self.publish_in_background and time.monotonic() < deadline:
            return True
        why = f"the last attempt failed: {failure.reason}" if failure is not None else "the output is slow"
        raise PublicationBacklog(
            f"{waiting} complete chunks of this rank are waiting to be published ({why}); new "
            f"documents are taken again once fewer than max_waiting_chunks={limit} wait",
            failure=failure,
        )

    # ------------------------------------------------------------- publishing

    def _start_publisher(self, rank: int) -> None:
        """Publish what is due in a task of its own, unless one runs already (it takes the new chunks too)."""
        if self._publisher is not None and not self._publisher.done():
            return
        self._publisher = asyncio.create_task(self._publish_in_background(rank), name=f"publish-rank-{rank}")

    async def _publish_in_background(self, rank: int) -> None:
        """Publish until nothing is due; after a failure, wait (backoff, or a `publish_pending`) and retry."""
        while self._publication_due():
            try:
                await self._attempt(rank)
            except PublishError as exc:
                failure = self.publication_failure
                if failure is None:  # a chunk whose file is gone, forgotten: the rest are tried at once
                    self._gone = exc  # and the next `publish_pending` says it, once
                    continue
                if self._closing:
                    return  # not retried: the rank's next owner publishes it
                self._retry_now.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._retry_now.wait(), failure.retry_in_s())
                if self._closing:
                    return
            except (CheckpointDurabilityError, PublicationAbandoned):
                return  # the manager refuses everything now, or is closing: the rank's next owner publishes
            except Exception:
                logger.exception("publishing rank %d's chunks failed; the rank's next write tries again", rank)
                return

    async def publish_pending(self, rank: int) -> None:
        """Publish the complete chunks waiting now, retrying at once a publication that failed; raises
        `PublishError` if that fails (the background retries go on). An attempt under way answers for
        this call too: its failure is raised rather than tried again at once; so does one that failed
        less than `retry_backoff_s` ago, so that a storm of requests is not a storm of uploads."""
        self._say_gone()
        if not self._publication_due():
            return
        asked = time.monotonic()
        try:
            if self._publish_lock.locked():
                try:
                    async with asyncio.timeout(PUBLICATION_WAIT_S), self._publish_lock:
                        pass
                except TimeoutError:
                    raise self._stalled(rank) from None
                self._say_gone()
                failure = self.publication_failure
                if failure is not None and failure.failed_at >= asked:
                    raise failure.error.with_traceback(None)  # else each raise adds its frames to it
                if not self._publication_due():
                    return
            failure = self.publication_failure
            if failure is not None and asked - failure.failed_at < self.retry_backoff_s:
                raise failure.error.with_traceback(None)
            await asyncio.shield(self._attempt(rank))
        finally:
            if self.publish_in_background and self._publication_due():
                self._start_publisher(rank)

    def _stalled(self, rank: int) -> PublishError:
        """A publication under way past `PUBLICATION_WAIT_S`, for a caller that will not wait longer (a resume
        point, the last chunk's completion: answered 503, asked again)."""
        ran = time.monotonic() - self._attempt_started
        output = getattr(self._writer, "output", None)
        return PublishError(
            f"a publication of rank {rank}'s chunks has run for {ran:.0f} s without ending (a stalled output?)",
            where=redact_url(output) if isinstance(output, str) else "the output",
        )

    def _say_gone(self) -> None:
        """Raise, once, the error of a chunk forgotten since its file was found gone: the job hears of it."""
        gone, self._gone = self._gone, None
        if gone is not None:
            raise gone.with_traceback(None)

    async def _attempt(self, rank: int) -> None:
        """One round of `_publish_ready`, keeping `publication_failure` up to date. An error nobody foresaw
        is a failure like an output's, retried with backoff: were it the publisher's end, the chunks
        waiting would stay so, and past `max_waiting_chunks` the rank's writes be refused, until a
        `publish_pending`."""
        self._attempt_started = time.monotonic()
        try:
            try:
                await self._publish_ready(rank)
            except (PublishError, CheckpointDurabilityError, PublicationAbandoned):
                raise
            except Exception as exc:
                logger.exception("publishing rank %d's chunks failed", rank)
                raise PublishError(
                    f"publishing rank {rank}'s chunks failed: {type(exc).__name__}: {exc}",
                    where=str(self.checkpoints_local_dir),
                ) from exc
        except PublishError as exc:
            if chunk_file_gone(exc):
                raise  # no outage to retry: the chunk is forgotten (`_forget_chunk`)
            previous = self.publication_failure
            attempts = previous.attempts + 1 if previous is not None else 1
            delay = min(self.retry_backoff_s * 2 ** (attempts - 1), self.max_retry_backoff_s)
            chunk_index = min((c.index for c in self._ready_chunks()), default=self.last_chunk_index + 1)
            self.publication_failure = PublicationFailure(
                chunk_index=chunk_index,
                reason=str(exc),
                error=exc,
                since=previous.since if previous is not None else time.time(),
                attempts=attempts,
                failed_at=time.monotonic(),
                retry_at=time.monotonic() + delay,
            )
            self._signal_published()  # the writers waiting for room are refused now, not kept waiting
            if previous is None:
                logger.error(
                    "publishing rank %d's chunk %d failed: %s; its documents stay checkpointed, the rank's "
                    "writes go on, and it is retried in %g s (then with backoff up to %g s)",
                    rank,
                    chunk_index,
                    exc,
                    delay,
                    self.max_retry_backoff_s,
                )
            raise
        if self.publication_failure is not None:
            failure, self.publication_failure = self.publication_failure, None
            logger.warning(
                "rank %d's chunks are published again, after %d failed attempts over %.0f s",
                rank,
                failure.attempts,
                time.time() - failure.since,
            )

    def resume_state(self) -> tuple[int, list[str]]:
        """`(docs_to_skip, processed_ids)` as `parse_existing_checkpoints` would return them now, the ids
        sorted (as `GET /resume` lists them), but for those whose fsync has not returned yet (a job skips
        what is listed: it must be on disk whatever crashes next); `CheckpointDurabilityError` once an fsync
        failed, when what is on disk is no longer known."""
        self._chunk_files.check_usable()
        ids = {
            index: chunk.ids - chunk.unsynced if chunk.unsynced else chunk.ids for index, chunk in self._chunks.items()
        }
        return docs_to_skip(self.last_chunk_index, self.records_per_chunk), sorted_processed_ids(
            self.last_chunk_index, ids
        )

    def _warn_duplicate(self, doc_id: str, chunk: Chunk) -> None:
        if chunk.warned_duplicate or chunk.state is ChunkState.READY:
            return
        chunk.warned_duplicate = True
        logger.warning(
            "document id %r was written to chunk %d again and counted once; if the input repeats ids "
            "(rather than a write being retried), chunk %d will not reach %d distinct documents",
            doc_id,
            chunk.index,
            chunk.index,
            self.records_per_chunk,
        )

    def _check_open_chunk(self, chunk: Chunk) -> None:
        if (
            chunk.index <= self.last_chunk_index
            or chunk.state is not ChunkState.OPEN  # full, or declared complete, being published or published
            or chunk.count >= self.records_per_chunk
        ):
            raise ChunkCompleteError(
                f"chunk {chunk.index} is already complete (last_chunk_index={self.last_chunk_index}); "
                f"a document for it belongs to another chunk, or was already written before a restart"
            )

    async def _publish_ready(self, rank: int) -> None:
        """Publish every chunk that has all its documents, then advance `last_chunk_index`.

        A chunk's output is closed only after its checkpoint is durable, and
        always before `last_chunk` moves past it. A chunk whose output fails to
        close stays ready and is retried by the next write or cleanup.
        """
        async with self._publish_lock:
            for chunk in self._ready_chunks():
                await self._chunk_files.make_durable(chunk.file)
                if chunk.output is not None:
                    writer, name = chunk.output
                    close_async = getattr(writer, "close_file_async", None)  # a slow close, off the event loop
                    try:
                        if close_async is not None:
                            await close_async(name)
                        else:
                            writer.close_file(name)
                    except (ChunkFileGone, PublishError) as exc:
                        if chunk_file_gone(exc):
                            self._forget_chunk(rank, chunk)
                        raise
                    chunk.output = None
                elif not chunk.count:
                    await self._publish_empty(rank, chunk)
                self._fault("output_closed")
                chunk.mark_published()
                self._signal_published()
        await self.update_last_chunk_index(rank)

    async def _publish_empty(self, rank: int, chunk: Chunk) -> None:
        """A chunk declared complete before any document of it was written (the job's last): nothing to
        close, but an output writer that checks its output against `last_chunk` (`ChunkPublisher`) records
        it as published empty, else it would take the chunk for one lost from the output."""
        publish_empty = getattr(self._writer, "publish_empty", None)
        if publish_empty is not None:
            await asyncio.to_thread(publish_empty, rank, chunk.index)

    def _forget_chunk(self, rank: int, chunk: Chunk) -> None:
        """A complete chunk whose checkpoint file is gone (removed under the running proxy): forget it, as a
        restarted proxy would find it, so that the job generates its documents again (they are no longer
        among the processed ids) instead of meeting the same error at every resume."""
        logger.error(
            "rank %d's chunk %d cannot be published: its checkpoint file is gone; its %d documents are "
            "forgotten, and the job generates them again once restarted",
            rank,
            chunk.index,
            chunk.count,
        )
        self._drop(chunk)
        self._chunk_files.remove(chunk.take_file(), self._paths(rank).chunk_file(chunk.index))

    # ---------------------------------------------------------------- resuming

    async def parse_existing_checkpoints(self, rank: int, output_writer_context: OutputWriter) -> tuple[int, set[str]]:
        """Reload the rank's checkpoints, rewrite unfinished chunks to the output writer.

        Returns `(documents_to_skip, processed_ids)`: skip the first
        `documents_to_skip` input documents, and every later one whose id is
        in `processed_ids`. Same numbers as datatrove's.

        Every unfinished chunk file is read line by line and validated before
        anything is written or counted, keeping only its ids. A writer with
        `needs_documents = False` (`ChunkPublisher`, which renders a chunk
        from its checkpoint file when it publishes it) gets nothing more;
        any other (a datatrove `JsonlWriter`) then gets each chunk's
        documents again, one chunk in memory at a time.
        """
        all_ids: set[str] = set()
        return await self._restore(rank, output_writer_context, all_ids), all_ids

    async def restore(self, rank: int, output_writer_context: OutputWriter) -> int:
        """`parse_existing_checkpoints` without the set of processed ids, for a caller that asks the
        manager later (`resume_state`): at a million ids the set was a fifth of resume's peak memory."""
        return await self._restore(rank, output_writer_context, None)

    async def _restore(self, rank: int, output_writer_context: OutputWriter, all_ids: set[str] | None) -> int:
        """Documents to skip; every processed id read is added to `all_ids` when there is one."""
        if not self.checkpoints_local_dir:
            return 0
        self._chunk_files.check_usable()
        self._ensure_meta()
        self._writer = output_writer_context
        rewrite = getattr(output_writer_context, "needs_documents", True)
        async with self.checkpoint_file_lock:
            self.last_chunk_index = max(self.last_chunk_index, self._read_last_chunk(rank))
            chunks = await asyncio.to_thread(self._scan_chunks, rank)
            clean = getattr(output_writer_context, "remove_stale_temporaries", None)
            if clean is not None and (chunks or self.last_chunk_index >= 0):  # a new rank published nothing
                try:
                    await in_daemon_thread(lambda: clean(rank), f"clean output {rank}")  # never joined at exit
                except OSError as exc:  # left for the next restore; the publications do not need it
                    logger.warning("could not look for temporary files of rank %d in the output: %s", rank, exc)
            for chunk_index, path, scan in chunks:
                chunk = await self._locked_chunk(chunk_index)
                try:
                    known = chunk.ids
                    fresh = scan.ids - known if known else scan.ids
                    if not fresh:
                        continue
                    if rewrite:
                        await self._rewrite(rank, chunk, path, fresh, output_writer_context)
                    elif chunk.output is None and scan.first is not None:
                        first = self.document_factory(scan.first)
                        name = output_writer_context._get_output_filename(first, rank, chunk_index=chunk_index)
                        chunk.output = (output_writer_context, name)
                    if known:
                        known |= fresh
                    else:
                        chunk.ids = fresh
                    if all_ids is not None:
                        all_ids |= fresh
                    chunk.count += len(fresh)
                    if chunk.count >= self.records_per_chunk:
                        chunk.mark_ready()
                finally:
                    chunk.lock.release()
        if self.request_cache is not None and self.last_chunk_index >= 0:
            # A crash between deleting the last chunk's file and dropping its
            # cache rows leaves those rows behind; nothing will ask for them.
            await self.request_cache.drop_chunk(self.last_chunk_index)
        if self._any_ready():
            if self.publish_in_background:
                self._start_publisher(rank)  # `publish_pending` waits for it, if the caller must know
            else:
                await asyncio.shield(self._publish_ready(rank))
        return docs_to_skip(self.last_chunk_index, self.records_per_chunk)

    async def _rewrite(
        self, rank: int, chunk: Chunk, path: str, fresh: set[str], output_writer_context: OutputWriter
    ) -> None:
        """Write the first occurrence of each of `fresh`'s ids in the chunk file to the output, as datatrove does."""
        waiting = set(fresh)
        for document in await asyncio.to_thread(read_chunk_file, path, self.records_per_chunk, self.document_factory):
            if document.id not in waiting:
                continue
            waiting.discard(document.id)
            if not is_removed(document):
                output_writer_context.write(document, rank=rank, chunk_index=chunk.index)
            if chunk.output is None:
                name = output_writer_context._get_output_filename(document, rank, chunk_index=chunk.index)
                chunk.output = (output_writer_context, name)

    def _scan_chunks(self, rank: int) -> list[tuple[int, str, ChunkScan]]:
        """Validate the rank's unfinished chunk files, all before anything is written; keep their ids."""
        chunks: list[tuple[int, str, ChunkScan]] = []
        for chunk_index, path in self._paths(rank).chunk_files():
            if chunk_index <= self.last_chunk_index:
                # Left by a crash after last_chunk moved past it: already published.
                logger.info("Removing %s: chunk %d is already complete", path, chunk_index)
                os.remove(path)
                continue
            chunks.append((chunk_index, path, read_chunk_ids(path, self.records_per_chunk)))
        if chunks and self._chunk_files.fsync == "always":
            # What was read may never have been fsynced: written by a process killed before its fsync,
            # it is in the page cache only. Counted as processed, a retry of such a document is
            # acknowledged as a duplicate without writing anything, and a power cut then loses it.
            for _, path, _ in chunks:
                fsync_file(path)
            fsync_dir(os.path.dirname(chunks[0][1]))
        return chunks

    def _read_last_chunk(self, rank: int) -> int:
        return read_last_chunk(self._paths(rank).last_chunk_file)

    # -------------------------------------------------------------- completing

    async def cleanup_last_chunk(self, rank: int, chunk_index: int) -> None:
        """Mark the job's last (possibly partial) chunk complete; remove the rank dir once it is reached.

        The chunk's output is closed first, so a crash can never leave
        `last_chunk` past a chunk whose output was not published.
        """
        if self.checkpoints_local_dir is None:
            return
        if chunk_index > self.last_chunk_index:  # else done already: marking it again is harmless
            self._chunk_files.check_usable()
            # Under the chunk's lock: a write already appending finishes first (and is published),
            # any later one is refused as a write to a complete chunk.
            chunk = await self._locked_chunk(chunk_index)
            try:
                if chunk_index > self.last_chunk_index:  # else finished while this call waited for the lock
                    chunk.mark_ready()
            finally:
                chunk.lock.release()
            if self.publish_in_background:
                await self.publish_pending(rank)
            else:
                await asyncio.shield(self._publish_ready(rank))
        rank_dir = self._paths(rank).rank_dir
        if self.last_chunk_index >= chunk_index:
            if self.last_chunk_index == chunk_index and os.path.exists(rank_dir):
                await self._close_files()
                shutil.rmtree(rank_dir)
            return
        # The first few only: chunk_index comes from the job and may be far ahead (listing all could fill memory).
        published, counts = self.new_completed_chunks, self.per_chunk_counts
        incomplete = (c for c in range(self.last_chunk_index + 1, chunk_index) if c not in published)
        waiting = list(itertools.islice(incomplete, _SHOWN_CHUNKS + 1))
        more = ", ..." if len(waiting) > _SHOWN_CHUNKS else ""
        waiting = waiting[:_SHOWN_CHUNKS]
        logger.warning(
            "the job ended but chunks [%s%s] are incomplete (%s%s of %d documents): some documents failed or the "
            "input repeats ids. Their checkpoints stay in %s, so a restart retries what is missing",
            ", ".join(map(str, waiting)),
            more,
            ", ".join(str(counts[c]) for c in waiting),
            more,
            self.records_per_chunk,
            rank_dir,
        )

    async def update_last_chunk_index(self, rank: int) -> None:
        """Advance `last_chunk_index` over every complete chunk that follows it.

        For each chunk, in this order, so that a crash between two steps
        never loses or repeats a chunk: write `last_chunk/<rank>.txt`
        (atomically), delete the chunk file, drop the chunk's cache rows.
        """
        if self.checkpoints_local_dir is None:
            return
        # Shielded: a cancelled caller does not stop a chunk half-way through these steps.
        await asyncio.shield(self._advance(rank))

    async def _advance(self, rank: int) -> None:
        async with self.checkpoint_file_lock:
            while (chunk := self._chunks.get(self.last_chunk_index + 1)) is not None and (
                chunk.state is ChunkState.PUBLISHED
            ):
                chunk_index = chunk.index
                last_chunk_file = self._paths(rank).last_chunk_file
                try:
                    await asyncio.to_thread(atomic_write_bytes, last_chunk_file, str(chunk_index).encode())
                except OSError as exc:  # the documents are stored: the next write or completion tries again
                    where = str(self.checkpoints_local_dir)
                    raise PublishError(
                        f"recording chunk {chunk_index} in {last_chunk_file} failed: {exc}", where=where
                    ) from exc
                self.last_chunk_index = chunk_index
                self._fault("last_chunk_written")
                async with chunk.lock:
                    self._chunk_files.remove(chunk.take_file(), self._paths(rank).chunk_file(chunk_index))
                self._fault("chunk_file_deleted")
                logger.info("Finished chunk %d", chunk_index)
                self._drop(chunk)
                if self.request_cache is not None:
                    try:
                        await self.request_cache.drop_chunk(chunk_index)
                    except CacheWriteError as exc:  # the chunk is done: its rows go at the cache's next commit
                        logger.warning(
                            "rank %d's chunk %d is published, its cached answers not dropped yet: %s",
                            rank,
                            chunk_index,
                            exc,
                        )
                self._fault("cache_rows_dropped")

    def remaining(
        self, documents: Iterable[D], docs_to_skip: int, processed_ids: Collection[str]
    ) -> tuple[list[tuple[D, int]], int]:
        """datatrove's resume loop in one call.

        Returns the `(document, chunk_index)` pairs still to process (input
        position >= `docs_to_skip` and id not in `processed_ids`), and the
        chunk index of the last input document, for `cleanup_last_chunk`
        (-1 for an empty input).
        """
        todo: list[tuple[D, int]] = []
        last_chunk = -1
        for position, document in enumerate(documents):
            last_chunk = position // self.records_per_chunk
            if position >= docs_to_skip and document.id not in processed_ids:
                todo.append((document, last_chunk))
        return todo, last_chunk

    def chunk_index_gen(self) -> Iterator[int]:
        """0 repeated `records_per_chunk` times, then 1, and so on: the chunk of each input position."""
        chunk_index = 0
        while True:
            for _ in range(self.records_per_chunk):
                yield chunk_index
            chunk_index += 1

    async def close(self, *, grace_s: float | None = None) -> bool:
        """Stop publishing, make every append durable and close the chunk files; idempotent.

        Complete chunks are published within `grace_s` (None: as long as it takes), the one under way
        then given up (its temporary file removed); a failed one is not retried. Returns False if one is
        still running even so (a thread stuck in a stalled upload): the rank's lock must then stay
        held until the process exits, so that no other proxy publishes beside it.
        """
        self._closing = True
        self._retry_now.set()
        stopped = await self._publications_stopped(grace_s)
        if not stopped:
            for writer, name in [chunk.output for chunk in self._chunks.values() if chunk.output is not None]:
                abandon = getattr(writer, "abandon_file", None)
                if abandon is not None:
                    abandon(name)
            stopped = await self._publications_stopped(_ABANDON_WAIT_S)
        await self._close_files()
        return stopped

    def publishing(self) -> bool:
        """Whether a publication (or the task that makes them) still runs."""
        return (self._publisher is not None and not self._publisher.done()) or self._publish_lock.locked()

    async def _publications_stopped(self, timeout_s: float | None) -> bool:
        """Wait up to `timeout_s` for the background publisher and any publication to end."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self.publishing():
            if deadline is not None and time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    # ----------------------------------------------------------------- helpers

    async def _close_files(self) -> None:
        """Make every append durable and close every chunk's open file; a later write opens it again."""
        files = [file for chunk in self._chunks.values() if (file := chunk.take_file()) is not None]
        await self._chunk_files.close(files)

    def _ensure_meta(self) -> None:
        """Record `records_per_chunk` beside the checkpoints, or check it against the recorded one."""
        if not self._meta_checked:
            assert self.checkpoints_local_dir is not None
            check_records_per_chunk(CheckpointsLayout(self.checkpoints_local_dir), self.records_per_chunk, record=True)
            self._meta_checked = True

    def _paths(self, rank: int) -> RankPaths:
        assert self.checkpoints_local_dir is not None
        return RankPaths(self.checkpoints_local_dir, rank)

    def _fault(self, step: str) -> None:
        if self.fault is not None:
            self.fault(step)
