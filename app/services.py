"""What the running proxy holds: settings, the upstream pool, the per-rank caches, the flights
in progress, and counters. Built and torn down by the lifespan in `app.main`."""

from __future__ import annotations

import asyncio
import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from app.cache import RequestCache, StoredResponse
from app.checkpointing import CheckpointManager, read_last_chunk
from app.publish import ChunkPublisher
from app.settings import Settings
from app.upstream import UpstreamPool

logger = logging.getLogger(__name__)

#: (rank, doc_id, rollout_idx, payload_hash): the cache key of a request.
CacheKey = tuple[int, str, int, str]


class CacheRegistry:
    """One `RequestCache` per rank, opened on first use: `<checkpoints_dir>/<rank:05d>/replay.sqlite3`."""

    def __init__(self, root: Path, *, flush_interval_ms: float) -> None:
        self.root = root
        self.flush_interval_ms = flush_interval_ms
        self._caches: dict[int, RequestCache] = {}
        self._opening: dict[int, asyncio.Lock] = {}

    async def get(self, rank: int) -> RequestCache:
        cache = self._caches.get(rank)
        if cache is not None:
            return cache
        lock = self._opening.setdefault(rank, asyncio.Lock())
        async with lock:
            cache = self._caches.get(rank)
            if cache is None:
                # replay_same_run: the proxy answers a repeated request with the first answer at once.
                cache = RequestCache(str(self.root), flush_interval_ms=self.flush_interval_ms, replay_same_run=True)
                await cache.initialize(rank)
                self._caches[rank] = cache
        return cache

    def opened_cache(self, rank: int) -> RequestCache | None:
        """The rank's cache if it is open already: the hot path's lookup, without an await."""
        return self._caches.get(rank)

    def opened(self) -> dict[int, RequestCache]:
        return dict(self._caches)

    async def discard(self, rank: int) -> None:
        """Close a rank's cache whose file was removed (its job finished)."""
        cache = self._caches.pop(rank, None)
        if cache is not None:
            await cache.close()

    async def close(self) -> None:
        """Flush and close every cache, even if one of them fails."""
        caches, self._caches = self._caches, {}
        errors = []
        for rank, cache in caches.items():
            try:
                await cache.close()
            except Exception as exc:  # keep closing the others
                logger.exception("closing the request cache of rank %d failed", rank)
                errors.append(exc)
        if errors:
            raise errors[0]


class CheckpointRegistry:
    """One `CheckpointManager` per rank, restored from the checkpoints dir before it serves anything.

    Completed chunks are published through one `ChunkPublisher`. A rank
    whose last chunk is completed is closed: its working files are gone, and
    its next use starts from what the disk says (`last_chunk/<rank>.txt`).
    """

    def __init__(self, settings: Settings, caches: CacheRegistry) -> None:
        self.settings = settings
        self.caches = caches
        self.root = str(settings.checkpoints_dir)
        self.publisher = ChunkPublisher(settings.output, self.root, settings.output_filename)
        self._managers: dict[int, CheckpointManager] = {}
        self._opening: dict[int, asyncio.Lock] = {}

    async def get(self, rank: int) -> CheckpointManager:
        manager = self._managers.get(rank)
        if manager is not None:
            return manager
        lock = self._opening.setdefault(rank, asyncio.Lock())
        async with lock:
            manager = self._managers.get(rank)
            if manager is None:
                cache = await self.caches.get(rank)
                manager = CheckpointManager(
                    self.root, self.settings.records_per_chunk, request_cache=cache, fsync=self.settings.fsync
                )
                await manager.parse_existing_checkpoints(rank, self.publisher)
                self._managers[rank] = manager
        return manager

    def is_open(self, rank: int) -> bool:
        return rank in self._managers

    def has_working_files(self, rank: int) -> bool:
        return (Path(self.root) / f"{rank:05d}").is_dir()

    def last_chunk_on_disk(self, rank: int) -> int:
        """What `last_chunk/<rank>.txt` says, as the checkpoint manager reads it (-1 if absent)."""
        return read_last_chunk(os.path.join(self.root, "last_chunk", f"{rank:05d}.txt"))

    def known_ranks(self) -> list[int]:
        """Ranks with anything in the checkpoints dir: a rank folder or a last_chunk file."""
        ranks: set[int] = set()
        root = Path(self.root)
        if root.is_dir():
            ranks.update(int(p.name) for p in root.iterdir() if p.is_dir() and p.name.isdigit() and len(p.name) == 5)
        last = root / "last_chunk"
        if last.is_dir():
            ranks.update(int(p.stem) for p in last.glob("*.txt") if p.stem.isdigit())
        return sorted(ranks)

    async def recover(self) -> list[int]:
        """Restore every rank found on disk, as the proxy that stopped left it."""
        ranks = [rank for rank in self.known_ranks() if (Path(self.root) / f"{rank:05d}").is_dir()]
        for rank in ranks:
            await self.get(rank)
        return ranks

    async def complete(self, rank: int, chunk_index: int) -> CheckpointManager:
        manager = await self.get(rank)
        await manager.cleanup_last_chunk(rank, chunk_index)
        if manager.last_chunk_index == chunk_index:
            # The rank dir is gone: close its cache and start afresh on the next use.
            await manager.close()
            self._managers.pop(rank, None)
            await self.caches.discard(rank)
        return manager

    async def close(self) -> None:
        managers, self._managers = self._managers, {}
        for manager in managers.values():
            await manager.close()


@dataclass
class Services:
    settings: Settings
    pool: UpstreamPool
    caches: CacheRegistry
    checkpoints: CheckpointRegistry
    flights: dict[CacheKey, asyncio.Future[StoredResponse | None]] = field(default_factory=dict)
    stats: Counter[str] = field(default_factory=Counter)
