"""Affinity routing's choice (`app.service.affinity`) and the pool's use of it, without sockets; against
real fake-upstream processes in tests/e2e/test_routing.py."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import orjson
import pytest

from app.http.client import HTTPClient, Origin
from app.http.memory import ASGIConnector
from app.service.affinity import MIN_BOUND, PROMPT_PREFIX_BYTES, choose, ranking, replica_seed, request_key
from app.service.asgi import Receive, Scope, Send, read_body, send_bytes
from app.service.upstream import UpstreamPool
from app.tools.fake_upstream import FakeUpstream

KEYS = [f"doc-{i}".encode() for i in range(2000)]
JSON = [(b"content-type", b"application/json")]


@dataclass
class Node:
    seed: int
    in_flight: int = 0


def nodes(*roots: str) -> list[Node]:
    return [Node(replica_seed(root)) for root in roots]


def test_a_key_ranks_the_replicas_the_same_whatever_their_order() -> None:
    a, b, c = nodes("http://a:8000", "http://b:8000", "http://c:8000")
    for key in KEYS[:100]:
        assert ranking(key, [a, b, c]) == ranking(key, [c, a, b])


def test_a_replica_lost_moves_only_its_own_keys_and_spreads_them_over_the_others() -> None:
    a, b, c = nodes("http://a:8000", "http://b:8000", "http://c:8000")
    before = {key: ranking(key, [a, b, c]) for key in KEYS}
    after = {key: ranking(key, [a, c])[0] for key in KEYS}
    moved = [key for key in KEYS if before[key][0] is not after[key]]
    assert all(before[key][0] is b for key in moved)
    assert len(moved) == sum(1 for key in KEYS if before[key][0] is b)
    # each of b's keys goes to its own second choice: b's share splits over a and c
    assert all(after[key] is before[key][1] for key in moved)
    shares = Counter(id(after[key]) for key in moved)
    assert min(shares.values()) > 0.35 * len(moved)


def test_keys_spread_evenly_over_the_replicas() -> None:
    replicas = nodes("http://127.0.0.1:8001", "http://127.0.0.1:8002")
    shares = Counter(id(ranking(key, replicas)[0]) for key in KEYS)
    assert all(0.45 * len(KEYS) < share < 0.55 * len(KEYS) for share in shares.values())


def test_the_first_choice_takes_requests_up_to_the_bound_then_the_next_takes_them() -> None:
    replicas = nodes("http://a:8000", "http://b:8000")
    home, other = ranking(b"hot", replicas)
    taken = []
    for _ in range(30):  # one hot document, none of its requests finished yet
        chosen, first = choose(b"hot", replicas, 0.25)
        assert first is home
        chosen.in_flight += 1
        taken.append("h" if chosen is home else "n")
    # MIN_BOUND (16) first, then capacity ceil(1.25 * (in flight + 1) / 2): 16 from the 17th to the 25th
    # request, 17 for the 26th and 27th, then 18, 19, 19
    assert "".join(taken) == "h" * MIN_BOUND + "n" * 9 + "hnhhn"
    assert (home.in_flight, other.in_flight) == (19, 11)


def test_a_document_sent_alone_keeps_its_rollouts_on_one_replica() -> None:
    # Without MIN_BOUND, the 4th of 4 rollouts sent at once, with nothing else in flight, passed the bound
    # (3 in flight, ceil(1.5 * 4 / 2) = 3) and went to the other replica: every document, split.
    replicas = nodes("http://a:8000", "http://b:8000")
    for key in KEYS[:50]:
        home = ranking(key, replicas)[0]
        for _ in range(MIN_BOUND):
            chosen, _ = choose(key, replicas, 0.5)
            assert chosen is home
            chosen.in_flight += 1
        for replica in replicas:
            replica.in_flight = 0


def test_a_wide_bound_keeps_a_hot_document_on_its_replica() -> None:
    replicas = nodes("http://a:8000", "http://b:8000")
    home, _ = ranking(b"hot", replicas)
    for _ in range(10):
        chosen, _ = choose(b"hot", replicas, 100.0)
        chosen.in_flight += 1
    assert home.in_flight == 10


def test_a_request_without_a_document_is_keyed_by_the_opening_of_its_prompt() -> None:
    system = {"role": "system", "content": "you are a careful grader " * 100}
    one = orjson.dumps({"model": "m", "messages": [system, {"role": "user", "content": "first"}], "seed": 1})
    two = orjson.dumps({"model": "other", "messages": [system, {"role": "user", "content": "second"}], "seed": 2})
    assert request_key(None, "/v1/chat/completions", one) == request_key(None, "/v1/chat/completions", two)
    assert len(request_key(None, "/v1/chat/completions", one)) == PROMPT_PREFIX_BYTES
    assert request_key(None, "/v1/chat/completions", one).startswith(b'"messages"')
    prompt = orjson.dumps({"prompt": "abc", "model": "m"})
    assert request_key(None, "/v1/completions", prompt) == b'"prompt":"abc","model":"m"}'
    assert request_key("doc-7", "/v1/completions", prompt) == b"doc-7"
    assert request_key(None, "/v1/completions", b'{"x": 1}') == b'{"x": 1}'


def test_the_pool_routes_by_key_and_counts_a_spill_over_on_the_first_choice() -> None:
    pool = UpstreamPool(["http://a:8000", "http://b:8000"], load_bound=0.25)
    home, other = ranking(b"doc", pool.replicas)
    assert pool.pick(b"doc") is home
    home.in_flight = MIN_BOUND  # capacity max(ceil(1.25 * 17 / 2), MIN_BOUND) = 16: home is full
    assert pool.pick(b"doc") is other
    assert (home.spilled, other.spilled) == (1, 0)
    home.healthy = False  # out: its keys go to their next replica, not counted as spilled
    home.in_flight = 0
    assert pool.pick(b"doc") is other
    assert home.spilled == 1


def test_the_bounds_floor_is_no_more_than_a_replicas_share_of_the_slots() -> None:
    # At 4 slots a replica, a floor of 16 was never reached: one replica holding its 4 (hung, say) was under
    # the bound for good, and every request queued for it.
    pool = UpstreamPool(["http://a:8000", "http://b:8000"], max_inflight=4)
    assert pool.min_bound == 4
    home, other = ranking(b"doc", pool.replicas)
    home.in_flight = 4  # capacity max(ceil(1.5 * 5 / 2), 4) = 4: full
    assert pool.pick(b"doc") is other
    assert UpstreamPool(["http://a:8000", "http://b:8000"]).min_bound == MIN_BOUND  # no limit: the floor


def test_a_retry_passes_over_the_replicas_that_failed_the_request_while_another_is_healthy() -> None:
    pool = UpstreamPool(["http://a:8000", "http://b:8000"])
    home, other = ranking(b"doc", pool.replicas)
    assert pool.pick(b"doc", avoid={home.url}) is other
    assert pool.pick(b"doc", avoid={home.url, other.url}) is home  # all failed it: its own again
    other.healthy = False
    assert pool.pick(b"doc", avoid={home.url}) is home  # the only healthy one


def test_least_inflight_routing_ignores_the_key() -> None:
    pool = UpstreamPool(["http://a:8000", "http://b:8000"], routing="least-inflight")
    home, other = ranking(b"doc", pool.replicas)
    home.in_flight = 1
    assert not pool.affine
    assert pool.pick(b"doc") is other


def test_one_replica_is_not_keyed_at_all() -> None:
    assert not UpstreamPool(["http://a:8000"]).affine


def test_an_unknown_routing_is_refused() -> None:
    with pytest.raises(ValueError, match="routing is one of affinity, least-inflight, got 'random'"):
        UpstreamPool(["http://a:8000"], routing="random")


def test_replicas_with_credentials_rank_as_the_same_server_without_them() -> None:
    plain = UpstreamPool(["http://a:8000"]).replicas[0]
    secret = UpstreamPool(["http://user:pw@a:8000"]).replicas[0]
    assert plain.seed == secret.seed


class Unavailable:
    """An upstream that answers every request 503, as a vLLM that is not serving does; healthy to its probe."""

    def __init__(self) -> None:
        self.requests = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        await read_body(scope, receive, 1 << 20)
        if scope["path"] == "/v1/models":
            await send_bytes(send, 200, JSON, b'{"data": []}')
            return
        self.requests += 1
        await send_bytes(send, 503, [*JSON, (b"retry-after", b"60")], b'{"error": "not serving"}')


def in_memory(**apps: Any) -> HTTPClient:
    """A client whose connections to `http://NAME:8000` are served by `apps[NAME]`, in memory."""
    connectors = {host: ASGIConnector(app) for host, app in apps.items()}

    async def connect(origin: Origin, protocol: asyncio.Protocol) -> asyncio.BaseTransport:
        return await connectors[origin.host](origin, protocol)

    return HTTPClient(connector=connect, read_timeout=5)


async def test_a_replica_answering_503_is_out_and_its_request_goes_at_once_to_the_keys_next_replica() -> None:
    home_root, other_root = (r.base for r in ranking(b"doc", UpstreamPool(["http://a:8000", "http://b:8000"]).replicas))
    unavailable, fake = Unavailable(), FakeUpstream()
    client = in_memory(**{urlsplit(home_root).hostname or "": unavailable, urlsplit(other_root).hostname or "": fake})
    # A backoff and a Retry-After that would time the test out: a retry on another replica waits for neither
    pool = UpstreamPool(["http://a:8000", "http://b:8000"], backoff_s=60, client=client)
    home, other = ranking(b"doc", pool.replicas)
    body = orjson.dumps({"prompt": "x"})
    async with (
        asyncio.timeout(10),
        pool.request("POST", "/v1/completions", headers=JSON, body=body, key=b"doc") as answer,
    ):
        assert answer.status == 200
        await answer.read()
    assert (home.healthy, other.healthy) == (False, True)
    assert (home.requests, home.errors, other.requests, home.spilled) == (1, 1, 1, 0)
    assert (unavailable.requests, fake.generations) == (1, 1)
    assert pool.pick(b"doc") is other  # out until its probe passes
    assert await pool.probe(home)
    assert pool.pick(b"doc") is home  # back: its document with it
    await pool.close()


async def test_a_lone_replica_answering_503_stays_healthy() -> None:
    fake = FakeUpstream()
    pool = UpstreamPool(["http://a:8000"], backoff_s=0.001, client=in_memory(a=fake))
    body = orjson.dumps({"prompt": "x", "fake_upstream": {"status": 503, "fail_times": 1, "retry_after": 0}})
    async with pool.request("POST", "/v1/completions", headers=JSON, body=body) as answer:
        assert answer.status == 200
        await answer.read()
    assert pool.replicas[0].healthy
    assert fake.requests == 2
    await pool.close()
