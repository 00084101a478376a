"""Health, readiness and what the proxy has done: `GET /healthz`, `/readyz`, `/stats` (JSON), `/metrics`
(Prometheus text) and the page at `/`.

`/stats`, `/metrics`, the page and `inferproxy status` show the same numbers: `snapshot` reads them once
from `app.ops.metrics` and the services, and each route renders it. Both are built in a thread: with tens of
thousands of ranks a snapshot takes a while, and the event loop answers hits meanwhile (the thread only
reads, from copies of the dicts the loop changes).
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import time
from collections.abc import Iterator
from importlib import resources
from typing import Any

import orjson
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector, CollectorRegistry

from app import __version__
from app.ops.metrics import COUNTS, FSYNC_SECONDS, Histogram, Metrics, RankCounters
from app.service.errors import ServiceUnavailable
from app.service.services import PublicationState, Services
from app.store.cache import count_rows

#: How long a rank's counted cache entries are shown before they are counted again: a count scans the
#: table, so a second per this many rows (a few ms of scanning), at least one.
ROWS_PER_SECOND_SHOWN = 200_000


HEALTHY = b'{"status":"ok"}'


async def readiness(services: Services) -> dict[str, Any]:
    """Ready while at least one upstream answers `GET /v1/models`; `ServiceUnavailable` (503) otherwise."""
    replicas = services.pool.replicas
    answering = await services.pool.probe_all()
    if not any(answering):
        raise ServiceUnavailable("no upstream answers GET /v1/models: " + ", ".join(r.url for r in replicas))
    return {"status": "ready", "upstreams": {r.url: ok for r, ok in zip(replicas, answering, strict=True)}}


async def stats(services: Services) -> bytes:
    """Everything in one JSON object (docs/contract.md, "Operations")."""
    sizes, publications = await cache_sizes(services), services.publications()
    return await asyncio.to_thread(lambda: orjson.dumps(snapshot(services, sizes, publications)))


async def metrics(services: Services) -> bytes:
    """The same numbers in Prometheus' text format (`CONTENT_TYPE_LATEST`)."""
    sizes, publications = await cache_sizes(services), services.publications()
    return await asyncio.to_thread(render_metrics, services, sizes, publications)


def render_metrics(
    services: Services, sizes: dict[int, tuple[int | None, int]], publications: dict[int, PublicationState]
) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(snapshot(services, sizes, publications), services.metrics, services))
    return generate_latest(registry)


def page() -> bytes:
    """The live page: one HTML file that polls `/stats` (no build step, no CDN)."""
    return resources.files("app.service").joinpath("static/page.html").read_bytes()


# -- the snapshot -----------------------------------------------------------------------


def snapshot(
    services: Services,
    sizes: dict[int, tuple[int | None, int]],
    publications: dict[int, PublicationState] | None = None,
) -> dict[str, Any]:
    """The numbers now; `sizes` from `cache_sizes`, `publications` from `Services.publications` (read on the
    event loop). Safe in a thread beside the event loop: it changes nothing and iterates only over copies."""
    publications = publications or {}
    metrics = services.metrics
    now = time.time()
    counted, forgotten = tracked = metrics.tracked()  # one reading: the ranks and `forgotten` add up to the totals
    totals = metrics.totals(tracked)
    window = metrics.window(tracked)
    rates: dict[str, float] = {}
    rank_rates: dict[int, float] = {}
    if window is not None:
        oldest, latest = window
        span = max(latest.at - oldest.at, 1e-9)
        for name in ("requests", "hits", "misses", "documents", "tokens_saved"):
            rates[f"{name}_per_s"] = round((latest.totals[name] - oldest.totals[name]) / span, 3)
        rates["window_s"] = round(span, 1)
        rank_rates = {
            r: rate for r, c in counted.items() if (rate := metrics.documents_per_s(r, c, window)) is not None
        }
    replayed = totals["hits"] + totals["coalesced"]
    answered = replayed + totals["misses"] + totals["refreshed"]
    owned = services.caches.ownership.owned()
    finished = dict(metrics.finished)  # a copy: the event loop changes it
    ranks = [
        rank_view(
            rank,
            counted.get(rank) or RankCounters(),
            rank in owned,
            rank_rates.get(rank),
            sizes.get(rank),
            publications.get(rank),
            finished.get(rank),
        )
        for rank in sorted(set(counted) | set(owned) | {r for r, p in publications.items() if p.lost})
    ]
    return {
        "version": __version__,
        "started_at": round(metrics.started, 3),
        "now": round(now, 3),
        "uptime_s": round(now - metrics.started, 1),
        "requests": request_counts(metrics, totals),
        "totals": {**totals, "hit_ratio": round(replayed / answered, 4) if answered else None},
        "rates": rates,
        "in_flight": len(services.flights),
        "queued": len(services.pool.slots.waiters),
        "routing": services.pool.routing,
        "upstreams": [
            {
                "url": r.url,
                "healthy": r.healthy,
                "in_flight": r.in_flight,
                "requests": r.requests,
                "errors": r.errors,
                "retries": r.retries,
                "spilled": r.spilled,
                "latency_p50_s": r.latency.quantile(0.5),
                "latency_p99_s": r.latency.quantile(0.99),
            }
            for r in services.pool.replicas
        ],
        "batches": services.batches.progress() if services.batches is not None else [],
        "batches_done": services.batches.ended_counts() if services.batches is not None else {},
        "fsync": {"count": FSYNC_SECONDS.count, "p99_s": FSYNC_SECONDS.quantile(0.99)},
        "owned_ranks": owned,
        "job": metrics.job(),
        "ranks": ranks,
        "forgotten": {"ranks": metrics.ranks_forgotten, **{name: getattr(forgotten, name) for name in COUNTS}},
        "history": [{"t": round(s.at, 1), **s.totals} for s in list(metrics.history)],
    }


