"""What the running proxy holds: settings, the upstream pool, the per-rank caches, the flights
in progress, and counters. Built and torn down by the lifespan in `app.service.app`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import logging
import sqlite3
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Generic, TypeVar

from app.checkpoints.manager import CheckpointManager
from app.checkpoints.output import redact_url, scrub
from app.checkpoints.publish import ChunkPublisher, in_daemon_thread, shortened
from app.checkpoints.resume import check_records_per_chunk, docs_to_skip, read_last_chunk
from app.ops.metrics import Metrics
from app.service.batches.engine import BatchEngine
from app.service.coalescing import Flights
from app.service.errors import (
    InsufficientStorage,
    OutputLost,
    OutputUnavailable,
    RankOwned,
    ServiceUnavailable,
    TooManyRanks,
)
from app.service.limits import files_short_for_a_rank, open_files_limit, out_of_files
from app.service.settings import Settings
from app.service.upstream import UpstreamPool
from app.store.cache import CacheWriteError, RequestCache
from app.store.durable import atomic_write_bytes, is_disk_full, refusal_reason
from app.store.files import FileStore
from app.store.layout import CheckpointsLayout
from app.store.ownership import RankOwnedError, RankOwnership

logger = logging.getLogger(__name__)
T = TypeVar("T")


class RankLocks:
    """A lock per rank, kept only while a task holds or awaits it: a proxy serving thousands of ranks over
    its life (a job of as many tasks) keeps none for those it is done with."""

    def __init__(self) -> None:
        self._locks: dict[int, tuple[asyncio.Lock, int]] = {}  # rank -> (lock, tasks holding or awaiting it)

    def __len__(self) -> int:
        return len(self._locks)

    def __contains__(self, rank: int) -> bool:
        """Whether a task holds or awaits the rank's lock."""
        return rank in self._locks

    @contextlib.asynccontextmanager
    async def hold(self, rank: int) -> AsyncIterator[None]:
        lock, users = self._locks.get(rank) or (asyncio.Lock(), 0)
        self._locks[rank] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            users = self._locks[rank][1] - 1
            if users:
                self._locks[rank] = (lock, users)
            else:
                del self._locks[rank]


#: A checkpoints dir remounted read-only, or its permissions taken away, under a running proxy.
UNWRITABLE_ERRNOS = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})


def checkpoints_unwritable(refused: OSError, checkpoints_dir: str | Path, what: str = "") -> ServiceUnavailable:
    """The 503 for a write the checkpoints dir refused (`UNWRITABLE_ERRNOS`), `what` saying what could not
    be done first; one WARNING line, no traceback: every request of the rank would log one."""
    where = refused.filename or checkpoints_dir
    logger.warning("%sthe checkpoints dir cannot be written (%s)", what, refused)
    return ServiceUnavailable(
        f"{what}the checkpoints dir cannot be written ({refused.strerror}: {where}), and nothing of this request "
        f"was written; make {checkpoints_dir} writable for the proxy's user (remount it read-write, or fix its "
        f"permissions), then send it again",
        headers=[(b"retry-after", b"10")],
    )


@contextlib.contextmanager
def opening_files(rank: int, checkpoints_dir: str | Path) -> Iterator[None]:
    """Around opening a rank's files (its claim, its cache, its checkpoints restored): failing for want of
    file descriptors is 503, worth retrying, and for want of disk space 507, naming the disk; not 500."""
    try:
        yield
    except RankOwnedError as exc:
        raise RankOwned(str(exc)) from None
    except (OSError, sqlite3.OperationalError, CacheWriteError) as exc:
        refused = exc.__cause__ if isinstance(exc, CacheWriteError) else exc
        if is_disk_full(refused):
            logger.warning("rank %d could not be opened: the checkpoints disk is full (%s)", rank, refused)
            raise InsufficientStorage(
                f"rank {rank} cannot be opened: the checkpoints disk is full ({refusal_reason(refused)}), and "
                f"nothing of this request was written; free space under {checkpoints_dir}, then send it again"
            ) from exc
        if isinstance(refused, OSError) and refused.errno in UNWRITABLE_ERRNOS:
            raise checkpoints_unwritable(refused, checkpoints_dir, f"rank {rank} cannot be opened: ") from exc
        if isinstance(exc, CacheWriteError) or not out_of_files(exc):
            raise
        logger.warning("rank %d could not be opened: out of file descriptors (%s)", rank, exc)
        raise ServiceUnavailable(
            f"rank {rank} cannot be opened now: the proxy is out of file descriptors ({exc}). Retry later; "
            f"to make room, raise the open files limit (ulimit -n, now {open_files_limit()}) or lower "
            f"max_open_ranks or max_connections",
            headers=[(b"retry-after", b"1")],
        ) from exc


