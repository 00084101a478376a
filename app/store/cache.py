"""`RequestCache`: the SQLite replay store, a drop-in for datatrove's.

Same file (`<dir>/<rank:05d>/replay.sqlite3`), same table, columns and
primary key `(doc_id, rollout_idx, payload_hash)`, same methods and return
values as datatrove's `RequestCache`; a cache either one wrote is read by
the other. What differs is how it gets there:

- stores are buffered and written by one writer in a single transaction per
  flush window (group commit, WAL): one commit per window, not per row. A
  crash loses at most the last window (`flush_interval_ms`, default 50 ms)
  and never corrupts the file; `flush()` and `close()` return only once
  everything stored before them is durable (`synchronous=FULL`);
- lookups are a direct `sqlite3` point query on the caller's thread;
- the schema grows only through the named migrations in `MIGRATIONS`.

Like datatrove's, a lookup only serves answers a previous run stored (the
doc ids present when `initialize` ran), so a job that repeats a request in
one run gets a fresh generation. `replay_same_run=True`, which the proxy
uses, also serves answers stored in this run, at once, before they are
committed: the same key then always gets the same answer.

Which documents have answers is for SQLite's primary key index to say, not
for a copy of their ids in memory. datatrove loads every doc id into a
Python set at start (~95 bytes an id; a 10M-answer cache took seconds and
gigabytes before its rank could answer), so that a document without answers
is a miss without a query. A table of 64-bit hashes of the ids would still
cost ~16 bytes an id, a load at start, and collisions to settle; the index
costs nothing and loads nothing, and a miss pays one index probe of a few µs
(bench/README.md) before the upstream call it leads to anyway. What remains
in memory is exact, never hashed:

- the ids marked complete (`mark_document_complete`): lookups for them are
  misses without a query, until an answer is stored for them again (with
  `replay_same_run`). Those without answers (none stored, or their chunk
  dropped) need not be remembered: once the set has doubled since it was
  last looked over, the writer looks its ids up in SQLite in one go (a set
  insertion a mark, amortised) and forgets those. So it holds at most about
  twice the completed documents with answers, those of the open chunks;
- without `replay_same_run`, what was present when `initialize` ran is a
  rowid bound: SQLite gives a new row the largest rowid plus one, the bound
  is lowered when a drop removes the largest rows (so none is reused below
  it), and a document is served only while it has a row at or below the
  bound. This assumes one writer per file, as the proxy's rank ownership and
  datatrove's one task per rank ensure.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import re
import shutil
import sqlite3
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import orjson

from app.store.durable import check_safe, is_disk_full, make_dirs_durable, refusal_reason
from app.store.hashing import payload_hash
from app.tasks import cancel_and_wait, run_to_end

logger = logging.getLogger(__name__)

DB_FILENAME = "replay.sqlite3"
#: The cache file and those SQLite keeps beside it (its WAL, the WAL's index, a rollback journal).
SQLITE_SUFFIXES = ("", "-wal", "-shm", "-journal")
#: SQLite's ceiling (its default SQLITE_MAX_MMAP_SIZE): pages past the map are read with a system call
#: each, which a 10M-answer cache (3 GiB) paid for a third of its lookups at the 1 GiB used before. Only
#: address space: the pages are the kernel's file cache, shared and reclaimable.
READER_MMAP_BYTES = 0x7FFF0000
READER_CACHE_KIB = 64 * 1024

#: Append-only: a migration, once released, is never edited. Each runs once
#: per file, in order, recorded by name in `inferproxy_migrations`.
MIGRATIONS: tuple[tuple[str, str], ...] = (
    (
        # datatrove's own table: IF NOT EXISTS makes this a no-op on its files.
        "0001_datatrove_request_cache",
        """
        CREATE TABLE IF NOT EXISTS request_cache (
            chunk_index INTEGER NOT NULL,
            doc_id TEXT NOT NULL,
            rollout_idx INTEGER NOT NULL,
            payload_hash TEXT NOT NULL,
            result BLOB,
            error_message TEXT,
            PRIMARY KEY (doc_id, rollout_idx, payload_hash)
        );
        CREATE INDEX IF NOT EXISTS idx_request_cache_chunk ON request_cache(chunk_index);
        """,
    ),
    (
        # What the HTTP proxy replays besides the body. Nullable or defaulted,
        # so datatrove's INSERTs, which name their six columns, still work.
        "0002_http_response_columns",
        """
        ALTER TABLE request_cache ADD COLUMN status_code INTEGER;
        ALTER TABLE request_cache ADD COLUMN content_type TEXT;
        ALTER TABLE request_cache ADD COLUMN streamed INTEGER NOT NULL DEFAULT 0;
        """,
    ),
    (
        # The route an answer was stored for (`/v1/chat/completions`, `/v1/completions`): a body sent to the
        # other is answered by it, not with this answer. NULL in a row datatrove wrote: served to either.
        "0003_endpoint_column",
        """
        ALTER TABLE request_cache ADD COLUMN endpoint TEXT;
        """,
    ),
)

_INSERT = (
    # OR REPLACE: the newest answer for a key wins, as in datatrove.
    "INSERT OR REPLACE INTO request_cache (chunk_index, doc_id, rollout_idx, payload_hash, "
    "result, error_message, status_code, content_type, streamed, endpoint) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
_SELECT = "SELECT result, error_message FROM request_cache WHERE doc_id = ? AND rollout_idx = ? AND payload_hash = ?"
_SELECT_RESPONSE = (
    "SELECT result, error_message, status_code, content_type, streamed, endpoint FROM request_cache "
    "WHERE doc_id = ? AND rollout_idx = ? AND payload_hash = ?"
)
# Covered by the primary key's index (its entries hold the rowid): no table page is read.
_HAS_ROWS_BEFORE = "SELECT 1 FROM request_cache WHERE doc_id = ? AND rowid <= ? LIMIT 1"
_IDS_PER_QUERY = 500  # under SQLite's limit on bound parameters
#: Completed ids kept before the first look for those without answers.
SWEEP_COMPLETE_FROM = 4096


#: The keys of a result in datatrove's form (its `InferenceResult`, as its runner caches it).
DATATROVE_RESULT = frozenset({"text", "finish_reason", "usage"})


class StoredResponse(NamedTuple):
    """An HTTP answer as the proxy replays it: status, body bytes and content type, unchanged.

    A NamedTuple (immutable too): one is built per cache hit, in a third of a frozen dataclass's time.
    """

    status: int
    body: bytes
    content_type: str
    streamed: bool = False

    def is_datatrove_result(self) -> bool:
        """Whether it is a result in datatrove's form (as its runner caches one, or the proxy stores one for a
        request keyed by datatrove's hash) rather than an HTTP answer: a prefix compared, a parse if it matches."""
        if self.status != 200 or self.streamed or not self.body.startswith(b'{"text"'):
            return False
        try:
            result = orjson.loads(self.body)
        except orjson.JSONDecodeError:
            return False
        return isinstance(result, dict) and "choices" not in result and result.keys() >= DATATROVE_RESULT


