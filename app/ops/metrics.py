"""The proxy's counters: plain integers kept by the code that does the work, read only when asked.

`/metrics` (Prometheus), `/stats` (JSON), the page at `/` and `inferproxy status` all show these numbers;
`app.service.routes.ops` renders them on request. Counting a cache hit costs a few dict and attribute updates
and one `rfind` in the answer for its token count, nothing else: no labels resolved, no locks, no
formatting. `Metrics(enabled=False)` (`--no-metrics`) counts nothing, for measuring that cost.

Counts are kept one by one for at most `max_tracked_ranks` ranks: past it, the least recently active
ranks that are not open are forgotten, their counts added to `forgotten`, so that every total stays
whole while a proxy serving thousands of short tasks (a new rank each) holds a bounded amount.

A replayed answer's tokens are its `usage.total_tokens` (prompt + completion: the GPU work saved); a
streamed answer without a usage chunk counts none.
"""

from __future__ import annotations

import copy
import re
import threading
import time
from bisect import bisect_left
from collections import Counter, deque
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field

from app.store.durable import FSYNC_OBSERVERS

#: Upstream answers: from the first byte sent to the answer's head (for a non-streamed generation, all of it).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0)
FSYNC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
#: How often `sample` is called, and how much history `/stats` keeps.
SAMPLE_EVERY_S = 5.0
RATE_WINDOW_S = 60.0
HISTORY_EVERY_S = 30.0
HISTORY_POINTS = 120  # an hour at 30 s

_TOTAL_TOKENS = re.compile(rb'"total_tokens"\s*:\s*(\d+)')


class Histogram:
    """Counts per bucket (upper bounds `bounds`, then +Inf) and the sum, as Prometheus keeps them."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(self.bounds, seconds)] += 1
        self.total += seconds

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> Iterator[tuple[str, int]]:
        """`(le, count of observations <= le)` per bucket, `+Inf` last."""
        running = 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += count
            yield ("+Inf" if bound == float("inf") else repr(bound)), running

    def quantile(self, q: float) -> float | None:
        """The `q` quantile, interpolated within its bucket as Prometheus' `histogram_quantile` does
        (None without observations; the last bound if it is past it)."""
        total = self.count
        if total == 0:
            return None
        wanted, running, lower = q * total, 0, 0.0
        for bound, count in zip(self.bounds, self.counts, strict=False):
            if count and running + count >= wanted:
                return lower + (bound - lower) * (wanted - running) / count
            running += count
            lower = bound
        return self.bounds[-1]


#: Every fsync round of the process's checkpoint files (`app.store.durable.GroupSync`): one per process.
FSYNC_SECONDS = Histogram(FSYNC_BUCKETS)
FSYNC_OBSERVERS.append(FSYNC_SECONDS.observe)


@dataclass(slots=True)
class RankCounters:
    """One rank's numbers since this proxy started (progress fields: as its checkpoints last said)."""

    hits: int = 0
    coalesced: int = 0
    misses: int = 0
    refreshed: int = 0
    tokens_saved: int = 0
    documents: int = 0
    duplicates: int = 0
    chunks_published: int = 0
    #: -1 before the rank's checkpoints were read
    last_chunk_index: int = -1
    #: documents checkpointed or published, before this run included
    done_documents: int = 0
    #: what the job declared (`X-Total-Documents`), if it did
    total_documents: int | None = None
    known: bool = False  # progress fields read from the checkpoints at least once
    #: when it became known, and its `done_documents` then: the start of its rate until a minute has passed
    known_at: float = 0.0
    known_done: int = 0
    #: `activity()` when `Metrics.forget_idle_ranks` last looked: a change there means the rank was used
    seen_activity: int = 0

    def activity(self) -> int:
        return self.hits + self.coalesced + self.misses + self.refreshed + self.documents

    def add(self, other: RankCounters) -> None:
        """Add `other`'s counts (not its progress fields, which describe one rank)."""
        for name in COUNTS:
            setattr(self, name, getattr(self, name) + getattr(other, name))


#: A rank's counts, which `forgotten` adds up (the other fields of `RankCounters` describe one rank).
COUNTS = ("hits", "coalesced", "misses", "refreshed", "tokens_saved", "documents", "duplicates", "chunks_published")