class RankActivity:
    """When each rank was last used, and how many requests are using it now.

    A rank's owner gives it up once it has been idle for `idle_s`: a job
    moved to another node's proxy (its own node preempted, the proxy's
    spared) can then take the rank over there instead of getting 409 for
    as long as this proxy lives.
    """

    def __init__(self) -> None:
        self.last_used: dict[int, float] = {}
        self.in_flight: Counter[int] = Counter()

    def touch(self, rank: int) -> None:
        self.last_used[rank] = time.monotonic()

    @contextlib.contextmanager
    def using(self, rank: int) -> Iterator[None]:
        self.in_flight[rank] += 1
        try:
            yield
        finally:
            self.in_flight[rank] -= 1
            if not self.in_flight[rank]:
                del self.in_flight[rank]
            self.last_used[rank] = time.monotonic()

    def idle(self, rank: int, idle_s: float) -> bool:
        return not self.in_flight[rank] and time.monotonic() - self.last_used.get(rank, 0.0) >= idle_s

    def forget_all_but(self, ranks: Collection[int]) -> None:
        """Forget every rank not in `ranks` and not in use: those the proxy has given up (finished, or released)."""
        for rank in [r for r in self.last_used if r not in ranks and not self.in_flight[r]]:
            del self.last_used[rank]


class RankRegistry(ABC, Generic[T]):
    """What this proxy holds open for each rank it owns (a `T`: a cache, a checkpoint manager), opened on
    first use.

    A rank's `T` is opened once, under the rank's lock, after `admit` claimed the rank (`RankOwned` if
    another live proxy has it) and made room for it. A `T` that fails to open gives the rank's claim up
    again if this open made it and nothing else of the rank is open. Failing for want of file
    descriptors or disk space is answered as `opening_files` says. Subclasses say how a `T` is opened
    and closed.
    """

    #: what a `T` is, for log lines
    what: ClassVar[str]

    def __init__(self, root: str | Path, ownership: RankOwnership, admit: Callable[[int], Awaitable[None]]) -> None:
        self.root = str(root)
        self.ownership = ownership
        self._admit = admit
        self._opened: dict[int, T] = {}
        self._opening = RankLocks()

    @abstractmethod
    async def _open(self, rank: int) -> T:
        """Open the rank's `T`; the rank is admitted (claimed) already."""

    @abstractmethod
    async def _close(self, rank: int, opened: T) -> None: ...

    def _holds_otherwise(self, rank: int) -> bool:
        """Whether something else of the rank is open, keeping its claim when its `T` failed to open."""
        return False

    async def get(self, rank: int) -> T:
        opened = self._opened.get(rank)
        if opened is not None:
            return opened
        async with self._opening.hold(rank):
            opened = self._opened.get(rank)
            if opened is not None:
                return opened
            claimed = not self.ownership.owns(rank)
            with opening_files(rank, self.root):
                try:
                    await self._admit(rank)
                    opened = await self._open(rank)
                except Exception:
                    if claimed and not self._holds_otherwise(rank):
                        self.ownership.release(rank)  # nothing of the rank is open: its lock goes too
                    raise
            self._opened[rank] = opened
            return opened

    def opened(self, rank: int) -> T | None:
        """The rank's `T` if it is open already: the hot path's lookup, without an await."""
        return self._opened.get(rank)

    def all_opened(self) -> dict[int, T]:
        return dict(self._opened)

    def opening(self, rank: int) -> contextlib.AbstractAsyncContextManager[None]:
        """The lock under which the rank's `T` is opened (and closed when the rank is released)."""
        return self._opening.hold(rank)

    def is_opening(self, rank: int) -> bool:
        """Whether a task holds or awaits the rank's opening lock (opening its `T`, say)."""
        return rank in self._opening

    def take(self, rank: int) -> T | None:
        """Forget the rank's `T` without closing it: the caller closes it."""
        return self._opened.pop(rank, None)

    async def discard(self, rank: int) -> None:
        """Close the rank's `T`, if it is open."""
        opened = self._opened.pop(rank, None)
        if opened is not None:
            await self._close(rank, opened)

    async def close(self) -> None:
        """Close every `T` at once, each even if another fails; raise the first failure."""
        opened, self._opened = self._opened, {}
        results = await asyncio.gather(
            *(self._close(rank, one) for rank, one in opened.items()), return_exceptions=True
        )
        failed: BaseException | None = None
        for rank, result in zip(opened, results, strict=True):
            if isinstance(result, BaseException):
                logger.error("closing %s of rank %d failed: %s", self.what, rank, result, exc_info=result)
                failed = failed or result
        if failed is not None:
            raise failed