class CacheWriteError(RuntimeError):
    """Stored answers could not be made durable; they stay queued and are retried. Its `__cause__` is what
    refused them (SQLite's error: a full disk is `durable.is_disk_full`)."""


class _Row(NamedTuple):
    chunk_index: int
    doc_id: str
    rollout_idx: int
    payload_hash: str
    result: bytes | None
    error_message: str | None
    status_code: int | None
    content_type: str | None
    streamed: int
    endpoint: str | None = None


_Key = tuple[str, int, str]

#: An OpenAI answer's `object` and the route that answers with it: which route a row answered when it was
#: stored before the rows kept theirs (`endpoint` NULL, by an inferproxy from before migration 0003).
_OBJECT = re.compile(rb'"object"\s*:\s*"(chat\.completion|text_completion)')
_ROUTE_OF_OBJECT = {b"chat.completion": "/v1/chat/completions", b"text_completion": "/v1/completions"}


def route_of(body: bytes | None) -> str | None:
    """The route whose answer `body` is (a completion, or a stream of its chunks); None for another body (an
    error answers either route)."""
    found = _OBJECT.search(body) if body else None
    return None if found is None else _ROUTE_OF_OBJECT[found.group(1)]


def apply_migrations(conn: sqlite3.Connection) -> list[str]:
    """Bring `conn`'s schema up to date; return the names of the migrations applied now."""
    conn.execute("CREATE TABLE IF NOT EXISTS inferproxy_migrations (name TEXT PRIMARY KEY, applied_at REAL NOT NULL)")
    applied: list[str] = []
    for name, script in MIGRATIONS:
        # IMMEDIATE takes the write lock first, so two processes opening one
        # file cannot both decide a migration is missing.
        conn.execute("BEGIN IMMEDIATE")
        try:
            if conn.execute("SELECT 1 FROM inferproxy_migrations WHERE name = ?", (name,)).fetchone():
                conn.execute("COMMIT")
                continue
            for statement in filter(str.strip, script.split(";")):
                conn.execute(statement)
            conn.execute("INSERT INTO inferproxy_migrations (name, applied_at) VALUES (?, ?)", (name, time.time()))
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        applied.append(name)
    return applied


