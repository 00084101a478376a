"""The caching proxy in-process, against the fake upstream on a loopback port (contract §3-4)."""

from __future__ import annotations

import asyncio
import socket
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

import app.http.connection
from app.service.asgi import Receive, Scope, Send
from app.service.routes.proxy import StreamBrokeOff, v1_hint
from app.service.settings import Settings
from app.service.storage_policy import error_in_disguise
from app.store.cache import StoredResponse
from app.store.hashing import payload_hash
from tests.factories import chat_request, completion_request, doc_headers
from tests.servers import fake_upstream, free_port, proxy_client, serve_in_loop, serve_proxy

# Under both servers: the app must behave the same under the built-in one and under uvicorn.
pytestmark = pytest.mark.usefixtures("http_server")


class Env:
    def __init__(self, client: httpx.AsyncClient, upstream_url: str) -> None:
        self.client = client
        self.upstream_url = upstream_url

    async def upstream_stats(self) -> dict[str, Any]:
        async with httpx.AsyncClient() as c:
            stats: dict[str, Any] = (await c.get(self.upstream_url + "/_fake/stats")).json()
            return stats

    async def chat(self, body: dict[str, Any] | None = None, **headers: str) -> httpx.Response:
        return await self.client.post("/v1/chat/completions", json=body or chat_request(), headers=headers)


def settings(tmp_path: Path, upstream: str | list[str], **overrides: Any) -> Settings:
    upstreams = [upstream] if isinstance(upstream, str) else upstream
    defaults: dict[str, Any] = {"retry_backoff_s": 0.001, "checkpoints_dir": tmp_path / "ckpt"}
    return Settings(upstream=upstreams, **{**defaults, **overrides})


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    async with fake_upstream() as (url, _), proxy_client(settings(tmp_path, url)) as client:
        yield Env(client, url)


async def test_second_identical_request_is_served_from_cache(env: Env) -> None:
    first = await env.chat(**doc_headers())
    second = await env.chat(**doc_headers())
    assert first.status_code == second.status_code == 200
    assert (first.headers["x-cache"], second.headers["x-cache"]) == ("MISS", "HIT")
    assert second.content == first.content
    assert second.headers["content-type"] == first.headers["content-type"] == "application/json"
    assert first.headers["x-payload-hash"] == second.headers["x-payload-hash"] == payload_hash(chat_request())
    assert (await env.upstream_stats())["generations"] == 1


async def test_key_order_and_whitespace_do_not_matter(env: Env) -> None:
    await env.chat(**doc_headers())
    reordered = orjson.dumps(dict(reversed(list(chat_request().items()))))
    again = await env.client.post(
        "/v1/chat/completions",
        content=b"  " + reordered + b"\n",
        headers={**doc_headers(), "content-type": "application/json"},
    )
    assert again.headers["x-cache"] == "HIT"


async def test_another_rollout_draws_a_new_sample(env: Env) -> None:
    first = await env.chat(**doc_headers(rollout_idx=0))
    other = await env.chat(**doc_headers(rollout_idx=1))
    assert other.headers["x-cache"] == "MISS"
    assert other.json()["choices"] != first.json()["choices"]


async def test_without_doc_id_requests_bypass_the_cache(env: Env) -> None:
    first = await env.chat()
    second = await env.chat()
    assert first.headers["x-cache"] == second.headers["x-cache"] == "BYPASS"
    assert first.content != second.content
    assert (await env.upstream_stats())["generations"] == 2


async def test_no_cache_refreshes_the_stored_answer(env: Env) -> None:
    await env.chat(**doc_headers())
    refreshed = await env.chat(**doc_headers(**{"Cache-Control": "no-cache"}))
    assert refreshed.headers["x-cache"] == "REFRESH"
    after = await env.chat(**doc_headers())
    assert after.headers["x-cache"] == "HIT"
    assert after.content == refreshed.content


async def test_no_store_answers_are_not_kept(env: Env) -> None:
    await env.chat(**doc_headers(**{"Cache-Control": "no-store"}))
    assert (await env.chat(**doc_headers())).headers["x-cache"] == "MISS"


async def test_a_400_from_upstream_is_cached_and_replayed_without_a_second_call(env: Env) -> None:
    too_long = chat_request(max_tokens=100_000)
    first = await env.chat(too_long, **doc_headers())
    second = await env.chat(too_long, **doc_headers())
    assert first.status_code == second.status_code == 400
    assert "maximum context length" in first.json()["error"]["message"]
    assert second.headers["x-cache"] == "HIT"
    assert second.content == first.content
    assert (await env.upstream_stats())["requests"] == 1


async def test_an_answer_is_served_to_the_route_it_was_stored_for_and_to_no_other(env: Env) -> None:
    """The key is datatrove's (doc, rollout, body): a body sent to the wrong route first got a 400 there,
    which its right route then replayed as a HIT; a body both routes take got a chat.completion on /v1/completions."""
    body = completion_request()
    wrong = await env.client.post("/v1/chat/completions", json=body, headers=doc_headers())
    assert wrong.status_code == 400  # no messages: kept, as a 400 is
    right = await env.client.post("/v1/completions", json=body, headers=doc_headers())
    assert (right.status_code, right.headers["x-cache"]) == (200, "MISS")
    again = await env.client.post("/v1/completions", json=body, headers=doc_headers())
    assert (again.headers["x-cache"], again.content) == ("HIT", right.content)
    both = chat_request(prompt="either route takes this")
    for path, kind in [("/v1/chat/completions", "chat.completion"), ("/v1/completions", "text_completion")]:
        answer = await env.client.post(path, json=both, headers=doc_headers("both"))
        assert (answer.headers["x-cache"], answer.json()["object"]) == ("MISS", kind)