class CacheRegistry(RankRegistry[RequestCache]):
    """One `RequestCache` per rank this proxy owns, opened on first use: `<checkpoints_dir>/<rank:05d>/replay.sqlite3`.

    Opening a rank's cache claims the rank first (`RankOwned` if another live
    proxy has it): only one host ever has a rank's SQLite file open.
    """

    what = "the request cache"

    def __init__(
        self, root: Path, ownership: RankOwnership, admit: Callable[[int], Awaitable[None]], *, flush_interval_ms: float
    ) -> None:
        super().__init__(root, ownership, admit)
        self.flush_interval_ms = flush_interval_ms
        #: Whether the rank's checkpoints are open, or being opened (`CheckpointRegistry` says).
        self.checkpoints_hold: Callable[[int], bool] = lambda rank: False

    def _holds_otherwise(self, rank: int) -> bool:
        return self.checkpoints_hold(rank)

    async def _open(self, rank: int) -> RequestCache:
        # replay_same_run: the proxy answers a repeated request with the first answer at once.
        cache = RequestCache(self.root, flush_interval_ms=self.flush_interval_ms, replay_same_run=True)
        await cache.initialize(rank)
        return cache

    async def _close(self, rank: int, opened: RequestCache) -> None:
        await opened.close()


#: Idle ranks closed, at most, to open one rank when file descriptors run short (each frees ~7).
FILES_EVICTIONS = 2