class RequestCache:
    """SQLite-backed replay of each request's answer, per rank.

    `checkpoints_local_dir=None` disables it: every method is then a no-op
    and every lookup a miss, as in datatrove.
    """

    def __init__(
        self, checkpoints_local_dir: str | None, *, flush_interval_ms: float = 50.0, replay_same_run: bool = False
    ) -> None:
        if flush_interval_ms <= 0:
            raise ValueError(f"flush_interval_ms must be > 0, got {flush_interval_ms}")
        self.base_dir = checkpoints_local_dir
        self.enabled = checkpoints_local_dir is not None
        self.flush_interval = flush_interval_ms / 1000.0
        self.replay_same_run = replay_same_run
        self.db_path: str | None = None
        self._reader: sqlite3.Connection | None = None
        self._writer: sqlite3.Connection | None = None
        self._lookup: sqlite3.Cursor
        # Marked complete: misses without a query (the module's docstring).
        self._complete: set[str] = set()
        self._sweep_at = SWEEP_COMPLETE_FROM
        # Without replay_same_run: the largest rowid of a row present when initialize ran.
        self._before = 0
        # Stored but not yet committed, and being committed: lookups see both.
        self._pending: dict[_Key, _Row] = {}
        self._committing: dict[_Key, _Row] = {}
        # Chunks whose rows are to be deleted: kept until a commit deletes them (one the disk refused is
        # retried by the writer with the rows).
        self._drops: set[int] = set()
        self._has_pending = asyncio.Event()
        #: answers stored so far: a lookup that missed is still a miss while this has not moved
        self.stores = 0
        self._write_lock = asyncio.Lock()
        self._writer_task: asyncio.Task[None] | None = None

    async def initialize(self, rank: int) -> None:
        """Open (creating or migrating) the rank's cache file and start the writer."""
        if not self.enabled or self._reader is not None:
            return
        assert self.base_dir is not None
        rank_dir = os.path.join(self.base_dir, f"{rank:05d}")
        await asyncio.to_thread(make_dirs_durable, rank_dir)
        self.db_path = os.path.join(rank_dir, DB_FILENAME)
        try:
            writer, reader, self._before = await asyncio.to_thread(_open, self.db_path)
        except sqlite3.OperationalError as exc:
            refused = await asyncio.to_thread(_unwritable, self.db_path)
            if refused is None:
                raise
            # SQLite says only "unable to open database file" or "attempt to write a readonly database":
            # the permission error it is, naming what to fix, for the caller to answer as one
            raise PermissionError(errno.EACCES, f"{os.strerror(errno.EACCES)} (SQLite: {exc})", refused) from exc
        self._writer, self._reader = writer, reader
        self._lookup = reader.cursor()  # reused by every lookup: no cursor object per query
        self._writer_task = asyncio.create_task(self._writer_loop(), name=f"request-cache-writer-{rank}")

    async def close(self, delete_file: bool = False) -> None:
        """Flush, stop the writer and close the file; idempotent. A caller cancelled meanwhile has it done all
        the same (the rank it belongs to is let go at once: nothing of it may stay open)."""
        if self._reader is None and self._writer is None:
            return
        await run_to_end(self._close(delete_file))

    async def _close(self, delete_file: bool) -> None:
        try:
            await self.flush()
        finally:
            if self._writer_task is not None:
                # Under the lock the writer is not mid-commit, so cancelling it drops no batch.
                async with self._write_lock:
                    await cancel_and_wait(self._writer_task)
                self._writer_task = None
            for conn in (self._reader, self._writer):
                if conn is not None:
                    with contextlib.suppress(sqlite3.Error):
                        conn.close()
            self._reader = self._writer = None
            if delete_file and self.db_path:
                for suffix in SQLITE_SUFFIXES:
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(self.db_path + suffix)
            self.db_path = None
            self._complete.clear()
            self._pending.clear()

    def prepare_payload(self, payload: dict[str, Any]) -> str:
        """The payload's cache hash (datatrove's `prepare_payload`)."""
        return payload_hash(payload)

    async def get_cached_response(
        self, doc_id: str, rollout_idx: int, *, payload_hash: str
    ) -> tuple[dict[str, Any] | None, str | None]:
        """`(result, None)`, `(None, error_message)`, or `(None, None)` on a miss."""
        if self._reader is None or doc_id in self._complete or not self._replays(doc_id):
            return None, None
        key = (doc_id, rollout_idx, payload_hash)
        row = self._pending.get(key) or self._committing.get(key)
        if row is not None:
            result_blob, error_message = row.result, row.error_message
        else:
            found = self._reader.execute(_SELECT, key).fetchone()
            if found is None:
                return None, None
            result_blob, error_message = found
        return (orjson.loads(result_blob) if result_blob is not None else None), error_message

    async def store_result(
        self, chunk_index: int, doc_id: str, rollout_idx: int, result: dict[str, Any], *, payload_hash: str
    ) -> None:
        """Queue `result` for the next commit; a lookup finds it at once."""
        if self._reader is None:
            return
        blob = orjson.dumps(result)
        self._queue(_Row(chunk_index, doc_id, rollout_idx, payload_hash, blob, None, None, None, 0))

    async def store_error(
        self, chunk_index: int, doc_id: str, rollout_idx: int, error_message: str, *, payload_hash: str
    ) -> None:
        """Queue an error answer for the next commit; it is replayed as `(None, error_message)`."""
        if self._reader is None:
            return
        if isinstance(error_message, str):
            # An upstream's message may carry undecodable bytes as lone surrogates: keep the text, not the failure.
            error_message = error_message.encode("utf-8", "replace").decode("utf-8")
        self._queue(_Row(chunk_index, doc_id, rollout_idx, payload_hash, None, error_message, None, None, 0))

    def get_response(
        self,
        doc_id: str,
        rollout_idx: int,
        payload_hash: str,
        *,
        datatrove_results: bool = True,
        endpoint: str | None = None,
    ) -> StoredResponse | None:
        """The proxy's lookup: the stored HTTP answer for the key, or None. Synchronous: one point query.

        `endpoint`, the request's route: an answer stored for another is None (the same body sent to
        `/v1/completions` and to `/v1/chat/completions` gets two different answers, or errors).

        Without `datatrove_results` (a request keyed by its body's hash, not datatrove's), a result in
        datatrove's form is None too: stored for a request keyed by datatrove's hash that equals this body's
        (a rollout payload naming the model, no default params), it is no answer a plain OpenAI client reads."""
        if self._reader is None or doc_id in self._complete or not self._replays(doc_id):
            return None
        key = (doc_id, rollout_idx, payload_hash)
        row = (self._pending.get(key) if self._pending else None) or (
            self._committing.get(key) if self._committing else None
        )
        if row is not None:
            result, status, content_type, streamed = row.result, row.status_code, row.content_type, row.streamed
            stored_for = row.endpoint
        else:
            # fetchall, not fetchone: stepping to the end resets the statement, so no
            # read transaction stays open between lookups (it would pin the WAL).
            found = self._lookup.execute(_SELECT_RESPONSE, key).fetchall()
            if not found:
                return None
            result, _, status, content_type, streamed, stored_for = found[0]
        # Another route's answer is none of this one's. One stored without a route is datatrove's (no status:
        # either route's), else an inferproxy's from before routes were kept: the route it names (an error: none).
        if (
            endpoint is not None
            and stored_for != endpoint
            and (stored_for is not None or (status is not None and route_of(result) != endpoint))
        ):
            return None
        if result is None:
            return None  # an error datatrove stored as text: not an HTTP answer to replay
        if status is None:  # a result datatrove stored: its JSON, as a 200
            status, content_type = 200, "application/json"
        answer = StoredResponse(status, result, content_type or "application/json", bool(streamed))
        if not datatrove_results and answer.is_datatrove_result():
            return None
        return answer

    def store_response(
        self,
        chunk_index: int,
        doc_id: str,
        rollout_idx: int,
        payload_hash: str,
        response: StoredResponse,
        *,
        error_message: str | None = None,
        endpoint: str | None = None,
    ) -> None:
        """Queue an HTTP answer for the next commit (an error answer also fills `error_message`: its body's
        text, unless given), for `endpoint`, the route it answers (None: any, as datatrove stores them)."""
        if self._reader is None:
            return
        error = error_message
        if error is None and response.status >= 400:
            error = response.body.decode("utf-8", "replace")
        self._queue(
            _Row(
                chunk_index,
                doc_id,
                rollout_idx,
                payload_hash,
                response.body,
                error,
                response.status,
                response.content_type,
                int(response.streamed),
                endpoint,
            )
        )

    async def flush(self) -> None:
        """Return once everything stored before the call is committed and durable.

        Raises `CacheWriteError` if the disk refuses it (the rows stay queued).
        """
        if self._writer is None:
            return
        await self._commit()

    async def drop_chunk(self, chunk_index: int) -> None:
        """Delete every entry of a chunk, including ones stored but not yet committed. `CacheWriteError` if
        the disk refuses it now: the drop stays queued, as stored rows do, and the writer retries it."""
        if self._writer is None:
            return
        self._drops.add(chunk_index)
        await self._commit()

    async def mark_document_complete(self, doc_id: str) -> None:
        """The document is finished: later lookups for it are misses without a query, until an answer
        is stored for it again (with `replay_same_run`)."""
        if self._reader is None:
            return
        self._complete.add(doc_id)
        if len(self._complete) > self._sweep_at:
            self._has_pending.set()  # the writer's next commit forgets those without answers

    def _forget(self, doc_ids: list[str]) -> None:
        """Forget completed ids found without answers. One answered since was taken out when it was
        stored (with `replay_same_run`; without, an answer of this run is not served anyway).
        A set never shrinks its table: it is copied once it has lost half its ids."""
        if not doc_ids:
            return
        before = len(self._complete)
        self._complete.difference_update(doc_ids)
        if len(self._complete) <= before // 2:
            self._complete = set(self._complete)

    def _replays(self, doc_id: str) -> bool:
        """Whether answers for the document may be served: always with `replay_same_run`, else only
        while it has one that was stored before `initialize` (one more index probe)."""
        return self.replay_same_run or bool(self._lookup.execute(_HAS_ROWS_BEFORE, (doc_id, self._before)).fetchall())

    def _queue(self, row: _Row) -> None:
        _check_row(row)
        self.stores += 1
        key = (row.doc_id, row.rollout_idx, row.payload_hash)
        self._pending.pop(key, None)  # re-insert so the dict keeps store order
        self._pending[key] = row
        if self.replay_same_run:
            self._complete.discard(row.doc_id)  # answered again: served again
        self._has_pending.set()

    async def _commit(self) -> None:
        async with self._write_lock:
            writer = self._writer
            # Completed ids, once they are more than twice those that had answers at the last
            # sweep, are looked up here: amortised, a mark costs a set insertion.
            sweep = list(self._complete) if len(self._complete) > self._sweep_at else []
            drops = sorted(self._drops)
            if writer is None or (not self._pending and not drops and not sweep):
                return  # closed meanwhile, or nothing to do
            batch, self._pending = self._pending, {}
            self._committing = batch
            work = asyncio.ensure_future(asyncio.to_thread(_write_batch, writer, list(batch.values()), drops, sweep))
            cancelled = False
            # The thread cannot be cancelled: hold the lock until it is done, so
            # that no second commit ever runs on the same connection.
            while not work.done():
                try:
                    await asyncio.shield(work)
                except asyncio.CancelledError:
                    cancelled = True
                except Exception:
                    break
            self._committing = {}
            error = work.exception()
            if error is None:
                unanswered, largest = work.result()
                self._drops.difference_update(drops)
                self._forget(unanswered)
                self._before = min(self._before, largest)
                if sweep:
                    self._sweep_at = max(SWEEP_COMPLETE_FROM, 2 * len(self._complete))
            else:
                # Keep the rows for the next attempt; anything stored since is newer and wins.
                self._pending = batch | self._pending
                if self._pending or self._drops:
                    self._has_pending.set()
            if cancelled:
                raise asyncio.CancelledError
            if error is not None:
                raise CacheWriteError(
                    f"could not commit {len(batch)} cache entries to {self.db_path}: {error}; they stay queued "
                    f"and are retried (is the disk full or read-only?)"
                ) from error

    async def _writer_loop(self) -> None:
        backoff = self.flush_interval
        full = False  # its commits refused by a full disk: said once, then once more when they go through
        while True:
            await self._has_pending.wait()
            await asyncio.sleep(backoff)
            self._has_pending.clear()
            try:
                await self._commit()
            except Exception as exc:  # the writer must outlive any one failure
                if not is_disk_full(exc.__cause__):
                    logger.exception("request cache commit failed; retrying in %.2f s", backoff)
                elif not full:
                    full = True
                    logger.warning(
                        "the cache %s cannot commit its answers: the disk is full (%s); they stay queued and are "
                        "tried again every few seconds: free space under %s",
                        self.db_path,
                        refusal_reason(exc.__cause__),
                        self.base_dir,
                    )
                backoff = min(backoff * 2, 5.0)
            else:
                if full:
                    full = False
                    logger.info("the cache %s commits its answers again", self.db_path)
                backoff = self.flush_interval


