"""`POST /lookup` (many cache lookups in one request) and `ProxyJob.lookup`, which batches them."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from app.job.client import ProxyJob
from app.service.asgi import lifespan_noop, send_bytes
from app.service.routes import lookup as lookup_route
from app.store.cache import StoredResponse
from app.store.hashing import payload_hash
from tests.factories import chat_request, completion_request, doc_headers, open_cache
from tests.servers import fake_upstream, proxy_client, serve_in_loop
from tests.service.test_checkpoint_routes import config

# Under both servers: the app must behave the same under the built-in one and under uvicorn.
pytestmark = pytest.mark.usefixtures("http_server")


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    async with fake_upstream() as (url, _), proxy_client(config(tmp_path, url)) as c:
        yield c


def key(doc_id: str, body: dict[str, Any], rollout_idx: int = 0) -> dict[str, Any]:
    return {"doc_id": doc_id, "rollout_idx": rollout_idx, "body": body}


async def test_lookup_answers_what_each_request_would_replay_as_a_hit(client: httpx.AsyncClient) -> None:
    chat, completion = chat_request(), completion_request()
    first = await client.post("/v1/chat/completions", json=chat, headers=doc_headers("a"))
    second = await client.post("/v1/completions", json=completion, headers=doc_headers("b", 1, **{"X-Rank": "2"}))
    too_long = chat_request(max_tokens=10**9)  # the fake upstream's 400: stored and replayed
    refused = await client.post("/v1/chat/completions", json=too_long, headers=doc_headers("c"))
    assert (first.status_code, refused.status_code) == (200, 400)

    answer = await client.post(
        "/lookup", json=[key("a", chat), key("c", too_long), key("a", chat, 1), key("z", chat), key("a", completion)]
    )
    assert answer.status_code == 200
    hit, error, *misses = answer.json()
    assert hit == {"status": 200, "content_type": "application/json", "body": first.json()}
    assert error == {"status": 400, "content_type": "application/json", "body": refused.json()}
    assert misses == [None, None, None]  # another rollout, another document, another payload
    # ranks are apart, as for the requests themselves
    assert (await client.post("/lookup", json=[key("b", completion, 1)])).json() == [None]
    ranked = await client.post("/lookup", json=[key("b", completion, 1)], headers={"X-Rank": "2"})
    assert ranked.json()[0]["body"] == second.json()
    # and the request itself agrees: a HIT with the same body
    again = await client.post("/v1/chat/completions", json=chat, headers=doc_headers("a"))
    assert (again.headers["x-cache"], again.json()) == ("HIT", first.json())
    # a lookup naming the route finds only what was stored for it, as the request to that route would
    routed = [{**key("a", chat), "path": "/v1/chat/completions"}, {**key("a", chat), "path": "/v1/completions"}]
    assert [a and a["body"] for a in (await client.post("/lookup", json=routed)).json()] == [first.json(), None]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"not json", "JSON array of lookups"),
        (b'{"doc_id": "a"}', "JSON array"),
        (b"[1]", "lookup 0 must be a JSON object"),
        (b'[{"doc_id": "", "body": {}}]', "doc_id must be a string of 1-1024 bytes"),
        (b'[{"doc_id": "a", "rollout_idx": -1, "body": {}}]', "rollout_idx must be an integer >= 0"),
        (b'[{"doc_id": "a", "rollout_idx": true, "body": {}}]', "rollout_idx must be an integer >= 0"),
        (b'[{"doc_id": "a"}]', "body must be the request's JSON object"),
        (b'[{"doc_id": "a", "body": {}, "path": "/v1/embeddings"}]', "path must be /v1/chat/completions or /v1/co"),
        (b'[{"doc_id": "a", "body": {}, "path": ["/v1/completions"]}]', "lookup 0: path must be"),
        (b'[{"doc_id": "a", "body": {}, "path": {"a": 1}}]', "lookup 0: path must be"),
        (json.dumps([{"doc_id": "a", "body": {}}] * 4097).encode(), "at most 4096 lookups"),
        (
            b'[{"doc_id": "a", "body": {}}, {"doc_id": "a", "body": {"p": ' + b"[" * 300 + b"]" * 300 + b"}}]",
            "lookup 1: the request body is nested too deep",
        ),
    ],
)
async def test_a_malformed_lookup_gets_400_saying_what_is_wrong(
    client: httpx.AsyncClient, body: bytes, message: str
) -> None:
    answer = await client.post("/lookup", content=body)
    assert answer.status_code == 400
    assert message in answer.json()["error"]["message"]


async def test_lookups_made_together_go_in_one_request(client: httpx.AsyncClient) -> None:
    bodies = [chat_request(messages=[{"role": "user", "content": f"q{i}"}]) for i in range(30)]
    for i in range(0, 30, 2):  # every second one is cached
        await client.post("/v1/chat/completions", json=bodies[i], headers=doc_headers(f"d{i}"))
    before = (await client.get("/stats")).json()["requests"]
    job = ProxyJob(str(client.base_url))
    answers = await asyncio.gather(*(job.lookup(f"d{i}", 0, body) for i, body in enumerate(bodies)))
    await job.close()
    assert [answer is not None for answer in answers] == [i % 2 == 0 for i in range(30)]
    after = (await client.get("/stats")).json()["requests"]
    assert after["hit"] - before.get("hit", 0) == 15
    assert after["lookup_miss"] - before.get("lookup_miss", 0) == 15


async def test_a_proxy_without_the_route_makes_lookup_answer_none_and_stop_asking(tmp_path: Path) -> None:
    async with fake_upstream() as (url, _):
        job = ProxyJob(url)  # the upstream has no /lookup: 404
        assert await job.lookup("a", 0, chat_request()) is None
        assert not job._lookup_route
        assert await job.lookup("a", 0, chat_request()) is None
        await job.close()


async def test_a_payload_json_cannot_hold_answers_none_for_itself_and_spoils_no_other_lookup(
    client: httpx.AsyncClient,
) -> None:
    cached = [chat_request(messages=[{"role": "user", "content": f"q{i}"}]) for i in range(3)]
    for i, body in enumerate(cached):
        await client.post("/v1/chat/completions", json=body, headers=doc_headers(f"d{i}"))
    job = ProxyJob(str(client.base_url))
    unserializable = chat_request(seed={1, 2})  # a set: orjson cannot send it, nor can the request itself
    answers = await asyncio.wait_for(
        asyncio.gather(
            *(job.lookup(f"d{i}", 0, body) for i, body in enumerate([*cached[:2], unserializable, cached[2]]))
        ),
        timeout=10,
    )
    await job.close()
    assert [answer is not None for answer in answers] == [True, True, False, False]


@pytest.mark.parametrize(
    "answer",
    [b"null", b"42", b'{"a": 1}', b"[1]", b'[{"body": {}}]', b'[{"status": 200}]', b"[[]]", b"not json"],
)
async def test_a_lookup_answer_of_the_wrong_shape_answers_none(answer: bytes) -> None:
    async def shaped(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await lifespan_noop(receive, send)
            return
        await send_bytes(send, 200, [(b"content-type", b"application/json")], answer)

    async with serve_in_loop(shaped) as url:
        job = ProxyJob(url)
        assert await asyncio.wait_for(job.lookup("a", 0, chat_request()), timeout=10) is None
        await job.close()


async def test_closing_the_job_cancels_every_lookup_still_waiting() -> None:
    release = asyncio.Event()

    async def slow(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await lifespan_noop(receive, send)
            return
        await release.wait()
        await send_bytes(send, 200, [(b"content-type", b"application/json")], b"[]")

    async with serve_in_loop(slow) as url:
        job = ProxyJob(url)
        first = asyncio.ensure_future(job.lookup("a", 0, chat_request()))
        await asyncio.sleep(0.05)  # the first batch is on its way: the next one waits
        second = asyncio.ensure_future(job.lookup("b", 0, chat_request()))
        await asyncio.sleep(0)
        await job.close()
        release.set()
        for waiter in (first, second):
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(waiter, timeout=10)


async def stored(tmp_path: Path, answers: dict[str, bytes]) -> dict[str, Any]:
    """`answers` (doc id -> 200 JSON body) stored in rank 0's cache before the proxy starts; the request of each."""
    cache = await open_cache(tmp_path / "ckpt")
    request = chat_request()
    for doc_id, body in answers.items():
        answer = StoredResponse(200, body, "application/json")
        cache.store_response(0, doc_id, 0, payload_hash(request), answer, endpoint="/v1/chat/completions")
    await cache.close()
    return request


