"""What the running proxy holds: settings, the upstream pool, the per-rank caches, the flights
in progress, and counters. Built and torn down by the lifespan in `app.main`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from app.cache import RequestCache, StoredResponse
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

    async def flush(self) -> None:
        await asyncio.gather(*(cache.flush() for cache in self._caches.values()))

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


@dataclass
class Services:
    settings: Settings
    pool: UpstreamPool
    caches: CacheRegistry
    flights: dict[CacheKey, asyncio.Future[StoredResponse | None]] = field(default_factory=dict)
    stats: Counter[str] = field(default_factory=Counter)

    async def close(self) -> None:
        try:
            await self.caches.close()
        finally:
            with contextlib.suppress(Exception):
                await self.pool.close()