_INT64 = range(-(2**63), 2**63)


def _check_row(row: _Row) -> None:
    """Refuse at store time what SQLite would refuse at commit time, where it would fail a whole batch."""
    # Spelled out field by field: this runs for every stored answer on the event loop.
    for name, value in (("chunk_index", row.chunk_index), ("rollout_idx", row.rollout_idx)):
        if type(value) is int and value in _INT64:
            continue  # the common case, decided by the cheapest test
        if not isinstance(value, int) or isinstance(value, bool) or value not in _INT64:
            raise TypeError(f"{name} must be a 64-bit integer, got {value!r}")
    for name, text in (("doc_id", row.doc_id), ("payload_hash", row.payload_hash)):
        if not isinstance(text, str):
            raise TypeError(f"{name} must be a str, got {type(text).__name__} {text!r}")
        if not text.isascii():
            text.encode("utf-8")  # a lone surrogate raises UnicodeEncodeError here, naming the character
    if row.error_message is not None and not isinstance(row.error_message, str):
        raise TypeError(f"error_message must be a str, got {type(row.error_message).__name__}")


#: How long opening a cache file waits for other processes opening or writing it.
OPEN_TIMEOUT_S = 30.0


def _set_wal(writer: sqlite3.Connection) -> None:
    """Put the file in WAL mode, waiting for others that hold it meanwhile.

    Switching to WAL takes the file's exclusive lock, and SQLite answers SQLITE_BUSY at once, without its busy
    handler, when another connection holds a lock it would deadlock on: so proxies started together on one
    file (one checkpoints dir shared by a node's proxies, and the batches' answers cache in it) failed to
    start. The switch is tried again until OPEN_TIMEOUT_S."""
    deadline = time.monotonic() + OPEN_TIMEOUT_S
    pause = 0.005
    while True:
        try:
            writer.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if exc.sqlite_errorcode & 0xFF != sqlite3.SQLITE_BUSY or time.monotonic() + pause > deadline:
                raise
        time.sleep(pause)
        pause = min(pause * 2, 0.2)