async def test_a_stored_body_too_deep_to_pass_on_as_json_comes_as_text_and_spoils_no_other(tmp_path: Path) -> None:
    deep = b"[" * 300 + b"]" * 300  # parsed by orjson (1024 levels), not serialized again (254)
    request = await stored(tmp_path, {"deep": deep, "plain": b'{"id": "x"}'})
    async with fake_upstream() as (url, _), proxy_client(config(tmp_path, url)) as c:
        answer = await c.post("/lookup", json=[key("deep", request), key("plain", request)])
        assert answer.status_code == 200
        assert answer.json() == [
            {"status": 200, "content_type": "application/json", "text": deep.decode()},
            {"status": 200, "content_type": "application/json", "body": {"id": "x"}},
        ]


async def test_one_answer_holds_at_most_max_answer_bytes_of_stored_bodies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lookup_route, "MAX_ANSWER_BYTES", 1 << 20)
    big = orjson.dumps({"text": "y" * (100 << 10)})  # 100 KiB each: 10 fit
    request = await stored(tmp_path, {"big": big, "small": b"{}"})
    async with fake_upstream() as (url, _), proxy_client(config(tmp_path, url)) as c:
        # 4000 lookups of one big answer in a 400 KB request must not make a 400 MB answer
        answer = await c.post("/lookup", json=[key("big", request)] * 4000 + [key("small", request)])
        assert answer.status_code == 200
        answers = answer.json()
        assert len(answers) == 4001
        assert len(answer.content) < 2 << 20
        assert answers[0]["body"] == orjson.loads(big)
        assert sum(a is not None for a in answers) == 10  # null for the rest: their requests are sent, and hit
        again = await c.post("/v1/chat/completions", json=request, headers=doc_headers("small"))
        assert (again.headers["x-cache"], again.json()) == ("HIT", {})
