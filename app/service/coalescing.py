"""Request coalescing: identical cacheable requests in flight share one upstream generation.

The first request of a key that misses leads a `Flight`; an identical one arriving meanwhile joins it
and is answered with the leader's answer (`X-Cache: COALESCED`) instead of generating it again: the
upstream's whole answer, whatever its status, or the proxy's own error where the upstream gave none
(timed out, unreachable after every retry, too busy), which sending again in turn would only repeat,
each follower waiting as long again. A leader that gets no whole answer otherwise (a stream cut, its
client gone mid-stream) lands its flight empty: its followers then look again, and one of them leads.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import NamedTuple

from app.service.errors import ProxyError
from app.store.cache import StoredResponse

#: (rank, doc_id, rollout_idx, payload_hash, route): the cache key of a request, and where it goes.
CacheKey = tuple[int, str, int, str, str]


class Landing(NamedTuple):
    """What a flight's leader got, for its followers: the upstream's whole answer with the headers passed on
    beside it (`Retry-After`), or the proxy's own error the leader was answered; `kept`: whether the
    answer was stored (a generation its followers saved, as a later hit would)."""

    answer: StoredResponse | ProxyError
    headers: tuple[tuple[bytes, bytes], ...] = ()
    kept: bool = False


class Flight:
    """One generation under way. Its one state is its future: flying, then landed with what the leader got
    or with None (no whole answer)."""

    __slots__ = ("_landed",)

    def __init__(self) -> None:
        self._landed: asyncio.Future[Landing | None] = asyncio.get_running_loop().create_future()

    async def answer(self) -> Landing | None:
        """What the leader got, once it lands; a follower whose client leaves meanwhile leaves the flight alone."""
        return await asyncio.shield(self._landed)

    def land(self, landing: Landing | None) -> None:
        if not self._landed.done():
            self._landed.set_result(landing)


class Flights:
    """The flights under way, by cache key."""

    def __init__(self) -> None:
        self._flying: dict[CacheKey, Flight] = {}

    def __len__(self) -> int:
        return len(self._flying)

    def get(self, key: CacheKey) -> Flight | None:
        """The flight of `key` under way, to join, or None."""
        return self._flying.get(key)

    @contextlib.contextmanager
    def lead(self, key: CacheKey, *, joinable: bool) -> Iterator[Flight]:
        """Lead the generation of `key`: a flight that others join if `joinable` (from now: nothing may be
        awaited between finding no flight and leading one, or the key is generated twice).

        The leader lands the flight with its answer; one that leaves without (failed, cancelled) lands it
        empty. Either way the flight is gone by then: a request after it looks in the cache, or leads.
        """
        flight = Flight()
        if joinable:
            self._flying[key] = flight
        try:
            yield flight
        finally:
            if self._flying.get(key) is flight:
                del self._flying[key]
            flight.land(None)