def _open(db_path: str) -> tuple[sqlite3.Connection, sqlite3.Connection, int]:
    # SQLite follows links, and writes its WAL and index beside the file: none may be a link.
    for suffix in SQLITE_SUFFIXES:
        check_safe(db_path + suffix)
    # isolation_level=None: transactions are explicit, one BEGIN/COMMIT per batch.
    writer = sqlite3.connect(db_path, isolation_level=None, check_same_thread=False, timeout=OPEN_TIMEOUT_S)
    try:
        _set_wal(writer)
        # FULL: a commit is on disk when it returns; with one commit per window it costs little.
        writer.execute("PRAGMA synchronous=FULL")
        apply_migrations(writer)
        reader = sqlite3.connect(db_path, isolation_level=None, check_same_thread=False, timeout=OPEN_TIMEOUT_S)
        # Lookups read pages through a memory map and a larger page cache: a point
        # query over a big cache then costs no read() system calls.
        reader.execute(f"PRAGMA mmap_size={READER_MMAP_BYTES}")
        reader.execute(f"PRAGMA cache_size=-{READER_CACHE_KIB}")
        largest = reader.execute("SELECT max(rowid) FROM request_cache").fetchone()[0] or 0
    except BaseException:
        writer.close()
        raise
    return writer, reader, largest