class CheckpointRegistry(RankRegistry[CheckpointManager]):
    """One `CheckpointManager` per rank this proxy owns, restored from disk before it serves anything.

    A rank is claimed and restored on its first request: its checkpoints
    are read back, or, when it has none (its node was lost with its disk),
    its last published chunk is recovered from the output's listing.
    Completed chunks are published through one `ChunkPublisher`. A rank
    whose last chunk is completed is closed and released: its working files
    are gone, and its next use starts from what the disk says.

    At most `max_open_ranks` ranks are open (claimed) at once: each holds
    file descriptors (its SQLite files, chunk files, ownership lock), and a
    process out of them fails every rank. Past the bound the least recently
    used idle rank is closed and released to make room (it reopens on its
    next request); a rank in use is never closed, and when all are,
    the new rank gets `TooManyRanks` (503).

    It holds the ranks' caches too (`caches`): a rank's manager writes
    through its cache, and a rank is admitted, and given up, whole. Either
    opens the rank through `admit`.
    """

    what = "the checkpoints"

    def __init__(self, settings: Settings, ownership: RankOwnership, activity: RankActivity) -> None:
        super().__init__(str(settings.checkpoints_dir), ownership, self.admit)
        self.settings = settings
        self.activity = activity
        self.caches = CacheRegistry(
            settings.checkpoints_dir, ownership, self.admit, flush_interval_ms=settings.flush_interval_ms
        )
        self.caches.checkpoints_hold = lambda rank: rank in self._opened or self.is_opening(rank)
        self.layout = CheckpointsLayout(self.root)
        self.publisher = ChunkPublisher(
            settings.output, self.root, settings.output_filename, holds_rank=self.ownership.owns
        )
        self._admitting = asyncio.Lock()
        #: Ranks whose published chunks were found missing from the output, with those chunks.
        self.lost: dict[int, list[int]] = {}

    async def admit(self, rank: int) -> None:
        """Claim `rank` (`RankOwned` if another proxy has it), closing the least recently used idle
        rank first if `max_open_ranks` are open."""
        if self.ownership.kept(rank):
            raise ServiceUnavailable(
                f"rank {rank} cannot be opened again in this proxy: a publication of it that could not be "
                f"stopped is still running (a stalled output?). Restart this proxy, or send the rank elsewhere",
                headers=[(b"retry-after", b"10")],
            )
        if self.ownership.owns(rank):
            return
        async with self._admitting:  # one rank admitted at a time: two must not both take the last place
            if self.ownership.owns(rank):
                return
            closed_for_files = 0
            while True:
                full = len(self.ownership.owned()) >= self.settings.max_open_ranks
                # Out of file descriptors before max_open_ranks (connections took them): an idle
                # rank's files make room now, rather than once rank_idle_s releases it.
                short = not full and closed_for_files < FILES_EVICTIONS and bool(self.ownership.owned())
                if not full and not (short and files_short_for_a_rank()):
                    break
                victim = self._least_recently_used_idle()
                if victim is None and not full:
                    break  # nothing idle to close: the open is tried, and answered 503 if it fails
                if victim is None:
                    raise TooManyRanks(
                        f"all {self.settings.max_open_ranks} open ranks are in use, so rank {rank} cannot be "
                        f"opened now: retry later, or raise max_open_ranks (each open rank holds ~7 files; "
                        f"check the open files limit, ulimit -n)",
                        headers=[(b"retry-after", b"1")],
                    )
                if await self._release(victim, self._is_idle):
                    why = "max_open_ranks" if full else "the process is short of file descriptors"
                    logger.info("closed rank %d, the least recently used, to open rank %d (%s)", victim, rank, why)
                closed_for_files += 0 if full else 1
            self.ownership.claim(rank)

    def _is_idle(self, rank: int) -> bool:
        manager = self._opened.get(rank)
        busy = manager is not None and manager.busy()
        return not self.activity.in_flight[rank] and not busy and not self.ownership.kept(rank)

    def _least_recently_used_idle(self) -> int | None:
        idle = [rank for rank in self.ownership.owned() if self._is_idle(rank)]
        return min(idle, key=lambda rank: self.activity.last_used.get(rank, 0.0), default=None)

    async def _open(self, rank: int) -> CheckpointManager:
        await self.recover_from_output(rank)
        await self.check_output(rank)
        cache = await self.caches.get(rank)
        manager = CheckpointManager(
            self.root,
            self.settings.records_per_chunk,
            request_cache=cache,
            fsync=self.settings.fsync,
            publish_in_background=True,
            max_waiting_chunks=self.settings.max_waiting_chunks,
            backlog_wait_s=self.settings.backlog_wait_s,
            max_retry_backoff_s=self.settings.publish_retry_max_s,
        )
        await manager.restore(rank, self.publisher)
        return manager

    def _holds_otherwise(self, rank: int) -> bool:
        # or opens it now: that open saw the rank owned and claimed nothing, so it must stay owned
        return self.caches.opened(rank) is not None or self.caches.is_opening(rank)

    async def _close(self, rank: int, opened: CheckpointManager) -> None:
        """Let a publication under way finish within `shutdown_grace_s` (then give it up); a rank with one
        still running keeps its lock until the process exits."""
        try:
            await opened.close(grace_s=self.settings.shutdown_grace_s)
        finally:
            if opened.publishing():
                logger.error(
                    "a publication of rank %d is still running past shutdown_grace_s and could not be given "
                    "up; the rank's lock is held until this process exits",
                    rank,
                )
                self.ownership.keep_until_exit(rank)
            warn_unpublished(rank, opened, "closed")

    def has_working_files(self, rank: int) -> bool:
        return self.layout.rank(rank).has_working_files()

    async def last_chunk(self, rank: int) -> int:
        """The rank's last published chunk as the disk says, without opening it (claims it).

        Under the rank's opening lock, as `get` recovers and opens it: a recovery from the output (a
        listing, seconds on a big bucket) must not write its `last_chunk` after the rank was opened
        meanwhile and completed a chunk past it, taking `last_chunk` back.
        """
        async with self._opening.hold(rank):
            manager = self._opened.get(rank)
            if manager is not None:  # opened while this request waited: it knows best
                return manager.last_chunk_index
            with opening_files(rank, self.root):
                await self.admit(rank)
                await self.recover_from_output(rank)
                return await self.check_output(rank)

    async def recover_from_output(self, rank: int) -> None:
        """A rank without any checkpoint on disk resumes after its last published chunk.

        Its checkpoints were lost with a node's own disk (or never existed):
        the output's listing says which chunks are published, and
        `last_chunk/<rank>.txt` is written so that every later step agrees.
        """
        paths = self.layout.rank(rank)
        if paths.has_checkpoints():
            return
        # In a daemon thread, as every look at the output: one stuck in a stalled mount or endpoint never
        # keeps a stopping proxy from exiting (asyncio's own threads are joined at exit).
        last = await in_daemon_thread(lambda: self.publisher.last_published_chunk(rank), f"list output {rank}")
        if last < 0:
            return
        logger.warning(
            "rank %d has no checkpoints in %s but chunks 0..%d of it are published in %s: resuming after "
            "chunk %d (its checkpoints were lost, e.g. with a node's disk); only documents of unpublished "
            "chunks are generated again",
            rank,
            self.root,
            last,
            redact_url(self.settings.output),
            last,
        )
        # records_per_chunk first: the last_chunk written next makes these checkpoints, and a
        # checkpoints dir without the record would later be taken for datatrove's.
        await asyncio.to_thread(check_records_per_chunk, self.layout, self.settings.records_per_chunk, record=True)
        await asyncio.to_thread(atomic_write_bytes, paths.last_chunk_file, str(last).encode())

    async def check_output(self, rank: int) -> int:
        """The rank's `last_chunk`, once the output is found to hold every chunk up to it (`OutputLost`
        otherwise).

        A chunk recorded as published but missing from the output (a bucket emptied or recreated, files
        deleted) would be skipped by every restarted job for good: it is said loudly instead.
        """
        last = read_last_chunk(self.layout.rank(rank).last_chunk_file)
        try:
            missing = await in_daemon_thread(lambda: self.publisher.missing_chunks(rank, last), f"list output {rank}")
        except Exception as exc:  # OSError, or an object store's own errors
            raise OutputUnavailable(
                f"the output {redact_url(self.settings.output)} cannot be read to check rank {rank}'s published "
                f"chunks: {shortened(scrub(str(exc), self.settings.output))}",
                retry_after_s=5.0,
            ) from exc
        if missing:
            paths = self.layout.rank(rank)
            lost = OutputLost(rank, missing, last, redact_url(self.settings.output), paths.last_chunk_file)
            if self.lost.get(rank) != missing:
                logger.error("%s", lost.message)
            self.lost[rank] = missing
            raise lost
        self.lost.pop(rank, None)
        return last

    async def check_open_output(self, rank: int) -> None:
        """`check_output` for a rank this proxy has open (`GET /resume` of a job restarted meanwhile). A rank
        found to have lost chunks is closed, its lock kept: every request naming it then reopens it, meeting
        the check again, and reads the `last_chunk` an operator rewrote to have them generated again."""
        try:
            await self.check_output(rank)
        except OutputLost:
            async with self._opening.hold(rank):
                manager = self._opened.get(rank)
                if manager is not None and not manager.busy():
                    del self._opened[rank]
                    if not await manager.close(grace_s=self.settings.shutdown_grace_s):
                        self.ownership.keep_until_exit(rank)
            raise

    async def complete(self, rank: int, chunk_index: int) -> CheckpointManager:
        manager = await self.get(rank)
        await manager.cleanup_last_chunk(rank, chunk_index)
        if manager.last_chunk_index == chunk_index:
            # The rank dir is gone: close its cache, start afresh on the next use, let another proxy have it.
            # Under both opening locks, as `_release`: a request opening the rank's cache meanwhile waits, and
            # then claims the rank anew; else it opened it as still owned, and kept it open once let go.
            async with self._opening.hold(rank), self.caches.opening(rank):
                if self._opened.get(rank) is manager:
                    del self._opened[rank]
                cache = self.caches.take(rank)
                try:
                    try:
                        await manager.close()
                    finally:
                        if cache is not None:
                            await cache.close()
                finally:
                    self._let_go(rank, not manager.publishing())
        return manager

    async def release_idle(self, idle_s: float) -> list[int]:
        """Give up every owned rank that no request has used for `idle_s`; return them. A rank whose complete
        chunks wait for an output that fails is released too: its next owner publishes them."""
        released = []
        for rank in self.ownership.owned():
            if self.ownership.kept(rank):
                continue
            if self.activity.idle(rank, idle_s) and await self._release(rank, lambda r: self.activity.idle(r, idle_s)):
                released.append(rank)
        # Finished ranks too: released by their last chunk, then stamped as that request ended.
        self.activity.forget_all_but(set(self.ownership.owned()))
        return released

    async def _release(self, rank: int, still_idle: Callable[[int], bool]) -> bool:
        """Close the rank's checkpoint manager and cache and give up its ownership, if it is still idle
        once its locks are held; True if it was released.

        The rank leaves the registries before anything is awaited, so that a
        request arriving meanwhile reopens it (after the close, under the
        rank's opening lock) instead of using what is being closed.
        """
        manager = self._opened.get(rank)
        if manager is not None and manager.busy():
            return False
        async with self._opening.hold(rank), self.caches.opening(rank):
            if not still_idle(rank) or not self.ownership.owns(rank):
                return False
            manager = self._opened.pop(rank, None)
            cache = self.caches.take(rank)
            try:
                try:
                    if manager is not None:
                        await manager.close(grace_s=self.settings.shutdown_grace_s)
                finally:  # the lock goes: nothing of the rank may stay open, whatever failed
                    if cache is not None:
                        await cache.close()
            finally:
                # Asked of the manager, not of close()'s answer: a close cut short (cancelled, failed) may
                # leave a publication running.
                self._let_go(rank, manager is None or not manager.publishing())
                if manager is not None:
                    warn_unpublished(rank, manager, "released")
        self.activity.last_used.pop(rank, None)
        return True

    def _let_go(self, rank: int, stopped: bool) -> None:
        """Release the rank's lock, unless a publication of it still runs: then it is held until exit."""
        if not stopped:
            logger.error(
                "a publication of rank %d is still running and could not be given up; this proxy keeps the "
                "rank's lock until it exits, so that no other proxy publishes beside it",
                rank,
            )
            self.ownership.keep_until_exit(rank)
        self.ownership.release(rank)