def request_counts(metrics: Metrics, totals: dict[str, int]) -> dict[str, int]:
    """Requests by cache outcome (`hit`, `miss`, ...) and errors by status (`error_502`), as before."""
    counts: dict[str, int] = {}
    for name, total in (("hit", "hits"), ("coalesced", "coalesced"), ("miss", "misses"), ("refresh", "refreshed")):
        if totals[total]:
            counts[name] = totals[total]
    if metrics.lookup_misses:
        counts["lookup_miss"] = metrics.lookup_misses
    for (_, outcome, status), count in list(metrics.requests.items()):
        if outcome == "BYPASS":
            counts["bypass"] = counts.get("bypass", 0) + count
        if status >= 400:
            counts[f"error_{status}"] = counts.get(f"error_{status}", 0) + count
    return counts


def rank_view(
    rank: int,
    counters: RankCounters,
    owned: bool,
    rate: float | None,
    size: tuple[int | None, int] | None,
    publication: PublicationState | None = None,
    finished_at: float | None = None,
) -> dict[str, Any]:
    total = counters.total_documents
    # Chunks published before this process counted are taken as full: a finished job's short last chunk
    # would make more done than it has.
    done = counters.done_documents if total is None else min(counters.done_documents, total)
    progress = min(done / total, 1.0) if total else (1.0 if total == 0 else None)
    eta = None
    if total is not None and rate:
        eta = round(max(total - done, 0) / rate, 1) if rate > 0 else None
    finished = finished_at is not None
    if finished:  # its input exhausted: its total is known now, whether the job declared one or not
        total = done if total is None else total
        progress, eta = 1.0, 0.0
    entries, size_bytes = size if size is not None else (None, 0)
    return {
        "rank": rank,
        "owned": owned,
        "finished": finished,
        "finished_at": round(finished_at, 3) if finished_at is not None else None,
        "hits": counters.hits,
        "coalesced": counters.coalesced,
        "misses": counters.misses,
        "refreshed": counters.refreshed,
        "tokens_saved": counters.tokens_saved,
        "documents": counters.documents,
        "duplicates": counters.duplicates,
        "chunks_published": counters.chunks_published,
        "last_chunk_index": counters.last_chunk_index if counters.known else None,
        "done_documents": done if counters.known else None,
        "total_documents": total,
        "progress": round(progress, 4) if progress is not None else None,
        "documents_per_s": round(rate, 3) if rate is not None else None,
        "eta_s": eta,
        "cache_entries": entries,
        "cache_bytes": size_bytes,
        # complete chunks not yet published (the output slow or failing), and why while it fails
        "chunks_waiting": publication.waiting if publication is not None else 0,
        "publication_error": publication.error if publication is not None else None,
        "publication_failing_since": publication.failing_since if publication is not None else None,
        "publication_attempts": publication.attempts if publication is not None else 0,
        "publication_retry_in_s": publication.retry_in_s if publication is not None else None,
        "chunks_lost": list(publication.lost) if publication is not None else [],
    }


async def cache_sizes(services: Services) -> dict[int, tuple[int | None, int]]:
    """`(entries, bytes)` of each open rank's cache; entries counted again once the count is older than a
    second per `ROWS_PER_SECOND_SHOWN` rows."""
    counts = services.metrics.cache_entries
    sizes: dict[int, tuple[int | None, int]] = {}
    now = time.monotonic()
    opened = services.caches.all_opened()
    for rank in counts.keys() - opened.keys():  # closed since: counted again if it opens again
        counts.pop(rank, None)
    for rank, cache in opened.items():
        path = cache.db_path
        if path is None:
            continue
        size = sum(_size(path + suffix) for suffix in ("", "-wal"))
        counted = counts.get(rank)
        if counted is None or now - counted[0] > max(1.0, (counted[1] or 0) / ROWS_PER_SECOND_SHOWN):
            counted = counts[rank] = (now, await asyncio.to_thread(_count_entries, path))
        sizes[rank] = (counted[1], size)
    return sizes


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _count_entries(path: str) -> int | None:
    """The rows of a rank's cache file, None if it cannot be read now (it is being closed, or gone)."""
    try:
        return count_rows(path)
    except (sqlite3.Error, OSError):
        return None