async def test_identical_bodies_in_flight_to_two_routes_are_not_coalesced(tmp_path: Path) -> None:
    body = chat_request(prompt="either route takes this")
    async with fake_upstream(latency_ms=200) as (url, upstream), proxy_client(settings(tmp_path, url)) as client:
        answers = await asyncio.gather(
            *(
                client.post(path, json=body, headers=doc_headers())
                for path in ["/v1/chat/completions", "/v1/completions"]
            )
        )
        assert [a.json()["object"] for a in answers] == ["chat.completion", "text_completion"]
        assert upstream.generations == 2


@pytest.mark.parametrize("status", [500, 404, 401])
async def test_errors_outside_cache_error_statuses_are_never_stored(env: Env, status: int) -> None:
    body = chat_request(fake_upstream={"status": status})
    first = await env.chat(body, **doc_headers())
    second = await env.chat(body, **doc_headers())
    assert first.status_code == second.status_code == status
    assert second.headers["x-cache"] == "MISS"
    assert (await env.upstream_stats())["requests"] == 2


async def test_answers_are_stored_in_the_rank_file_under_the_chunk_given(tmp_path: Path) -> None:
    async with fake_upstream() as (url, _), proxy_client(settings(tmp_path, url)) as client:
        await client.post(
            "/v1/completions",
            json=completion_request(),
            headers=doc_headers("a", **{"X-Rank": "3", "X-Chunk-Index": "7"}),
        )
        await client.post("/v1/completions", json=completion_request(), headers=doc_headers("b", **{"X-Rank": "3"}))
        assert (await client.get("/stats")).json()["owned_ranks"] == [3]
    with sqlite3.connect(tmp_path / "ckpt" / "00003" / "replay.sqlite3") as conn:
        rows = conn.execute("SELECT doc_id, chunk_index FROM request_cache ORDER BY doc_id").fetchall()
    assert rows == [("a", 7), ("b", -1)]
    assert not (tmp_path / "ckpt" / "00000").exists()


async def test_bad_header_values_are_refused_naming_the_header_and_nothing_is_forwarded(env: Env) -> None:
    cases = {
        "X-Rollout-Idx": "abc",
        "X-Chunk-Index": "-1",
        "X-Rank": "100000",
        "X-Doc-Id": "",
    }
    for name, value in cases.items():
        answer = await env.chat(**{**doc_headers(), name: value})
        assert answer.status_code == 400, name
        assert answer.json()["error"]["param"] == name
        assert answer.json()["error"]["type"] == "invalid_request_error"
    assert (await env.upstream_stats())["requests"] == 0


@pytest.mark.parametrize("body", [b"not json", b"[1, 2]", b'"text"', b""])
async def test_a_body_that_is_not_a_json_object_is_refused(env: Env, body: bytes) -> None:
    answer = await env.client.post("/v1/completions", content=body, headers=doc_headers())
    assert answer.status_code == 400
    assert "must be a JSON object" in answer.json()["error"]["message"]
    assert (await env.upstream_stats())["requests"] == 0


@pytest.mark.parametrize("headers", [doc_headers(), {}])
async def test_a_body_nested_too_deep_to_key_is_refused_with_400(env: Env, headers: dict[str, str]) -> None:
    # orjson parses 1024 levels but serializes (so hashes) only 254: such a body has no cache key
    body = b'{"model": "m", "prompt": ' + b"[" * 300 + b"]" * 300 + b"}"
    answer = await env.client.post("/v1/completions", content=body, headers=headers)
    assert answer.status_code == 400
    assert "nested too deep" in answer.json()["error"]["message"]
    assert (await env.upstream_stats())["requests"] == 0


async def test_a_body_over_max_body_bytes_is_refused_with_413(tmp_path: Path) -> None:
    async with fake_upstream() as (url, upstream), proxy_client(settings(tmp_path, url, max_body_bytes=1000)) as c:
        answer = await c.post("/v1/completions", json=completion_request(prompt="x" * 2000), headers=doc_headers())
        assert answer.status_code == 413
        assert "max_body_bytes" in answer.json()["error"]["message"]
        assert upstream.requests == 0


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize(("limit", "declared"), [(None, 9_999_999_999), (1000, 2000)])
async def test_a_body_declared_over_max_body_bytes_is_refused_before_it_is_sent(
    tmp_path: Path, path: str, limit: int | None, declared: int
) -> None:
    """Offered to the fast path, it was waited for (its bytes never came) where every other route said 413."""
    limits = {"body_timeout_s": 300} | ({"max_body_bytes": limit} if limit else {})
    async with fake_upstream() as (url, _), serve_proxy(settings(tmp_path, url, **limits)) as proxy:
        host, port = proxy.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {declared}\r\n\r\n".encode())
        status = await asyncio.wait_for(reader.readline(), 60)  # the body would be waited for 300 s
        writer.close()
        assert status.startswith(b"HTTP/1.1 413 "), status


async def test_a_stream_is_replayed_byte_for_byte_as_event_stream(env: Env) -> None:
    body = completion_request(stream=True, stream_options={"include_usage": True})
    first = await env.client.post("/v1/completions", json=body, headers=doc_headers())
    second = await env.client.post("/v1/completions", json=body, headers=doc_headers())
    assert first.headers["content-type"].startswith("text/event-stream")
    assert second.headers["content-type"] == first.headers["content-type"]
    assert second.headers["x-cache"] == "HIT"
    assert second.content == first.content
    assert first.content.rstrip().endswith(b"data: [DONE]")
    assert b'"usage"' in first.content