def warn_unpublished(rank: int, manager: CheckpointManager, how: str) -> None:
    """A WARNING line for a rank given up with complete chunks not published (its output failing, or a
    publication given up): nothing is lost, but this proxy no longer shows or retries them."""
    waiting = manager.waiting_chunks()
    if not waiting:
        return
    failure = manager.publication_failure
    why = f"the output fails: {failure.reason}" if failure is not None else "their publication was given up"
    logger.warning(
        "rank %d %s with complete chunks %s not published (%s); they stay in the checkpoints dir, and the "
        "rank's next owner publishes them (this proxy no longer shows or retries them)",
        rank,
        how,
        waiting,
        why,
    )


@dataclass(frozen=True, slots=True)
class PublicationState:
    """A rank's complete chunks waiting for the output, and why, for `/stats`, `/metrics` and the page."""

    waiting: int
    error: str | None  # the last attempt's, while they fail
    failing_since: float | None  # time.time()
    attempts: int
    retry_in_s: float | None
    lost: tuple[int, ...] = ()  # chunks recorded as published but missing from the output


@dataclass
class Services:
    settings: Settings
    pool: UpstreamPool
    caches: CacheRegistry
    checkpoints: CheckpointRegistry
    #: the Batch API's files (`<checkpoints_dir>/files`) and batches (set by the lifespan once started)
    files: FileStore
    batches: BatchEngine | None = None
    activity: RankActivity = field(default_factory=RankActivity)
    flights: Flights = field(default_factory=Flights)
    metrics: Metrics = field(default_factory=Metrics)

    def note_progress(self, rank: int, manager: CheckpointManager) -> None:
        """The rank's progress for `/stats` and `/metrics`: where its checkpoints stood when it was first
        seen (published chunks counted as full), then each chunk published since."""
        counters = self.metrics.rank(rank)
        last = manager.last_chunk_index
        if not counters.known:
            in_open_chunks = sum(count for chunk, count in manager.per_chunk_counts.items() if chunk > last)
            counters.done_documents = docs_to_skip(last, manager.records_per_chunk) + in_open_chunks
            counters.known_at, counters.known_done = time.time(), counters.done_documents
        elif last > counters.last_chunk_index:
            counters.chunks_published += last - counters.last_chunk_index
        counters.known = True
        counters.last_chunk_index = last

    def publications(self) -> dict[int, PublicationState]:
        """Each open rank's publications now (its progress brought up to date too: chunks are published
        in the background, between the rank's requests)."""
        states = {}
        for rank, manager in self.checkpoints.all_opened().items():
            if self.metrics.rank(rank).known:
                self.note_progress(rank, manager)
            failure = manager.publication_failure
            states[rank] = PublicationState(
                waiting=len(manager.waiting_chunks()),
                error=failure.reason if failure is not None else None,
                failing_since=round(failure.since, 3) if failure is not None else None,
                attempts=failure.attempts if failure is not None else 0,
                retry_in_s=round(failure.retry_in_s(), 1) if failure is not None else None,
            )
        for rank, missing in list(self.checkpoints.lost.items()):
            state = states.get(rank) or PublicationState(0, None, None, 0, None)
            states[rank] = dataclasses.replace(state, lost=tuple(missing))
        return states
