"""Upstream chaos: two fake-upstream replicas that fail in every way the proxy must survive.

Four ranks send requests (chat and completions, streamed and not), each with a fault drawn from the
seed and asked of the fake upstream in its body: 500, 503 with `Retry-After` (once, then an answer;
or for good), a connection cut mid-stream, an error event mid-stream (as vLLM ends a stream when its
engine fails), an error envelope in a 200, silence past `read_timeout_s` (before the answer, or
mid-stream), a prompt over the context (a 400, which is cached). Meanwhile one replica is killed with
SIGKILL and later restarted on its port. Then every request is sent again. What must hold:

- nothing partial is cached: every stored row is whole, and a request replayed as a HIT is the whole,
  non-error answer its first MISS got, byte for byte; no answer that was whole and cacheable is lost
  (`check_replays`);
- every error is clear: the status a fault calls for, an error body with a message (the upstream's
  own, or the proxy's), `Retry-After` passed on with a 503; a stream cut short is cut for the client
  too (never a clean end without `data: [DONE]`);
- healthy replicas take the load: while one replica is dead every request without a fault still gets
  its answer (connection failures are retried on the other), and the restarted replica gets requests
  again once the proxy sees it healthy.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest

from app.http.client import HTTPClientError
from tests.chaos.conftest import Chaos
from tests.chaos.harness import ProxyProcess, UpstreamProcess, ask, http_client
from tests.chaos.invariants import Answer, Ledger, assert_invariants, check_cache_file

pytestmark = pytest.mark.chaos

RANKS = 4
READ_TIMEOUT_S = 1.0
# Far past READ_TIMEOUT_S: a proxy starved of CPU across its deadline may handle an answer that arrived
# meanwhile before its overdue timer, so the stall must outlast any such starvation.
STALL_MS = 4000
CONCURRENCY = 3  # requests in flight per rank


@dataclass(frozen=True)
class Fault:
    """A fault asked of the fake upstream, and the answers a client may then get."""

    name: str
    fake_upstream: dict[str, Any]
    streamed: bool | None  # None: either
    outcome: Callable[[Answer], str | None]  # what is wrong with the answer, or None
    extra: dict[str, Any] | None = None


def error_message(answer: Answer) -> str | None:
    """The message of an error body (the OpenAI envelope, the proxy's or vLLM's), or None."""
    try:
        error = orjson.loads(answer.data or b"")["error"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return None
    message = error.get("message") if isinstance(error, dict) else None
    return message if isinstance(message, str) and message else None


def whole(answer: Answer) -> str | None:
    if answer.status != 200 or answer.data is None:
        return "not a whole 200"
    return answer.why_not_storable()


def status_with_message(*statuses: int, retry_after: bool = False) -> Callable[[Answer], str | None]:
    def check(answer: Answer) -> str | None:
        if answer.status not in statuses or error_message(answer) is None:
            return f"not a {statuses} with an error message"
        if retry_after and not any(name == b"retry-after" for name, _ in answer.headers):
            return "a 503 without its Retry-After"
        return None

    return check


def answered_or_503(answer: Answer) -> str | None:
    # Each replica fails the first attempt it gets: three attempts of four may fail.
    return whole(answer) and status_with_message(503, retry_after=True)(answer)


def cut(answer: Answer) -> str | None:
    return None if answer.data is None else "a stream the upstream cut reached the client as if whole"


def with_error_event(answer: Answer) -> str | None:
    if answer.status != 200 or answer.data is None or b'"error"' not in answer.data:
        return "the error event did not reach the client"
    return None


def error_in_a_200(answer: Answer) -> str | None:
    return None if answer.status == 200 and error_message(answer) else "the error envelope did not reach the client"


FAULTS = [
    Fault("none", {}, None, whole),
    Fault("none", {}, None, whole),
    Fault("none", {}, None, whole),
    Fault("500", {"status": 500}, None, status_with_message(500)),
    Fault("503 once", {"status": 503, "retry_after": 0.05, "fail_times": 1}, None, answered_or_503),
    Fault("503 for good", {"status": 503, "retry_after": 0.05}, None, status_with_message(503, retry_after=True)),
    Fault("cut mid-stream", {"disconnect_after_chunks": 2}, True, cut),
    Fault("error event mid-stream", {"error_event_after_chunks": 2}, True, with_error_event),
    Fault("error in a 200", {"error_with_status": 200}, False, error_in_a_200),
    Fault("silent before the answer", {"latency_ms": STALL_MS}, False, status_with_message(504)),
    Fault("silent mid-stream", {"chunk_delay_ms": STALL_MS}, True, cut),
    Fault("over the context", {}, None, status_with_message(400), extra={"max_tokens": 100_000}),
]


@dataclass(frozen=True)
class Request:
    rank: int
    doc_id: str
    path: str
    body: bytes
    fault: Fault


def draw_requests(rng: random.Random, count: int) -> dict[int, list[Request]]:
    requests: dict[int, list[Request]] = {}
    for rank in range(RANKS):
        requests[rank] = []
        for i in range(count):
            fault = rng.choice(FAULTS)
            streamed = rng.random() < 0.5 if fault.streamed is None else fault.streamed
            doc_id = f"r{rank}-req-{i}"
            body: dict[str, Any] = {"model": "fake-model", "max_tokens": 5, "stream": streamed, **(fault.extra or {})}
            if fault.fake_upstream:
                body["fake_upstream"] = fault.fake_upstream
            if rng.random() < 0.5:
                path, body = "/v1/completions", {**body, "prompt": doc_id}
            else:
                path, body = "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": doc_id}]}
            requests[rank].append(Request(rank, doc_id, path, orjson.dumps(body), fault))
    return requests


async def send_all(url: str, ledger: Ledger, requests: list[Request], sent: list[int]) -> None:
    """Send requests, `CONCURRENCY` at a time per rank; one cut short is recorded as such, not retried."""
    slots = {rank: asyncio.Semaphore(CONCURRENCY) for rank in range(RANKS)}
    async with http_client(read_timeout=30) as client:

        async def one(request: Request) -> None:
            async with slots[request.rank]:
                with contextlib.suppress(HTTPClientError):  # recorded as cut
                    await ask(client, ledger, url, request.rank, request.doc_id, 0, request.path, request.body)
                sent[0] += 1

        await asyncio.gather(*(one(request) for request in requests))


async def replica_health(proxy: ProxyProcess, replica: UpstreamProcess) -> bool:
    async with http_client() as client, client.request("GET", proxy.url + "/stats") as answer:
        stats = orjson.loads(await answer.read())
    return any(up["url"] == replica.url and up["healthy"] for up in stats["upstreams"])


async def test_a_failing_upstream_never_gets_anything_partial_cached_and_its_errors_are_clear(
    tmp_path: Path, chaos: Chaos
) -> None:
    rng = chaos.rng("upstream")
    count = chaos.count(36, 240)
    steady, dying = UpstreamProcess(tmp_path, "steady"), UpstreamProcess(tmp_path, "dying")
    proxy = ProxyProcess(
        tmp_path,
        [steady.url, dying.url],
        f"--read-timeout-s={READ_TIMEOUT_S:g}",
        "--upstream-retries=3",
        "--health-interval-s=0.2",
    )
    requests = draw_requests(rng, count)
    ledger = Ledger({rank: [r.doc_id for r in reqs] for rank, reqs in requests.items()}, 1, replay_window_s=0.0)
    faults = {(r.rank, r.doc_id): r.fault for reqs in requests.values() for r in reqs}
    # Three parts of each rank's requests: both replicas up (one killed part-way), one dead, both up again.
    parts = [[r for reqs in requests.values() for r in reqs[count * i // 3 : count * (i + 1) // 3]] for i in range(3)]
    problems: list[str] = []
    try:
        for process in (steady, dying, proxy):
            process.start()
            await process.ready()
        sent = [0]
        first = asyncio.ensure_future(send_all(proxy.url, ledger, parts[0], sent))
        death = rng.randint(len(parts[0]) // 4, len(parts[0]) * 3 // 4)
        while sent[0] < death:  # noqa: ASYNC110 - progress counted by the requests themselves
            await asyncio.sleep(0.002)
        killed_at = dying.kill()
        await first
        await send_all(proxy.url, ledger, parts[1], sent)
        dying.start()
        await dying.ready()
        while not await replica_health(proxy, dying):  # noqa: ASYNC110 - the proxy probes it every 0.2 s
            await asyncio.sleep(0.05)
        revived_at = time.monotonic()
        await send_all(proxy.url, ledger, parts[2], sent)
        assert (await dying.stats())["requests"] > 0, "the restarted replica got no requests once healthy again"

        for answer in list(ledger.answers):
            fault = faults[(answer.rank, answer.doc_id)]
            wrong = fault.outcome(answer)
            if wrong and answer.sent_at < killed_at < answer.received_at and answer.status in (0, 200, 502):
                wrong = None  # what the replica was answering when it died: cut, or a 502 that says so
            if answer.status == 502 and error_message(answer) is None:
                wrong = "a 502 without a message"
            if wrong:
                when = " while a replica was dead" if killed_at < answer.sent_at < revived_at else ""
                problems.append(f"{answer.doc_id} ({fault.name}){when}: {answer.status} {answer.state}: {wrong}")

        # Everything again: what was stored is replayed whole, byte for byte; nothing else is replayed.
        await send_all(proxy.url, ledger, [r for reqs in requests.values() for r in reqs], [0])
        assert any(a.state == "HIT" for a in ledger.answers), "nothing was replayed"
        assert proxy.stop() == 0, f"SIGTERM did not exit 0:\n{proxy.log_tail()}"
        for cache in sorted(proxy.checkpoints.glob("*/replay.sqlite3")):
            problems += check_cache_file(cache)
    finally:
        for process in (proxy, steady, dying):
            process.close()
    assert_invariants(ledger, problems)
