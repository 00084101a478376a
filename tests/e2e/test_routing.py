"""Routing across replicas (contract §4) against real processes: `inferproxy serve` in front of two
`inferproxy fake-upstream` replicas, each serving a model of its own name. Requests name no model, so each
answer's `model` says which replica generated it.

Where the load bound cannot come into play (one request in flight at a time, or a bound that never binds),
every document's place is what rendezvous hashing of the replicas' URLs says, and the tests assert it
request by request; elsewhere they assert what the bound guarantees.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.service.affinity import ranking
from app.service.upstream import UpstreamPool
from tests.browser import browser, text_of
from tests.chaos.harness import Process
from tests.e2e.conftest import start_proxy
from tests.servers import free_port, process, run_cli, wait_for_http

DOCUMENTS = 200
ROLLOUTS = 4
#: Readiness only, never an assertion on speed.
WAIT_S = 60.0


class Replica(Process):
    """`inferproxy fake-upstream --model NAME` on one port for its whole life, killed and started again."""

    def __init__(self, data: Path, name: str, latency_ms: float = 0.0) -> None:
        super().__init__(data / f"{name}.log", free_port(), "/v1/models")
        self.name = name
        self.latency_ms = latency_ms

    def command(self) -> list[str]:
        return [
            "app.cli",
            "fake-upstream",
            f"--port={self.port}",
            f"--model={self.name}",
            f"--latency-ms={self.latency_ms:g}",
        ]


class Routed:
    """The proxy's client, and where each answer was generated."""

    def __init__(self, client: httpx.AsyncClient, replicas: list[Replica]) -> None:
        self.client = client
        self.replicas = replicas
        self.pool = UpstreamPool([r.url for r in replicas])  # the proxy's own ranking, computed here

    def home(self, doc_id: str, among: Iterable[Replica] | None = None) -> str:
        """The replica `doc_id`'s rollouts go to while under the bound, among `among` (default: all)."""
        urls = {r.url for r in (among or self.replicas)}
        first = ranking(doc_id.encode(), [r for r in self.pool.replicas if r.url in urls])[0]
        return next(r.name for r in self.replicas if r.url == first.url)

    async def generate(self, doc_id: str, rollout: int, **fault: Any) -> str:
        """One rollout; the name of the replica that generated it (an error fails the test)."""
        body: dict[str, Any] = {"prompt": f"the document {doc_id}", "max_tokens": 2}
        if fault:
            body["fake_upstream"] = fault
        headers = {"X-Doc-Id": doc_id, "X-Rollout-Idx": str(rollout)}
        answer = await self.client.post("/v1/completions", json=body, headers=headers)
        assert answer.status_code == 200, f"{doc_id}/{rollout}: {answer.status_code} {answer.text}"
        assert answer.headers["x-cache"] == "MISS"
        name: str = answer.json()["model"]
        return name

    async def run(self, work: list[tuple[str, int]], concurrency: int, **fault: Any) -> dict[tuple[str, int], str]:
        """Every (document, rollout) of `work` sent in order, `concurrency` at a time (asking the fake upstream
        for `fault`): where each went, in the order they were answered."""
        placed: dict[tuple[str, int], str] = {}
        queue = list(reversed(work))

        async def worker() -> None:
            while queue:
                doc_id, rollout = queue.pop()
                placed[(doc_id, rollout)] = await self.generate(doc_id, rollout, **fault)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return placed

    async def upstreams(self) -> dict[str, dict[str, Any]]:
        """`/stats` per replica, by name."""
        stats = (await self.client.get("/stats")).json()
        names = {r.url: r.name for r in self.replicas}
        return {names[u["url"]]: u for u in stats["upstreams"]}

    async def until(self, what: str, condition: Any) -> dict[str, dict[str, Any]]:
        """`/stats` per replica once `condition` holds of it (polled), or fail naming `what`."""
        deadline = time.monotonic() + WAIT_S
        while True:
            upstreams = await self.upstreams()
            if condition(upstreams):
                return upstreams
            assert time.monotonic() < deadline, f"{what}: not within {WAIT_S} s: {upstreams}"
            await asyncio.sleep(0.02)