class Sample:
    """Totals at one moment, for rates and the history."""

    __slots__ = ("at", "done", "totals")

    def __init__(self, at: float, totals: dict[str, int], done: dict[int, int]) -> None:
        self.at = at
        self.totals = totals
        self.done = done


@dataclass
class Metrics:
    enabled: bool = True
    max_tracked_ranks: int = 1024
    started: float = field(default_factory=time.time)
    #: (route, X-Cache outcome or "", status) -> requests answered
    requests: Counter[tuple[str, str, int]] = field(default_factory=Counter)
    #: ordered from the least recently active (as `forget_idle_ranks` last saw them)
    ranks: dict[int, RankCounters] = field(default_factory=dict)
    #: the counts of the ranks forgotten, and how many were
    forgotten: RankCounters = field(default_factory=RankCounters)
    #: the Batch API's lines: answered from its answers' cache (hits, tokens saved) or generated (misses),
    #: in the totals beside the ranks' requests, in no rank's
    batch_lines: RankCounters = field(default_factory=RankCounters)
    ranks_forgotten: int = 0
    #: `/lookup` keys with no stored answer
    lookup_misses: int = 0
    #: rank -> when its last chunk's completion was reached (its input exhausted, its last chunk published);
    #: kept apart from `ranks`, so that a finished rank forgotten past `max_tracked_ranks` still counts as
    #: finished for the job. In memory only: a restarted proxy knows it only once the job says so again.
    finished: dict[int, float] = field(default_factory=dict)
    #: how many ranks the job has (`X-Total-Ranks`, datatrove's world_size), as last declared
    total_ranks: int | None = None
    #: rank -> (when, rows) of its cache's last count (`app.service.routes.ops.cache_sizes`)
    cache_entries: dict[int, tuple[float, int | None]] = field(default_factory=dict)
    recent: deque[Sample] = field(default_factory=lambda: deque(maxlen=int(RATE_WINDOW_S / SAMPLE_EVERY_S) + 2))
    history: deque[Sample] = field(default_factory=lambda: deque(maxlen=HISTORY_POINTS))
    #: held while a rank moves within `ranks` or into `forgotten`, and while `tracked()` copies both: a
    #: reader in another thread never sees a rank's counts twice or not at all
    _moving: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.enabled:
            self.hit = self.replayed = self.request = _ignore  # type: ignore[method-assign,assignment]

    def rank(self, rank: int) -> RankCounters:
        counters = self.ranks.get(rank)
        if counters is None:
            counters = self.ranks[rank] = RankCounters()
        return counters

    # -- counting: called where the work is done --------------------------------------

    def hit(self, rank: int, route: str, status: int, body: bytes) -> None:
        """A hit answered on the fast path: the request and the replay at once."""
        self.requests[(route, "HIT", status)] += 1
        counters = self.ranks.get(rank) or self.rank(rank)
        counters.hits += 1
        counters.tokens_saved += tokens_in(body)

    def replayed(self, rank: int, coalesced: bool, body: bytes) -> None:
        """A stored or shared answer replayed by the ASGI path (its request is counted by `request`)."""
        counters = self.ranks.get(rank) or self.rank(rank)
        if coalesced:
            counters.coalesced += 1
        else:
            counters.hits += 1
        counters.tokens_saved += tokens_in(body)

    def request(self, route: str, outcome: str, status: int) -> None:
        self.requests[(route, outcome, status)] += 1

    def finish(self, rank: int, at: float | None = None) -> None:
        """The rank's last chunk is complete and published: its input is exhausted."""
        self.finished[rank] = time.time() if at is None else at

    def unfinish(self, rank: int) -> None:
        """The rank is written to again (a new run of it): no longer finished."""
        self.finished.pop(rank, None)

    def job(self) -> dict[str, int | bool | None]:
        """The job as its ranks declared it: how many ranks it has (null if none said), how many of them
        finished, and whether all did."""
        declared, finished = self.total_ranks, list(self.finished)  # a copy: read from another thread
        done = sum(1 for rank in finished if declared is None or rank < declared)
        return {
            "ranks_declared": declared,
            "ranks_finished": done,
            "finished": declared is not None and done >= declared,
        }

    # -- bounding the ranks ------------------------------------------------------------

    def forget_idle_ranks(self, keep: Collection[int]) -> None:
        """Keep at most `max_tracked_ranks` ranks: forget the least recently active ones not in `keep`
        (the open ones), their counts added to `forgotten`. Called every `SAMPLE_EVERY_S`, off the
        request path: activity is the counts changing since the last call, which orders `ranks`."""
        ranks = self.ranks
        with self._moving:
            for rank, counters in list(ranks.items()):
                activity = counters.activity()
                if activity != counters.seen_activity:
                    counters.seen_activity = activity
                    ranks[rank] = ranks.pop(rank)  # to the end: the most recently active
            excess = len(ranks) - self.max_tracked_ranks
            if excess <= 0:
                return
            for rank in [rank for rank in ranks if rank not in keep][:excess]:
                self.forgotten.add(ranks.pop(rank))
                self.ranks_forgotten += 1

    def tracked(self) -> tuple[dict[int, RankCounters], RankCounters]:
        """Copies of `ranks` and `forgotten` taken together, for a reader in another thread: each rank's
        counts copied too, or those the event loop adds while the reader sums them and then shows them
        count in a rank but not in the totals."""
        with self._moving:
            forgotten = copy.copy(self.forgotten)
            ranks = dict(self.ranks)
        # Outside the lock: a rank forgotten since keeps its final counts here, which `forgotten` above lacks.
        return {rank: copy.copy(counters) for rank, counters in ranks.items()}, forgotten

    # -- rates and history -----------------------------------------------------------

    def totals(self, tracked: tuple[dict[int, RankCounters], RankCounters] | None = None) -> dict[str, int]:
        """The counts of every rank, forgotten ones included: those of `tracked` (a `tracked()`, in another
        thread), else those now (on the event loop, which alone changes them: nothing copied)."""
        sums = dict.fromkeys(("hits", "coalesced", "misses", "refreshed", "tokens_saved", "documents"), 0)
        ranks, forgotten = tracked or (self.ranks, self.forgotten)
        for counters in (*ranks.values(), forgotten, self.batch_lines):
            sums["hits"] += counters.hits
            sums["coalesced"] += counters.coalesced
            sums["misses"] += counters.misses
            sums["refreshed"] += counters.refreshed
            sums["tokens_saved"] += counters.tokens_saved
            sums["documents"] += counters.documents
        sums["requests"] = sum(self.requests.values())
        return sums

    def sample(self, now: float | None = None) -> None:
        """Remember the totals now: called every `SAMPLE_EVERY_S` by the proxy's lifespan."""
        now = time.time() if now is None else now
        point = Sample(now, self.totals(), {r: c.done_documents for r, c in self.ranks.items()})
        self.recent.append(point)
        if not self.history or now - self.history[-1].at >= HISTORY_EVERY_S - 0.5:
            # The history shows totals only: a copy of every rank's count per point grew with each rank seen.
            self.history.append(Sample(now, point.totals, {}))

    def documents_per_s(self, rank: int, counters: RankCounters, window: tuple[Sample, Sample]) -> float | None:
        """The rank's documents done per second over the last minute (or since it became known); `counters`
        its counts in the reading `window` was made from."""
        if not counters.known:
            return None
        oldest, latest = window
        since, done_then = oldest.at, oldest.done.get(rank)
        if done_then is None or counters.known_at > since:
            since, done_then = counters.known_at, counters.known_done
        span = latest.at - since
        return (counters.done_documents - done_then) / span if span > 0 else None

    def window(self, tracked: tuple[dict[int, RankCounters], RankCounters]) -> tuple[Sample, Sample] | None:
        """The oldest sample of the last minute and the totals of `tracked`, a `tracked()` made now (None
        before the first sample)."""
        if not self.recent:
            return None
        now = Sample(time.time(), self.totals(tracked), {r: c.done_documents for r, c in tracked[0].items()})
        recent = list(self.recent)  # a copy: `/stats` reads from another thread
        oldest = next((s for s in recent if now.at - s.at <= RATE_WINDOW_S + 1), recent[-1])
        return oldest, now


def tokens_in(body: bytes) -> int:
    """`usage.total_tokens` of an answer (the last one in a stream), 0 if it has none."""
    at = body.rfind(b'"total_tokens"')
    if at < 0:
        return 0
    found = _TOTAL_TOKENS.match(body, at)
    return int(found[1]) if found is not None else 0


def _ignore(*args: object) -> None:
    """What a disabled `Metrics` does instead of counting."""