def _unwritable(db_path: str) -> str | None:
    """The first of the cache file's folder, the file and those SQLite keeps beside it that this process may
    not write (another user's, or made read-only), or None."""
    folder = os.path.dirname(db_path)
    if not os.access(folder, os.W_OK | os.X_OK):
        return folder
    for suffix in SQLITE_SUFFIXES:
        if os.path.exists(db_path + suffix) and not os.access(db_path + suffix, os.W_OK):
            return db_path + suffix
    return None


def count_entries(db_path: str) -> int:
    """The entries of a cache file, read without writing a byte beside it (for `inferproxy inspect`).

    SQLite's read-only mode still writes: it creates the WAL index (`-shm`)
    and an empty `-wal` where they are missing, and updates the index. So a
    file with both (a live proxy's, or a killed one's) is read with the index
    read-only (SQLite reads the WAL itself where the index is stale); a file
    without a WAL to read, as the main file alone; and a WAL without its
    index (a dir copied without it), from a private copy. Call it from another
    process than the file's writer: within one, SQLite shares a file's index
    among connections, and this one would update it.
    """
    wal, index = db_path + "-wal", db_path + "-shm"
    wal_size = os.path.getsize(wal) if os.path.exists(wal) else None
    if wal_size is not None and os.path.exists(index):
        return count_rows(db_path, "mode=ro&readonly_shm=1")
    if not wal_size:
        return count_rows(db_path, "mode=ro&immutable=1")
    with tempfile.TemporaryDirectory(prefix="inferproxy-") as private:
        copy = os.path.join(private, DB_FILENAME)
        shutil.copyfile(db_path, copy)
        shutil.copyfile(wal, copy + "-wal")
        return count_rows(copy, "mode=ro")