def everything(documents: int = DOCUMENTS, rollouts: int = ROLLOUTS, prefix: str = "doc") -> list[tuple[str, int]]:
    """Every rollout of every document, a document's rollouts one after another, as a job sends them."""
    return [(f"{prefix}-{d}", r) for d in range(documents) for r in range(rollouts)]


@pytest.fixture
async def replicas(tmp_path: Path) -> AsyncIterator[list[Replica]]:
    started = [Replica(tmp_path, "r0"), Replica(tmp_path, "r1")]
    try:
        for replica in started:
            replica.start()
        for replica in started:
            await replica.ready()
        yield started
    finally:
        for replica in started:
            replica.close()


@pytest.fixture
def serve(replicas: list[Replica], tmp_path: Path) -> Any:
    """`routed(*flags)`: the proxy in front of both replicas, with `flags`, and its client."""

    @contextlib.asynccontextmanager
    async def routed(*flags: str) -> AsyncIterator[Routed]:
        others = [f"--upstream={r.url}" for r in replicas[1:]]
        args, port = start_proxy(replicas[0].url, tmp_path, *others, "--health-interval-s=0.1", *flags)
        with process(*args):
            url = f"http://127.0.0.1:{port}"
            await asyncio.to_thread(wait_for_http, url + "/healthz")
            limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
            async with httpx.AsyncClient(base_url=url, timeout=WAIT_S, limits=limits) as client:
                yield Routed(client, replicas)

    return routed


async def test_each_rollout_goes_to_its_documents_replica_while_the_bound_does_not_bind(serve: Any) -> None:
    async with serve("--affinity-load-bound=1") as routed:  # 2 replicas: (1 + 1) x the mean never binds
        placed = await routed.run(everything(), concurrency=64)
        upstreams = await routed.upstreams()
    assert all(name == routed.home(doc_id) for (doc_id, _), name in placed.items())
    served = Counter(placed.values())
    assert all(0.3 * len(placed) <= served[name] <= 0.7 * len(placed) for name in ("r0", "r1")), served
    for name in ("r0", "r1"):
        assert (upstreams[name]["requests"], upstreams[name]["spilled"]) == (served[name], 0)


async def test_a_documents_rollouts_meet_on_one_replica_and_the_documents_spread_over_both(serve: Any) -> None:
    async with serve() as routed:
        placed = await routed.run(everything(), concurrency=128)
        upstreams = await routed.upstreams()
    by_document: dict[str, set[str]] = defaultdict(set)
    for (doc_id, _), name in placed.items():
        by_document[doc_id].add(name)
    together = sum(1 for names in by_document.values() if len(names) == 1)
    assert together >= 0.95 * DOCUMENTS, f"only {together} of {DOCUMENTS} documents had their rollouts together"
    served = Counter(placed.values())
    assert all(0.3 * len(placed) <= served[name] <= 0.7 * len(placed) for name in ("r0", "r1")), served
    # Every request went where the ranking says, or was a spill-over from there, counted as one
    away = Counter(routed.home(doc_id) for (doc_id, _), name in placed.items() if name != routed.home(doc_id))
    for name in ("r0", "r1"):
        assert upstreams[name]["requests"] == served[name]
        assert upstreams[name]["spilled"] == away[name]
        assert upstreams[name]["errors"] == upstreams[name]["retries"] == 0


