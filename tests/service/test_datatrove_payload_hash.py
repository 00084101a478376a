"""`X-Datatrove-Payload-Hash` (contract §3-4): a request keyed by datatrove's payload hash instead of its
body's, its answer stored as datatrove's own runner stores one, so that the two runners share one cache file;
checked against datatrove's `RequestCache` from PyPI on the same checkpoints dir."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from datatrove.pipeline.inference.checkpointing import RequestCache as DatatroveRequestCache

from app.service.settings import Settings
from app.store.hashing import payload_hash
from app.tools.fake_upstream import FakeUpstream
from tests.canned import canned_server
from tests.factories import chat_request, completion_request, doc_headers
from tests.servers import fake_upstream, proxy_client

pytestmark = pytest.mark.usefixtures("http_server")

#: What a datatrove rollout asks for; the body sent is it with `model` and the default params merged in.
ROLLOUT_PAYLOAD = {"messages": [{"role": "user", "content": "hello"}]}
DATATROVE_HASH = payload_hash(ROLLOUT_PAYLOAD)


@dataclass
class Env:
    client: httpx.AsyncClient
    upstream: FakeUpstream
    checkpoints: Path

    async def post(self, body: dict[str, Any], path: str = "/v1/chat/completions", **headers: str) -> httpx.Response:
        return await self.client.post(path, json=body, headers=doc_headers(**headers))


@contextlib.asynccontextmanager
async def running(checkpoints: Path) -> AsyncIterator[Env]:
    """A proxy on `checkpoints` in front of a fake upstream; stopped (its cache flushed) on leaving."""
    async with (
        fake_upstream() as (url, upstream),
        proxy_client(Settings(upstream=[url], checkpoints_dir=checkpoints)) as client,
    ):
        yield Env(client, upstream, checkpoints)


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    async with running(tmp_path / "ckpt") as env:
        yield env


async def datatroves_lookup(checkpoints: Path, doc_id: str, digest: str) -> tuple[Any, Any]:
    """What datatrove's own runner finds in the rank's cache file for rollout 0 of `doc_id`."""
    cache = DatatroveRequestCache(str(checkpoints))
    await cache.initialize(0)
    try:
        found: tuple[Any, Any] = await cache.get_cached_response(doc_id, 0, payload_hash=digest)
    finally:
        await cache.close()
    return found


@pytest.mark.parametrize(
    ("path", "body"), [("/v1/chat/completions", chat_request()), ("/v1/completions", completion_request())]
)
async def test_an_answer_keyed_by_datatroves_hash_is_stored_as_datatroves_runner_stores_it_and_replayed_so(
    tmp_path: Path, path: str, body: dict[str, Any]
) -> None:
    checkpoints = tmp_path / "ckpt"
    async with running(checkpoints) as env:
        first = await env.post(body, path, **{"X-Datatrove-Payload-Hash": DATATROVE_HASH})
        again = await env.post(body, path, **{"X-Datatrove-Payload-Hash": DATATROVE_HASH})
        assert (first.headers["x-cache"], again.headers["x-cache"]) == ("MISS", "HIT")
        assert first.headers["x-payload-hash"] == again.headers["x-payload-hash"] == DATATROVE_HASH
        answer = first.json()
        choice = answer["choices"][0]
        text = choice["message"]["content"] if path == "/v1/chat/completions" else choice["text"]
        result = {"text": text, "finish_reason": choice["finish_reason"], "usage": answer["usage"], "reasoning": ""}
        assert again.json() == result
        assert env.upstream.generations == 1
        # the body's own key is not this one: no behaviour change for a client without the header
        assert (await env.post(body, path)).headers["x-cache"] == "MISS"
        assert env.upstream.generations == 2
    assert await datatroves_lookup(checkpoints, "doc-1", DATATROVE_HASH) == (result, None)


async def test_an_answer_datatroves_runner_cached_is_found_by_its_hash_on_the_route_and_by_lookup(
    tmp_path: Path,
) -> None:
    checkpoints = tmp_path / "ckpt"
    stored = {"text": "from datatrove", "finish_reason": "stop", "usage": {"total_tokens": 3}, "reasoning": ""}
    cache = DatatroveRequestCache(str(checkpoints))
    await cache.initialize(0)
    await cache.store_result(1, "doc-1", 0, stored, payload_hash=DATATROVE_HASH)
    await cache.close()
    async with running(checkpoints) as env:
        item = {"doc_id": "doc-1", "body": chat_request(), "datatrove_payload_hash": DATATROVE_HASH}
        looked_up = await env.client.post("/lookup", json=[item, {**item, "doc_id": "doc-2"}])
        assert looked_up.json() == [{"status": 200, "content_type": "application/json", "body": stored}, None]
        hit = await env.post(chat_request(), **{"X-Datatrove-Payload-Hash": DATATROVE_HASH})
        assert (hit.headers["x-cache"], hit.json()) == ("HIT", stored)
        assert env.upstream.generations == 0


async def test_a_400_keyed_by_datatroves_hash_is_replayed_and_read_by_datatroves_runner_as_a_bad_request(
    tmp_path: Path,
) -> None:
    checkpoints = tmp_path / "ckpt"
    too_long = chat_request(max_tokens=10**9)
    async with running(checkpoints) as env:
        first = await env.post(too_long, **{"X-Datatrove-Payload-Hash": DATATROVE_HASH})
        again = await env.post(too_long, **{"X-Datatrove-Payload-Hash": DATATROVE_HASH})
        assert (first.status_code, again.status_code, again.headers["x-cache"]) == (400, 400, "HIT")
        assert again.content == first.content
        assert env.upstream.requests == 1
    _, error = await datatroves_lookup(checkpoints, "doc-1", DATATROVE_HASH)
    # datatrove's runner raises a cached error that says BadRequestError as its InferenceError, as it would have
    assert "BadRequestError" in error
    assert "maximum context length" in error


@pytest.mark.parametrize(
    "value",
    [
        "abc",
        DATATROVE_HASH.upper(),  # datatrove's hex digest is lowercase: another key
        DATATROVE_HASH + "0",
        "g" * 32,
        "",
    ],
)
async def test_a_bad_datatrove_payload_hash_is_a_400_naming_the_header_and_nothing_is_forwarded(
    env: Env, value: str
) -> None:
    answer = await env.post(chat_request(), **{"X-Datatrove-Payload-Hash": value})
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "X-Datatrove-Payload-Hash"
    assert "\n" not in error["message"]
    assert "must be 32 lowercase hex digits" in error["message"]
    item = {"doc_id": "doc-1", "body": chat_request(), "datatrove_payload_hash": value}
    looked_up = await env.client.post("/lookup", json=[item])
    assert looked_up.status_code == 400
    assert "lookup 0: datatrove_payload_hash must be 32 lowercase hex digits" in looked_up.json()["error"]["message"]
    assert env.upstream.requests == 0


async def test_the_header_given_twice_is_refused(env: Env) -> None:
    answer = await env.client.post(
        "/v1/chat/completions",
        json=chat_request(),
        headers=[
            ("X-Doc-Id", "doc-1"),
            ("X-Datatrove-Payload-Hash", DATATROVE_HASH),
            ("X-Datatrove-Payload-Hash", "0" * 32),
        ],
    )
    assert (answer.status_code, answer.json()["error"]["param"]) == (400, "X-Datatrove-Payload-Hash")
    assert env.upstream.requests == 0


def _completion_with(usage: bytes) -> bytes:
    body = b'{"choices":[{"index":0,"message":{"role":"assistant","content":"x"},"finish_reason":"stop"}],"usage":'
    body += usage + b"}"
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body


async def test_a_completion_nested_deeper_than_datatroves_form_can_hold_is_passed_on_not_stored_without_a_traceback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # orjson reads 1024 levels but writes only 254: datatrove's form of this answer cannot be written, as
    # datatrove's own runner could not store it either. It was a TypeError after the answer was sent, a
    # traceback in the log for each such request.
    deep = b"[" * 300 + b"]" * 300
    async with (
        canned_server([_completion_with(deep)] * 2) as upstream,
        proxy_client(Settings(upstream=[upstream.url], checkpoints_dir=tmp_path / "ckpt", upstream_retries=0)) as c,
    ):
        headers = doc_headers(**{"X-Datatrove-Payload-Hash": DATATROVE_HASH})
        first = await c.post("/v1/chat/completions", json=chat_request(), headers=headers)
        again = await c.post("/v1/chat/completions", json=chat_request(), headers=headers)
    assert (first.status_code, first.headers["x-cache"]) == (200, "MISS")
    assert first.json()["choices"][0]["message"]["content"] == "x"
    assert (again.status_code, again.headers["x-cache"]) == (200, "MISS")  # not stored: generated again
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


async def test_a_client_without_the_header_never_gets_a_result_in_datatroves_form(env: Env) -> None:
    # The rollout payload was the body already (it names the model, no default params): datatrove's key is
    # the body's, and the row the header stored is datatrove's result, which no OpenAI client can read.
    body = chat_request()
    same = payload_hash(body)
    first = await env.post(body, **{"X-Datatrove-Payload-Hash": same})
    assert first.headers["x-cache"] == "MISS"
    item = {"doc_id": "doc-1", "body": body}
    looked_up = await env.client.post("/lookup", json=[item, {**item, "datatrove_payload_hash": same}])
    assert looked_up.json()[0] is None  # what the request without the header would get: no hit
    assert looked_up.json()[1]["body"]["text"] == first.json()["choices"][0]["message"]["content"]
    generations = env.upstream.generations
    plain = await env.post(body)  # an OpenAI client on the same doc id, without the header
    assert plain.headers["x-cache"] == "MISS"
    assert plain.json()["object"] == "chat.completion"
    assert env.upstream.generations == generations + 1
    assert (await env.post(body)).headers["x-cache"] == "HIT"  # its own answer, stored as it came


async def test_a_streamed_request_under_the_header_is_refused_in_one_line(env: Env) -> None:
    headers = {"X-Datatrove-Payload-Hash": DATATROVE_HASH}
    assert (await env.post(chat_request(), **headers)).headers["x-cache"] == "MISS"
    generations = env.upstream.generations
    streamed = await env.post(chat_request(stream=True), **headers)
    assert streamed.status_code == 400
    error = streamed.json()["error"]
    assert error["param"] == "X-Datatrove-Payload-Hash"
    assert "without `stream`, or without the header" in error["message"]
    assert env.upstream.generations == generations