def count_rows(db_path: str, options: str = "mode=ro") -> int:
    """The entries of a cache file, on a connection of its own. With the default options, for the process
    that writes the file (the proxy's `/stats`): SQLite may update the WAL index, as the writer does."""
    conn = sqlite3.connect(f"{Path(db_path).absolute().as_uri()}?{options}", uri=True)
    try:
        if conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'request_cache'").fetchone():
            return int(conn.execute("SELECT COUNT(*) FROM request_cache").fetchone()[0])
        return 0  # a file created but not yet migrated
    finally:
        conn.close()


#: Rows per INSERT statement, largest first: a batch is written in as few statements as these make.
_STATEMENT_ROWS = (256, 32, 4, 1)
_INSERTS = {n: _INSERT + ", (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)" * (n - 1) for n in _STATEMENT_ROWS}


def _insert_rows(conn: sqlite3.Connection, rows: list[_Row]) -> None:
    """Insert `rows` with multi-row statements rather than `executemany`.

    The sqlite3 module lets go of the GIL around every statement it steps: one statement per
    row made the event loop thread and this one trade the GIL once per row (futex calls and
    wake-ups that cost the loop several µs per stored answer, bench/README.md). A batch's
    keys are distinct (the pending dict), so a multi-row INSERT OR REPLACE means the same.
    """
    start = 0
    for size in _STATEMENT_ROWS:
        statement = _INSERTS[size]
        while len(rows) - start >= size:
            values = [value for row in rows[start : start + size] for value in row]
            conn.execute(statement, values)
            start += size