async def test_a_stream_cut_short_by_the_upstream_is_not_stored(env: Env) -> None:
    body = completion_request(stream=True, fake_upstream={"disconnect_after_chunks": 3})
    # the client's connection is dropped mid-body (in-process, the transport re-raises why)
    with pytest.raises((httpx.HTTPError, StreamBrokeOff)):
        await env.client.post("/v1/completions", json=body, headers=doc_headers())
    second = await env.client.post("/v1/completions", json=completion_request(stream=True), headers=doc_headers())
    assert second.headers["x-cache"] == "MISS"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_a_stream_ending_in_an_error_event_is_passed_on_but_never_stored(env: Env, path: str) -> None:
    """vLLM ends a stream with `data: {"error": ...}` then `data: [DONE]` when its engine fails mid-generation."""
    request = chat_request if path.endswith("chat/completions") else completion_request
    body = request(stream=True, fake_upstream={"error_event_after_chunks": 2})
    for expected in ("MISS", "MISS"):  # the second is generated again: nothing was stored
        answer = await env.client.post(path, json=body, headers=doc_headers())
        assert answer.status_code == 200
        assert answer.headers["x-cache"] == expected
        events = [line for line in answer.text.split("\n") if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert orjson.loads(events[-2].removeprefix("data: "))["error"]["code"] == 500
    assert (await env.upstream_stats())["generations"] == 2


async def test_a_2xx_whose_body_is_an_error_envelope_is_passed_on_but_never_stored(env: Env) -> None:
    body = chat_request(fake_upstream={"error_with_status": 200})
    first, second = [await env.chat(body, **doc_headers()) for _ in range(2)]
    assert first.status_code == second.status_code == 200
    assert first.json()["error"]["type"] == "InternalServerError"
    assert (first.headers["x-cache"], second.headers["x-cache"]) == ("MISS", "MISS")


@pytest.mark.parametrize(
    ("body", "streamed", "disguised"),
    [
        (b'data: {"choices":[{"delta":{"content":"an \\"error\\": here"}}]}\n\ndata: [DONE]\n\n', True, False),
        (b'data: {"choices":[],"error":null}\n\ndata: [DONE]\n\n', True, True),
        (b'data: {"choices":[{"text":"x"}]}\n\ndata: {"error": {"code": 500}}\n\ndata: [DONE]\n\n', True, True),
        (b'{"choices":[{"message":{"content":"{\\"error\\": 1}"}}],"meta":{"error":1}}', False, False),
        (b'{"object":"error","message":"engine dead","code":500}', False, True),
        (b'{"error":{"message":"x"}}', False, True),
        (b'not json with "error" in it', False, False),
    ],
)
def test_what_is_an_error_in_disguise(body: bytes, streamed: bool, disguised: bool) -> None:
    """Only a top-level `error` (or vLLM's `"object": "error"`) is one: the word in generated text is not."""
    content_type = "text/event-stream" if streamed else "application/json"
    found = error_in_disguise(StoredResponse(200, body, content_type, streamed=streamed))
    assert (found is not None) == disguised


async def test_identical_requests_in_flight_share_one_upstream_call(tmp_path: Path) -> None:
    async with fake_upstream(latency_ms=200) as (url, upstream), proxy_client(settings(tmp_path, url)) as client:
        answers = await asyncio.gather(
            *(client.post("/v1/chat/completions", json=chat_request(), headers=doc_headers()) for _ in range(8))
        )
        assert sorted(a.headers["x-cache"] for a in answers) == ["COALESCED"] * 7 + ["MISS"]
        assert len({a.content for a in answers}) == 1
        assert upstream.generations == 1


def long_stream(streaming: asyncio.Event) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    """An upstream streaming a long generation (some 15 MB of events), then [DONE]; `streaming` set as it begins."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        streaming.set()
        event = b'data: {"choices":[{"index":0,"delta":{"content":"' + b"x" * 150 + b'"}}]}\n\n'
        for _ in range(80_000):
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    return app


async def test_a_stream_whose_client_reads_nothing_is_cut_and_its_followers_are_answered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client frozen with its connection open (SIGSTOP, a suspended job) kept its stream's leader waiting to
    write, and every identical request (the restarted job's) waiting for that leader, for ever."""
    monkeypatch.setattr(app.http.connection, "SEND_STALL_S", 2.0)  # the follower, reading, never stalls as long
    streaming = asyncio.Event()
    body = chat_request(stream=True)
    async with (
        serve_in_loop(long_stream(streaming)) as upstream,
        serve_proxy(settings(tmp_path, upstream, http="builtin")) as url,
    ):
        frozen = socket.socket()
        frozen.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        frozen.connect(("127.0.0.1", int(url.rsplit(":", 1)[1])))
        payload = orjson.dumps(body)
        frozen.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"x-doc-id: d\r\ncontent-length: %d\r\n\r\n%b" % (len(payload), payload)
        )
        try:
            await asyncio.wait_for(streaming.wait(), 30)  # the frozen client's request leads: the next follows it
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                follower = await client.post("/v1/chat/completions", json=body, headers={"X-Doc-Id": "d"})
        finally:
            frozen.close()
        assert follower.status_code == 200
        assert follower.content.endswith(b"data: [DONE]\n\n")


async def test_503_with_retry_after_is_retried_until_it_succeeds(env: Env) -> None:
    body = chat_request(fake_upstream={"status": 503, "fail_times": 2, "retry_after": 0})
    answer = await env.chat(body, **doc_headers())
    assert answer.status_code == 200
    assert (await env.upstream_stats())["requests"] == 3


async def test_a_503_that_persists_is_passed_on_after_the_last_retry(tmp_path: Path) -> None:
    async with fake_upstream() as (url, upstream), proxy_client(settings(tmp_path, url, upstream_retries=2)) as c:
        body = chat_request(fake_upstream={"status": 503, "retry_after": 0})
        answer = await c.post("/v1/chat/completions", json=body, headers=doc_headers())
        assert answer.status_code == 503
        assert answer.headers["retry-after"] == "0"
        assert upstream.requests == 3