async def test_a_hot_document_spills_over_to_its_next_replica_under_the_bound(
    serve: Any, replicas: list[Replica], chromium: str, tmp_path: Path
) -> None:
    async with serve() as routed:
        home = routed.home("hot")
        # 24 rollouts of one document at once, held upstream until all are in flight
        sending = [asyncio.ensure_future(routed.generate("hot", r, latency_ms=3000)) for r in range(24)]
        upstreams = await routed.until(
            "the 24 rollouts in flight", lambda u: sum(r["in_flight"] for r in u.values()) == 24
        )
        names = await asyncio.gather(*sending)
        # The spill-overs, and the routing, where a person watching the run looks
        proxy = str(routed.client.base_url).rstrip("/")
        metrics = (await routed.client.get("/metrics")).text
        shown = await asyncio.to_thread(run_cli, "status", proxy, "--once")
        async with browser(chromium, tmp_path) as chrome:
            page = await chrome.open(proxy + "/")
            await page.wait_for("document.querySelectorAll('#replicas tbody tr').length === 2")
            rows = await page.evaluate(
                "[...document.querySelectorAll('#replicas tbody tr')].map(r => [...r.cells].map(c => c.textContent))"
            )
            summary = await page.evaluate(text_of("replicas-summary"))
    other = "r1" if home == "r0" else "r0"
    # the bound, max(ceil(1.5 x (in flight + 1) / 2), MIN_BOUND = 16): 16 up to the 21st, then 17, 18, 18
    assert (upstreams[home]["in_flight"], upstreams[other]["in_flight"]) == (18, 6)
    assert (upstreams[home]["spilled"], upstreams[other]["spilled"]) == (6, 0)
    assert Counter(names) == {home: 18, other: 6}

    url = {r.name: r.url for r in replicas}
    assert f'inferproxy_upstream_spilled_total{{replica="{url[home]}"}} 6.0' in metrics
    assert f'inferproxy_upstream_spilled_total{{replica="{url[other]}"}} 0.0' in metrics
    assert 'inferproxy_routing_info{routing="affinity"} 1.0' in metrics
    assert shown.returncode == 0, shown.stderr
    table = {line.split()[0]: line.split() for line in shown.stdout.splitlines() if line.strip().startswith("http")}
    assert any(line.strip().startswith("upstream (routing: affinity)") for line in shown.stdout.splitlines())
    # url, health, in flight, requests, spilled: each replica's
    assert (table[url[home]][3], table[url[home]][4]) == ("18", "6")
    assert (table[url[other]][3], table[url[other]][4]) == ("6", "0")
    assert "routing: affinity" in summary
    assert {row[0]: (row[3], row[4]) for row in rows} == {url[home]: ("18", "6"), url[other]: ("6", "0")}


async def test_a_replica_killed_mid_run_fails_no_request_and_its_documents_go_to_the_other(
    serve: Any, replicas: list[Replica]
) -> None:
    async with serve("--upstream-retries=3") as routed:
        work = everything()
        killed = replicas[1]
        first, rest = work[: len(work) // 3], work[len(work) // 3 :]
        placed = await routed.run(first, concurrency=8, latency_ms=20)
        assert Counter(placed.values())[killed.name] > 0
        # Killed with requests of its own in flight: those are retried on the other replica
        running = asyncio.ensure_future(routed.run(rest, concurrency=8, latency_ms=20))
        await routed.until("requests in flight on the replica killed", lambda u: u[killed.name]["in_flight"] > 0)
        killed.kill()
        placed_after = await running  # every answer a 200: `generate` asserts it
        upstreams = await routed.upstreams()
    assert not upstreams[killed.name]["healthy"]
    assert upstreams[killed.name]["errors"] >= 1
    late = list(placed_after.values())[-100:]  # sent well after the kill: nowhere but the replica alive
    assert set(late) == {replicas[0].name}


async def test_a_replica_back_takes_back_its_own_documents_only(serve: Any, replicas: list[Replica]) -> None:
    # A bound that never binds: each document's place is the ranking's alone
    async with serve("--affinity-load-bound=100") as routed:
        before = await routed.run(everything(rollouts=1), concurrency=8)
        assert all(name == routed.home(doc_id) for (doc_id, _), name in before.items())
        away = replicas[1]
        away.kill()  # found out by the first request sent to it, retried on the other
        meanwhile = await routed.run([(d, 1) for d, _ in before], concurrency=8)
        assert set(meanwhile.values()) == {replicas[0].name}
        away.start()
        await away.ready()
        await routed.until("the replica back in", lambda u: u[away.name]["healthy"])
        after = await routed.run([(d, 2) for d, _ in before], concurrency=8)
    # Each document is where it was before: the replica back took its own, and no other moved
    assert {doc_id: name for (doc_id, _), name in after.items()} == {
        doc_id: name for (doc_id, _), name in before.items()
    }
    assert 0 < Counter(after.values())[away.name] < DOCUMENTS