def _write_batch(
    conn: sqlite3.Connection, rows: list[_Row], drop_chunks: Sequence[int] = (), sweep: Sequence[str] = ()
) -> tuple[list[str], int]:
    """Insert `rows`, then delete the chunks `drop_chunks`, in one transaction. Returns the documents of
    `sweep` without any answer then, and the largest rowid after the drop (2**63 without one)."""
    largest = 2**63
    conn.execute("BEGIN")
    try:
        if rows:
            _insert_rows(conn, rows)
        for chunk_index in drop_chunks:
            conn.execute("DELETE FROM request_cache WHERE chunk_index = ?", (chunk_index,))
        if drop_chunks:
            largest = conn.execute("SELECT max(rowid) FROM request_cache").fetchone()[0] or 0
        unanswered = _without_answers(conn, sweep)
        conn.execute("COMMIT")
    except BaseException:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")
        raise
    return unanswered, largest


def _without_answers(conn: sqlite3.Connection, doc_ids: Sequence[str]) -> list[str]:
    """The documents of `doc_ids` that have no answer, a few hundred index probes a query."""
    answered: set[str] = set()
    for start in range(0, len(doc_ids), _IDS_PER_QUERY):
        part = doc_ids[start : start + _IDS_PER_QUERY]
        marks = ", ".join("?" * len(part))
        answered.update(
            doc_id
            for (doc_id,) in conn.execute(f"SELECT DISTINCT doc_id FROM request_cache WHERE doc_id IN ({marks})", part)
        )
    return [doc_id for doc_id in doc_ids if doc_id not in answered]