async def test_an_unreachable_upstream_gives_502_with_the_envelope(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    async with proxy_client(settings(tmp_path, dead, upstream_retries=2)) as client:
        answer = await client.post("/v1/chat/completions", json=chat_request(), headers=doc_headers())
        assert answer.status_code == 502
        error = answer.json()["error"]
        assert error["type"] == "upstream_error"
        assert "unreachable after 3 tries" in error["message"]
        assert (await client.get("/readyz")).status_code == 503


async def test_a_failed_replica_is_skipped_for_the_healthy_one(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    # Least in flight: under affinity one prompt is keyed to one replica (tests/e2e/test_routing.py)
    async with (
        fake_upstream() as (url, upstream),
        proxy_client(settings(tmp_path, [dead, url], routing="least-inflight")) as client,
    ):
        answers = [await client.post("/v1/completions", json=completion_request()) for _ in range(6)]
        assert [a.status_code for a in answers] == [200] * 6
        assert upstream.generations == 6
        replicas = {r["url"]: r["healthy"] for r in (await client.get("/stats")).json()["upstreams"]}
        assert replicas == {dead: False, url: True}
        assert (await client.get("/readyz")).status_code == 200


async def test_other_v1_routes_are_forwarded_unchanged_and_not_cached(env: Env) -> None:
    models = await env.client.get("/v1/models", params={"x": "1"})
    assert models.status_code == 200
    assert models.json()["data"][0]["id"] == "fake-model"
    embeddings = await env.client.post(
        "/v1/embeddings", json={"model": "fake-model", "input": ["a", "b"]}, headers=doc_headers()
    )
    assert len(embeddings.json()["data"]) == 2
    assert "x-cache" not in embeddings.headers
    missing = await env.client.get("/v1/nothing-here")
    assert missing.status_code == 404
    assert missing.json()["error"]["type"] == "NotFoundError"  # the upstream's own envelope, verbatim


async def test_api_key_guards_everything_but_healthz_and_is_not_forwarded(tmp_path: Path) -> None:
    async with (
        fake_upstream() as (url, upstream),
        proxy_client(settings(tmp_path, url, upstream_api_key="upstream-secret", api_key="client-secret")) as c,
    ):
        assert (await c.get("/healthz")).status_code == 200
        for auth in (None, "Bearer wrong"):
            headers = {"Authorization": auth} if auth else {}
            refused = await c.post("/v1/completions", json=completion_request(), headers=headers)
            assert refused.status_code == 401
            assert refused.json()["error"]["type"] == "authentication_error"
            assert (await c.get("/readyz", headers=headers)).status_code == 401
        ok = await c.post(
            "/v1/completions", json=completion_request(), headers={"Authorization": "Bearer client-secret"}
        )
        assert ok.status_code == 200
        assert upstream.last_headers["authorization"] == "Bearer upstream-secret"
        assert "x-doc-id" not in upstream.last_headers


async def test_a_401_says_whether_the_key_was_missing_malformed_or_not_the_proxys(tmp_path: Path) -> None:
    """The openai client with the wrong api_key did send `Bearer <key>`: its 401 names the key, not the header."""
    async with fake_upstream() as (url, _), serve_proxy(settings(tmp_path, url, api_key="s3cret")) as proxy:
        async with openai.AsyncOpenAI(base_url=proxy + "/v1", api_key="wrong", max_retries=0) as client:
            with pytest.raises(openai.AuthenticationError) as refused:
                await client.chat.completions.create(model="fake-model", messages=[])
        assert isinstance(refused.value.body, dict)
        assert refused.value.body["message"] == (
            "the API key sent is not this proxy's: send the one it was started with (--api-key / INFERPROXY_API_KEY)"
        )
        async with httpx.AsyncClient(base_url=proxy) as c:
            missing = await c.get("/stats")
            malformed = await c.get("/stats", headers={"Authorization": "s3cret"})
            assert (await c.get("/stats", headers={"Authorization": "Bearer s3cret"})).status_code == 200
    assert missing.json()["error"]["message"] == "the Authorization header is missing: send Bearer <api key>"
    assert malformed.json()["error"]["message"] == (
        "the Authorization header is not Bearer <api key>: send Bearer <api key>"
    )


async def test_every_error_the_proxy_makes_is_the_openai_envelope(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    async with proxy_client(settings(tmp_path, dead, upstream_retries=0, max_body_bytes=50, api_key="k")) as c:
        auth = {"Authorization": "Bearer k"}
        answers = [
            await c.post("/v1/completions", json={}, headers={"Authorization": "Bearer no"}),
            await c.post("/v1/completions", json={}, headers={**auth, "X-Rank": "x"}),
            await c.post("/v1/completions", content=b"[]", headers=auth),
            await c.post("/v1/completions", json={"prompt": "x" * 100}, headers=auth),
            await c.post("/v1/completions", json={}, headers=auth),
            await c.get("/chunks/x/complete", headers=auth),
            await c.get("/readyz", headers=auth),
        ]
        assert [a.status_code for a in answers] == [401, 400, 400, 413, 502, 404, 503]
        for answer in answers:
            error = answer.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["code"] == answer.status_code
            assert error["message"]


async def test_answers_survive_a_restart_of_the_proxy(tmp_path: Path) -> None:
    async with fake_upstream() as (url, upstream):
        async with proxy_client(settings(tmp_path, url)) as client:
            first = await client.post("/v1/chat/completions", json=chat_request(), headers=doc_headers())
        async with proxy_client(settings(tmp_path, url)) as client:
            again = await client.post("/v1/chat/completions", json=chat_request(), headers=doc_headers())
        assert again.headers["x-cache"] == "HIT"
        assert again.content == first.content
        assert upstream.generations == 1
    with sqlite3.connect(tmp_path / "ckpt" / "00000" / "replay.sqlite3") as conn:
        row = conn.execute("SELECT chunk_index, status_code, content_type, streamed FROM request_cache").fetchone()
    assert row == (-1, 200, "application/json", 0)


async def test_an_upstream_silent_past_read_timeout_gives_504_without_retrying(tmp_path: Path) -> None:
    async with (
        fake_upstream(latency_ms=1000) as (url, upstream),
        proxy_client(settings(tmp_path, url, read_timeout_s=0.2)) as client,
    ):
        answer = await client.post("/v1/chat/completions", json=chat_request(), headers=doc_headers())
        assert answer.status_code == 504
        assert answer.json()["error"]["type"] == "upstream_timeout"
        assert "read_timeout_s" in answer.json()["error"]["message"]
        assert upstream.by_path["POST /v1/chat/completions"] == 1


def test_the_pool_picks_the_healthy_replica_with_fewest_requests_in_flight() -> None:
    from app.service.upstream import UpstreamPool

    pool = UpstreamPool(["http://a", "http://b", "http://c"])
    a, b, c = pool.replicas
    a.in_flight, b.in_flight, c.in_flight = 5, 1, 3
    assert pool.pick() is b
    b.healthy = False
    assert pool.pick() is c
    a.healthy = c.healthy = False
    assert pool.pick() in (a, b, c)  # none healthy: still try one
    c.in_flight = 1
    a.healthy = True
    assert pool.pick() is a


async def test_a_429_is_retried_after_its_retry_after_and_never_stored(env: Env) -> None:
    body = chat_request(fake_upstream={"status": 429, "fail_times": 1, "retry_after": 0})
    answer = await env.chat(body, **doc_headers())
    assert answer.status_code == 200
    assert (await env.upstream_stats())["requests"] == 2


async def test_expect_is_not_forwarded_and_paths_keep_their_encoding(env: Env) -> None:
    await env.chat(**doc_headers(), Expect="100-continue")
    stats = await env.upstream_stats()
    assert "expect" not in stats["last_headers"]
    missing = await env.client.get("/v1/models/org%2Fname")
    assert missing.status_code == 404
    assert "GET /v1/models/org%2Fname" in (await env.upstream_stats())["by_path"]


async def test_a_no_store_request_does_not_lead_a_flight(tmp_path: Path) -> None:
    async with fake_upstream(latency_ms=200) as (url, upstream), proxy_client(settings(tmp_path, url)) as client:
        no_store = client.post(
            "/v1/chat/completions", json=chat_request(), headers=doc_headers(**{"Cache-Control": "no-store"})
        )
        plain = client.post("/v1/chat/completions", json=chat_request(), headers=doc_headers())
        answers = await asyncio.gather(no_store, plain)
        assert [a.headers["x-cache"] for a in answers] == ["MISS", "MISS"]
        again = await client.post("/v1/chat/completions", json=chat_request(), headers=doc_headers())
        assert again.headers["x-cache"] == "HIT"
        assert again.content == answers[1].content
        assert upstream.generations == 2


async def test_an_unexpected_failure_is_still_the_envelope_with_x_cache(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    import app.service.keys

    def broken(*args: Any) -> None:
        raise RuntimeError("disk unreadable")

    monkeypatch.setattr(app.service.keys, "payload_hash", broken)
    answer = await env.chat(**doc_headers())
    assert answer.status_code == 500
    assert answer.headers["x-cache"] == "BYPASS"
    assert "RuntimeError: disk unreadable" in answer.json()["error"]["message"]


async def test_a_cached_answer_is_given_only_to_a_request_the_slow_path_would_have_answered(tmp_path: Path) -> None:
    """Hits are answered on app.http.server's fast path; anything wrong with the request still gets its error."""
    async with fake_upstream() as (url, upstream):
        config = settings(tmp_path, url, api_key="secret")
        good = {**doc_headers(), "Authorization": "Bearer secret"}
        async with proxy_client(config) as c:
            assert (await c.post("/v1/chat/completions", json=chat_request(), headers=good)).status_code == 200
            hit = await c.post("/v1/chat/completions", json=chat_request(), headers=good)
            assert hit.headers["x-cache"] == "HIT"
            for auth in ("Bearer wrong", ""):
                refused = await c.post(
                    "/v1/chat/completions", json=chat_request(), headers={**good, "Authorization": auth}
                )
                assert refused.status_code == 401
            bad = await c.post("/v1/chat/completions", json=chat_request(), headers={**good, "X-Rollout-Idx": "-1"})
            assert (bad.status_code, bad.json()["error"]["param"]) == (400, "X-Rollout-Idx")
            refreshed = await c.post(
                "/v1/chat/completions", json=chat_request(), headers={**good, "Cache-Control": "no-cache"}
            )
            assert refreshed.headers["x-cache"] == "REFRESH"
        assert upstream.generations == 2
        # A lower max_body_bytes after a restart: a body over it is refused even though its answer is stored.
        small = len(orjson.dumps(chat_request())) - 1
        async with proxy_client(config.model_copy(update={"max_body_bytes": small})) as c:
            too_big = await c.post("/v1/chat/completions", json=chat_request(), headers=good)
            assert too_big.status_code == 413
        assert upstream.generations == 2


async def test_pipelined_hits_and_misses_on_one_connection_come_back_in_order(tmp_path: Path) -> None:
    async with fake_upstream(latency_ms=30) as (url, _), serve_proxy(settings(tmp_path, url)) as proxy:
        host, port = proxy.removeprefix("http://").split(":")
        body = orjson.dumps(chat_request())

        def request(doc: str) -> bytes:
            head = (
                f"POST /v1/chat/completions HTTP/1.1\r\nHost: p\r\nX-Doc-Id: {doc}\r\nContent-Length: {len(body)}\r\n"
            )
            return head.encode() + b"\r\n" + body

        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(request("cached"))
        await reader.readuntil(b"\r\n\r\n")
        writer.write(request("new") + request("cached") + request("other"))
        answers = []
        for _ in range(3):
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.split(b"content-length: ")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            answers.append(head.split(b"x-cache: ")[1].split(b"\r\n")[0])
        writer.close()
    assert answers == [b"MISS", b"HIT", b"MISS"]


async def raw_exchange(base_url: str, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """One request written as given (httpx would resolve dot segments itself) on its own connection."""
    host, port = base_url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value for name, value in (line.split(": ", 1) for line in lines[1:] if ": " in line)}
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    writer.close()
    return int(lines[0].split()[1]), headers, body


def raw_request(method: str, path: str, body: bytes = b"", **headers: str) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: proxy", f"Content-Length: {len(body)}"]
    lines += [f"{name.replace('_', '-')}: {value}" for name, value in headers.items()]
    return "\r\n".join(lines).encode() + b"\r\n\r\n" + body


@pytest.mark.parametrize(
    "path",
    [
        "/v1/../x",
        "/v1/%2e%2e/x",
        "/v1/%2E%2E/x",
        "/v1/.%2e/x",
        "/v1/..%2Fx",
        "/v1/models%2F..%2F..%2Fx",
        "/v1/chat/../../admin",
        "/v1/..",
    ],
)
async def test_a_path_whose_dot_segments_leave_v1_is_refused_and_never_forwarded(tmp_path: Path, path: str) -> None:
    async with (
        fake_upstream() as (url, upstream),
        serve_proxy(settings(tmp_path, url, upstream_api_key="upstream-secret")) as proxy,
    ):
        for method in ("GET", "POST"):
            status, _, body = await raw_exchange(proxy, raw_request(method, path, b"{}", **doc_headers()))
            assert status == 400, (method, path)
            assert "dot segments" in orjson.loads(body)["error"]["message"]
        assert upstream.requests == 0


async def test_a_path_whose_dot_segments_stay_in_v1_is_routed_and_forwarded_resolved(tmp_path: Path) -> None:
    async with fake_upstream() as (url, upstream), serve_proxy(settings(tmp_path, url)) as proxy:
        body = orjson.dumps(chat_request())
        first = await raw_exchange(proxy, raw_request("POST", "/v1/./chat/completions", body, **doc_headers()))
        again = await raw_exchange(proxy, raw_request("POST", "/v1/x/%2e%2e/chat/completions", body, **doc_headers()))
        assert (first[0], first[1]["x-cache"], again[1]["x-cache"]) == (200, "MISS", "HIT")
        models = await raw_exchange(proxy, raw_request("GET", "/v1/chat/..%2F./models"))
        assert models[0] == 200
        assert upstream.by_path == {"POST /v1/chat/completions": 1, "GET /v1/models": 1}


@pytest.mark.parametrize("declared", ["{n} ", "{n}\t", " {n}", " {n} \t"])
async def test_a_content_length_with_whitespace_around_its_digits_is_accepted(tmp_path: Path, declared: str) -> None:
    async with serve_proxy(settings(tmp_path, "http://127.0.0.1:9")) as proxy:
        body = orjson.dumps({"id": "a", "text": "t"})
        request = raw_request("POST", "/documents", body, X_Chunk_Index="0").replace(
            f"Content-Length: {len(body)}".encode(), f"Content-Length: {declared.format(n=len(body))}".encode()
        )
        status, _, answer = await raw_exchange(proxy, request)
        assert (status, orjson.loads(answer)["written"]) == (200, 1)


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("GET", "/documents", "POST"),
        ("DELETE", "/resume", "GET, HEAD"),
        ("GET", "/lookup", "POST"),
        ("POST", "/healthz", "GET, HEAD"),
        ("GET", "/chunks/3/complete", "POST"),
    ],
)
async def test_a_method_a_route_does_not_serve_is_405_with_allow(env: Env, method: str, path: str, allow: str) -> None:
    answer = await env.client.request(method, path)
    assert answer.status_code == 405
    assert answer.headers["allow"] == allow
    assert answer.json()["error"]["code"] == 405
    assert (await env.upstream_stats())["requests"] == 0


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/stats", "/metrics", "/", "/docs", "/openapi.json"])
async def test_a_get_route_answers_head_with_its_status_and_headers_and_no_body(env: Env, path: str) -> None:
    # RFC 9110 §9.1: a server answers HEAD where it answers GET; a health checker asking so got 405.
    got = await env.client.get(path)
    head = await env.client.head(path)
    assert (head.status_code, head.content) == (got.status_code, b"")
    assert head.headers["content-type"] == got.headers["content-type"]


@pytest.mark.parametrize("path", ["/v1/models", "/v1/chat/completions", "/healthz"])
async def test_trace_is_501_whichever_server_and_never_forwarded(env: Env, path: str) -> None:
    answer = await env.client.request("TRACE", path)
    assert answer.status_code == 501
    assert answer.json()["error"]["code"] == 501
    assert answer.json()["error"]["type"] == "invalid_request_error"  # the same from either server
    assert (await env.upstream_stats())["requests"] == 0


async def test_connect_is_refused_and_never_forwarded(tmp_path: Path) -> None:
    async with fake_upstream() as (url, upstream), serve_proxy(settings(tmp_path, url)) as proxy:
        host, port = proxy.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(f"CONNECT {url.removeprefix('http://')} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        head = await reader.read(65536)
        writer.close()
        assert int(head.split()[1]) in (400, 501), head  # uvicorn cannot parse its target: 400
        assert upstream.requests == 0


async def test_paths_under_the_proxys_own_routes_are_its_404_and_a_route_with_parameters_checks_them(
    env: Env,
) -> None:
    for path in ("/chunks/x/complete", "/chunks//complete", "/chunks/1/complete/more", "/documents/", "/stats/x"):
        answer = await env.client.post(path)
        assert answer.status_code == 404, path
        assert answer.json()["error"]["type"] == "not_found_error"
        assert "docs/contract.md" in answer.json()["error"]["message"]
    assert not any(
        path.startswith(("POST /chunks", "POST /documents")) for path in (await env.upstream_stats())["by_path"]
    )


async def test_every_route_not_the_proxys_is_forwarded_unchanged(env: Env) -> None:
    """vLLM's routes outside /v1 (/tokenize, /health, /version, ...) work through the proxy as they did without it."""
    tokenized = await env.client.post("/tokenize?add_special_tokens=false", json={"prompt": "a b c"})
    health = await env.client.get("/health")
    missing = await env.client.post("/nope")
    by_path = (await env.upstream_stats())["by_path"]
    assert "POST /tokenize?add_special_tokens=false" in by_path
    assert "GET /health" in by_path
    assert "POST /nope" in by_path
    assert health.status_code == 200
    assert tokenized.status_code == 200
    assert tokenized.json()["count"] == 3
    assert missing.status_code == 404
    assert missing.json()["error"]["type"] == "NotFoundError"  # the upstream's own envelope
    assert "x-cache" not in health.headers


async def test_an_openai_route_without_v1_is_forwarded_and_its_404_says_the_routes_are_under_v1(env: Env) -> None:
    """An OpenAI client whose base_url lacks /v1: the upstream's 404, in its own envelope, saying where to go."""
    root = str(env.client.base_url).rstrip("/")
    for path in ("/chat/completions", "/completions", "/embeddings"):
        missing = await env.client.post(path, json=chat_request(), headers=doc_headers())
        assert missing.status_code == 404
        error = missing.json()["error"]
        assert error["message"] == (
            f"Not Found: POST {path}: the OpenAI routes are under /v1 (a client's base_url ends in /v1: {root}/v1)"
        )
        assert (error["type"], error["code"]) == ("NotFoundError", 404)  # the upstream's own envelope
        assert "x-cache" not in missing.headers
    by_path = (await env.upstream_stats())["by_path"]
    assert all(f"POST {path}" in by_path for path in ("/chat/completions", "/completions", "/embeddings"))
    assert (await env.client.post("/nope")).json()["error"]["message"] == "Not Found: POST /nope"  # untouched


async def test_the_openai_client_without_v1_in_its_base_url_is_told_where_the_routes_are(env: Env) -> None:
    """What a newcomer's `OpenAI(base_url="http://HOST:PORT")` meets on each API it calls, and on a base_url
    ending in /v1 twice: the 404 names the base_url to use, not only the path that was missing."""
    root = str(env.client.base_url).rstrip("/")
    under = f"the OpenAI routes are under /v1 (a client's base_url ends in /v1: {root}/v1)"
    twice = f"the base_url ends in /v1 twice (the OpenAI routes are under one: {root}/v1)"
    async with (
        openai.AsyncOpenAI(base_url=root, api_key="unused", max_retries=0) as bare,
        openai.AsyncOpenAI(base_url=root + "/v1/v1", api_key="unused", max_retries=0) as doubled,
    ):
        calls: dict[str, tuple[Callable[[], Awaitable[object]], str]] = {
            "POST /files": (lambda: bare.files.create(file=("in.jsonl", b"{}\n"), purpose="batch"), under),
            "GET /files/file-abc/content": (lambda: bare.files.content("file-abc"), under),
            "GET /batches": (lambda: bare.batches.list(), under),
            "GET /batches/batch_abc": (lambda: bare.batches.retrieve("batch_abc"), under),
            "GET /models": (lambda: bare.models.list(), under),
            "GET /models/fake-model": (lambda: bare.models.retrieve("fake-model"), under),
            "GET /v1/v1/batches": (lambda: doubled.batches.list(), twice),
            "POST /v1/v1/chat/completions": (lambda: doubled.chat.completions.create(model="m", messages=[]), twice),
        }
        for where, (call, hint) in calls.items():
            with pytest.raises(openai.NotFoundError) as missing:
                await call()
            assert isinstance(missing.value.body, dict), where
            assert missing.value.body["message"] == f"Not Found: {where}: {hint}", where
    assert (await env.client.get("/filesystem")).json()["error"]["message"] == "Not Found: GET /filesystem"


def test_a_404_without_the_openai_envelope_to_a_route_without_v1_gets_the_proxys_saying_the_same() -> None:
    """vLLM's unknown paths are FastAPI's `{"detail": "Not Found"}`: the hint comes in the proxy's envelope."""
    scope = {"method": "POST", "path": "/chat/completions", "scheme": "http", "headers": [(b"host", b"h:8080")]}
    assert orjson.loads(v1_hint(scope, b'{"detail":"Not Found"}')) == {
        "error": {
            "message": "Not Found: POST /chat/completions: the OpenAI routes are under /v1 "
            "(a client's base_url ends in /v1: http://h:8080/v1)",
            "type": "not_found_error",
            "param": None,
            "code": 404,
        }
    }


async def test_a_miss_looks_in_the_cache_once_when_nothing_was_stored_since(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Looking again right before leading (an identical request may have been answered meanwhile) costs a
    SQLite probe; when the rank's cache stored nothing since the first look, that look still holds."""
    from app.store.cache import RequestCache

    await env.chat(**doc_headers("opens-the-rank"))
    looks: list[str] = []
    real = RequestCache.get_response

    def counting(
        self: RequestCache, doc_id: str, rollout_idx: int, payload_hash: str, **kwargs: bool
    ) -> StoredResponse | None:
        looks.append(doc_id)
        return real(self, doc_id, rollout_idx, payload_hash, **kwargs)

    monkeypatch.setattr(RequestCache, "get_response", counting)
    assert (await env.chat(**doc_headers("new"))).headers["x-cache"] == "MISS"
    assert looks == ["new"]


async def test_a_request_is_parsed_and_hashed_once_whichever_path_answers_it(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the built-in server the fast path's `Lookup` reaches the ASGI path in the scope's extensions."""
    import app.service.keys

    await env.chat(**doc_headers("opens-the-rank"))
    hashed: list[object] = []
    real = app.service.keys.payload_hash

    def counting(payload: Any) -> str:
        hashed.append(payload)
        return real(payload)

    monkeypatch.setattr(app.service.keys, "payload_hash", counting)
    assert (await env.chat(**doc_headers("new"))).headers["x-cache"] == "MISS"
    assert (await env.chat(**doc_headers("new"))).headers["x-cache"] == "HIT"
    assert len(hashed) == 2


@pytest.mark.parametrize("http_server", ["builtin"], indirect=True)
async def test_a_lookup_made_before_an_identical_request_was_answered_does_not_generate_the_key_again(
    tmp_path: Path,
) -> None:
    """Built-in server only: the fast path looks a request up in the protocol callback, and the app
    runs a loop turn later. An identical request answered in between must be replayed, not generated
    again (its stored answer would be replaced by another sample)."""
    from app.http.server import HTTPServer
    from app.service.app import create_server

    async with fake_upstream() as (url, upstream):
        server = create_server(settings(tmp_path, url, port=0, http="builtin"))
        assert isinstance(server, HTTPServer)
        await server.start()
        try:
            app: Any = server.app
            headers = [(b"content-type", b"application/json"), (b"x-doc-id", b"doc-1")]
            body = orjson.dumps(chat_request())
            extensions: dict[str, Any] = {}
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as client:
                # Opens the rank: the fast path below then looks in its cache.
                await client.post("/v1/chat/completions", json=chat_request(), headers=doc_headers("doc-0"))
                assert app.answer_fast("/v1/chat/completions", headers, body, extensions) is None  # a miss, now
                first = await client.post("/v1/chat/completions", content=body, headers=doc_headers("doc-1"))
            assert first.headers["x-cache"] == "MISS"
            sent: list[dict[str, Any]] = []

            async def receive() -> dict[str, Any]:
                return {"type": "http.request", "body": body, "more_body": False}

            async def send(message: Any) -> None:
                sent.append(message)

            scope = {
                "type": "http",
                "method": "POST",
                "path": "/v1/chat/completions",
                "raw_path": b"/v1/chat/completions",
                "query_string": b"",
                "headers": headers,
                "extensions": extensions,  # the fast path's stale lookup: looked, no hit
            }
            await app(scope, receive, send)
        finally:
            await server.shutdown()
    start, answer = sent[0], sent[1]
    assert dict(start["headers"])[b"x-cache"] == b"HIT"
    assert answer["body"] == first.content
    assert upstream.requests == 2  # doc-0 and doc-1, once each


@pytest.mark.parametrize(
    ("path", "headers"),
    [
        ("/v1/chat/completions", {"X-Doc-Id": "doc-1"}),
        ("/lookup", {}),
        ("/documents", {"X-Chunk-Index": "0"}),
    ],
)
async def test_a_body_holding_too_many_json_values_is_refused_before_it_is_parsed(
    env: Env, path: str, headers: dict[str, str]
) -> None:
    bomb = b'{"model":"fake-model","a":[' + b"{}," * (1 << 20) + b"{}]}"  # 3 MB: far under max_body_bytes
    answer = await env.client.post(path, content=bomb, headers={"content-type": "application/json", **headers})
    assert answer.status_code == 413
    assert "JSON values" in answer.json()["error"]["message"]
    assert (await env.upstream_stats())["requests"] == 0


@pytest.mark.parametrize(
    ("method", "path", "twice"),
    [
        ("POST", "/v1/chat/completions", "X-Rank"),
        ("POST", "/v1/chat/completions", "X-Doc-Id"),
        ("POST", "/v1/chat/completions", "X-Rollout-Idx"),
        ("POST", "/v1/chat/completions", "X-Chunk-Index"),
        ("GET", "/resume", "X-Rank"),
        ("POST", "/lookup", "X-Rank"),
        ("POST", "/documents", "X-Chunk-Index"),
    ],
)
async def test_a_key_header_given_twice_is_refused_on_every_route(env: Env, method: str, path: str, twice: str) -> None:
    headers = [("X-Doc-Id", "doc-1"), ("X-Chunk-Index", "0"), (twice, "1"), (twice, "2")]
    headers = [(n, v) for n, v in headers if n != twice or v != "0"]
    body = orjson.dumps(chat_request() if path.startswith("/v1/") else [] if path == "/lookup" else {"id": "d"})
    answer = await env.client.request(method, path, content=body if method == "POST" else None, headers=headers)
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == twice
    assert "more than once" in answer.json()["error"]["message"]
    assert (await env.upstream_stats())["requests"] == 0


async def test_a_websocket_upgrade_is_answered_as_plain_http_by_either_server(tmp_path: Path) -> None:
    async with fake_upstream() as (url, _), serve_proxy(settings(tmp_path, url)) as proxy:
        upgrade = {"Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13"}
        status, headers, _ = await raw_exchange(proxy, raw_request("GET", "/v1/models", **upgrade))
    assert status == 200  # forwarded as a plain GET (uvicorn's websocket support used to make it a 500)
    assert headers["content-type"].startswith("application/json")


async def test_a_204_from_the_upstream_is_passed_on_and_replayed_without_content_length(env: Env) -> None:
    body = chat_request(fake_upstream={"status": 204})
    answers = [await env.chat(body, **doc_headers("no-content")) for _ in range(2)]
    assert [a.headers["x-cache"] for a in answers] == ["MISS", "HIT"]
    for answer in answers:
        assert (answer.status_code, answer.content) == (204, b"")
        assert "content-length" not in answer.headers  # RFC 9110 §8.6, under either server


async def test_a_non_streamed_answer_whose_client_left_is_still_stored_for_its_retry(env: Env) -> None:
    body = chat_request(fake_upstream={"latency_ms": 400})
    with pytest.raises(httpx.ReadTimeout):  # only reading times out: a busy machine may take long to connect
        await env.client.post(
            "/v1/chat/completions", json=body, headers=doc_headers("left"), timeout=httpx.Timeout(30, read=0.1)
        )
    await asyncio.sleep(0.6)  # the generation (400 ms) goes on for nobody, then is stored
    retry = await env.client.post("/v1/chat/completions", json=body, headers=doc_headers("left"))
    # On a busy machine the generation may still be going: the retry then shares it.
    assert (retry.status_code, retry.headers["x-cache"]) in ((200, "HIT"), (200, "COALESCED"))
    again = await env.client.post("/v1/chat/completions", json=body, headers=doc_headers("left"))
    assert (again.status_code, again.headers["x-cache"], again.content) == (200, "HIT", retry.content)
    assert (await env.upstream_stats())["requests"] == 1