# -- Prometheus -------------------------------------------------------------------------


def batch_metrics(batches: list[dict[str, Any]]) -> Iterator[Metric]:
    """`inferproxy_batch_*`: each running batch's lines by state, its tokens and its rate."""
    lines = GaugeMetricFamily("inferproxy_batch_lines", "a running batch's lines, by state", labels=["batch", "state"])
    tokens = GaugeMetricFamily("inferproxy_batch_tokens", "tokens its answers used, by kind", labels=["batch", "kind"])
    rate = GaugeMetricFamily(
        "inferproxy_batch_lines_per_second", "lines done per second since it started here", labels=["batch"]
    )
    for batch in batches:
        done = batch["completed"] + batch["failed"]
        for state, count in (
            ("completed", batch["completed"]),
            ("failed", batch["failed"]),
            ("in_flight", batch["in_flight"]),
            ("pending", max(batch["total"] - done - batch["in_flight"], 0)),
        ):
            lines.add_metric([batch["id"], state], count)
        for kind in ("input_tokens", "output_tokens"):
            tokens.add_metric([batch["id"], kind.removesuffix("_tokens")], batch["usage"][kind])
        rate.add_metric([batch["id"]], batch["lines_per_s"])
    yield from (lines, tokens, rate)


class _Collector(Collector):
    """The snapshot as metric families, built on each scrape."""

    def __init__(self, view: dict[str, Any], metrics: Metrics, services: Services) -> None:
        self.view = view
        self.metrics = metrics
        self.services = services

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            "inferproxy_requests",
            "requests answered, by route, X-Cache outcome and status",
            labels=["route", "cache", "status"],
        )
        for (route, outcome, status), count in sorted(self.metrics.requests.items()):
            requests.add_metric([route, outcome, str(status)], count)
        yield requests

        upstream_requests = CounterMetricFamily(
            "inferproxy_upstream_requests", "attempts sent upstream", labels=["replica"]
        )
        upstream_errors = CounterMetricFamily(
            "inferproxy_upstream_errors", "attempts with no answer, or a 5xx", labels=["replica"]
        )
        upstream_retries = CounterMetricFamily("inferproxy_upstream_retries", "attempts retried", labels=["replica"])
        in_flight = GaugeMetricFamily("inferproxy_upstream_in_flight", "attempts in flight", labels=["replica"])
        spilled = CounterMetricFamily(
            "inferproxy_upstream_spilled",
            "requests this replica was first choice for, passed on over the load bound",
            labels=["replica"],
        )
        healthy = GaugeMetricFamily("inferproxy_upstream_healthy", "1 if the replica answers", labels=["replica"])
        routing = GaugeMetricFamily(
            "inferproxy_routing_info", "how a request's replica is chosen (the routing setting)", labels=["routing"]
        )
        routing.add_metric([self.services.pool.routing], 1.0)
        yield routing
        latency = HistogramMetricFamily(
            "inferproxy_upstream_latency_seconds", "from sending to the answer's head", labels=["replica"]
        )
        yield from batch_metrics(self.view["batches"])
        for replica in self.services.pool.replicas:
            upstream_requests.add_metric([replica.url], replica.requests)
            upstream_errors.add_metric([replica.url], replica.errors)
            upstream_retries.add_metric([replica.url], replica.retries)
            in_flight.add_metric([replica.url], replica.in_flight)
            spilled.add_metric([replica.url], replica.spilled)
            healthy.add_metric([replica.url], 1.0 if replica.healthy else 0.0)
            latency.add_metric([replica.url], list(replica.latency.cumulative()), replica.latency.total)
        yield from (upstream_requests, upstream_errors, upstream_retries, in_flight, spilled, healthy, latency)

        per_rank = {
            "cache_hits": ("inferproxy_cache_hits", "answers replayed from the cache", "hits"),
            "coalesced": ("inferproxy_coalesced", "answers shared with an identical request in flight", "coalesced"),
            "misses": ("inferproxy_cache_misses", "requests generated upstream", "misses"),
            "tokens": ("inferproxy_tokens_saved", "usage.total_tokens of replayed answers", "tokens_saved"),
            "documents": ("inferproxy_documents_written", "documents checkpointed", "documents"),
            "duplicates": ("inferproxy_documents_duplicate", "documents sent again, counted once", "duplicates"),
            "chunks": ("inferproxy_chunks_published", "chunks published by this proxy", "chunks_published"),
        }
        families = {key: CounterMetricFamily(name, text, labels=["rank"]) for key, (name, text, _) in per_rank.items()}
        generations = CounterMetricFamily(
            "inferproxy_generations_saved", "answers served without generating: hits and coalesced", labels=["rank"]
        )
        last_chunk = GaugeMetricFamily("inferproxy_last_chunk_index", "the last chunk published", labels=["rank"])
        done = GaugeMetricFamily("inferproxy_documents_done", "documents checkpointed or published", labels=["rank"])
        total = GaugeMetricFamily("inferproxy_documents_total", "documents the job declared", labels=["rank"])
        waiting = GaugeMetricFamily(
            "inferproxy_chunks_waiting",
            "complete chunks not yet published (the output slow or failing)",
            labels=["rank"],
        )
        failing = GaugeMetricFamily(
            "inferproxy_publication_failing",
            "1 while the rank's publications fail (retried with backoff)",
            labels=["rank"],
        )
        lost = GaugeMetricFamily(
            "inferproxy_chunks_lost",
            "chunks recorded as published but missing from the output (GET /resume refuses the rank)",
            labels=["rank"],
        )
        finished = GaugeMetricFamily(
            "inferproxy_rank_finished",
            "1 once the rank's last chunk is complete and published (its input exhausted)",
            labels=["rank"],
        )
        entries = GaugeMetricFamily("inferproxy_cache_entries", "answers stored in the rank's cache", labels=["rank"])
        size = GaugeMetricFamily("inferproxy_cache_bytes", "size of the rank's cache files", labels=["rank"])
        forgotten = self.view["forgotten"]
        if forgotten["ranks"]:  # their counts under rank="forgotten": a sum over ranks stays whole
            for key, (_, _, field) in per_rank.items():
                families[key].add_metric(["forgotten"], forgotten[field])
            generations.add_metric(["forgotten"], forgotten["hits"] + forgotten["coalesced"])
        for rank in self.view["ranks"]:
            label = [str(rank["rank"])]
            for key, (_, _, field) in per_rank.items():
                families[key].add_metric(label, rank[field])
            generations.add_metric(label, rank["hits"] + rank["coalesced"])
            if rank["last_chunk_index"] is not None:
                last_chunk.add_metric(label, rank["last_chunk_index"])
                done.add_metric(label, rank["done_documents"])
            if rank["total_documents"] is not None:
                total.add_metric(label, rank["total_documents"])
            finished.add_metric(label, 1.0 if rank["finished"] else 0.0)
            if rank["cache_entries"] is not None:
                entries.add_metric(label, rank["cache_entries"])
            if rank["chunks_lost"]:
                lost.add_metric(label, len(rank["chunks_lost"]))
            if rank["owned"]:
                size.add_metric(label, rank["cache_bytes"])
                waiting.add_metric(label, rank["chunks_waiting"])
                failing.add_metric(label, 1.0 if rank["publication_error"] is not None else 0.0)
        yield from families.values()
        yield from (generations, last_chunk, done, total, finished, entries, size, waiting, failing, lost)

        job = self.view["job"]
        if job["ranks_declared"] is not None:
            yield GaugeMetricFamily(
                "inferproxy_job_ranks", "the ranks the job declared (X-Total-Ranks)", value=job["ranks_declared"]
            )
        yield GaugeMetricFamily(
            "inferproxy_job_ranks_finished",
            "ranks of the job whose last chunk is published",
            value=job["ranks_finished"],
        )
        yield GaugeMetricFamily(
            "inferproxy_job_finished",
            "1 once every rank the job declared is finished",
            value=1.0 if job["finished"] else 0.0,
        )

        yield _histogram("inferproxy_fsync_seconds", "checkpoint fsync rounds", FSYNC_SECONDS)
        yield GaugeMetricFamily("inferproxy_in_flight", "upstream generations in flight", value=self.view["in_flight"])
        yield GaugeMetricFamily(
            "inferproxy_upstream_queued", "requests waiting for an upstream slot", value=self.view["queued"]
        )
        yield GaugeMetricFamily("inferproxy_start_time_seconds", "when the proxy started", value=self.metrics.started)
        yield CounterMetricFamily(
            "inferproxy_ranks_forgotten",
            'ranks whose counts moved to rank="forgotten" (past max_tracked_ranks)',
            value=self.view["forgotten"]["ranks"],
        )
        yield CounterMetricFamily(
            "inferproxy_lookup_misses", "/lookup keys without a stored answer", value=self.metrics.lookup_misses
        )


def _histogram(name: str, text: str, histogram: Histogram) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, text)
    family.add_metric([], list(histogram.cumulative()), histogram.total)
    return family
