"""`/v1/*`: the caching proxy (contract §3-4), on raw ASGI for speed.

`POST /v1/chat/completions` and `POST /v1/completions` are looked up by
`(rank, doc_id, rollout_idx, payload_hash)`: a hit is replayed unchanged
(status, body bytes, content type); a miss is forwarded, passed back as it
arrives (SSE chunk by chunk) and stored as `app.service.storage_policy`
says; identical requests in flight share one upstream call
(`app.service.coalescing`). Every other `/v1/*` route is forwarded
unchanged and not cached.

A hit costs a header scan, a JSON parse and hash, and one SQLite point
query: no framework request/response objects, no routing tables.
`app.service.keys.lookup` does all of it, synchronously; `app.service.app.InferProxy.answer_fast` calls it inside
the server's protocol callback, before any task or ASGI message exists, and
what it cannot answer (a miss, a bad header) reaches `cacheable` with the
`Lookup` in the scope's extensions, so that it is not parsed and hashed twice.
Under a server without that fast path (uvicorn), `cacheable` calls `lookup` itself.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

import orjson

from app.http.asgi import Answer, CutConnection
from app.http.client import HTTPClientError
from app.service.affinity import request_key
from app.service.asgi import (
    Headers,
    Receive,
    Scope,
    Send,
    read_body,
    send_bytes,
    send_error,
)
from app.service.coalescing import Landing
from app.service.errors import NotFound, ProxyError
from app.service.keys import LOOKUP, Lookup, RequestKey, lookup, stored_answer
from app.service.services import Services
from app.service.storage_policy import is_whole, store_if_kept
from app.service.upstream import UpstreamResponse, response_headers
from app.store.cache import RequestCache, StoredResponse
from app.tasks import cancel_and_wait

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: The scope key under which a forwarding handler leaves the replica that answered, for the request's log line.
REPLICA = "inferproxy.replica"
#: OpenAI's routes without their `/v1`: what a client whose base_url lacks it asks for (the paths, and
#: the first segments of those with an id: `/files/ID/content`). Forwarded as any path is (an upstream
#: may serve them there), but the upstream's 404 to one says where they are (`v1_hint`), as it does to
#: a path under `/v1/v1/`, a base_url ending in /v1 twice.
V1_LESS_PATHS = frozenset({"/chat/completions", "/completions", "/embeddings", "/models", "/files", "/batches"})
V1_LESS_PREFIXES = ("/models/", "/files/", "/batches/")
_PASSED_ON = frozenset({b"retry-after"})


async def cacheable(services: Services, scope: Scope, receive: Receive, send: Send) -> None:
    """`POST /v1/chat/completions` and `/v1/completions`: the stored answer, or the upstream's (then stored)."""
    extensions = scope.get("extensions")
    found: Lookup | None = extensions.get(LOOKUP) if extensions else None
    if found is None:
        body = await read_body(scope, receive, services.settings.max_body_bytes)
        found = lookup(services.caches.opened, scope["path"], scope["headers"], body)
    key = found.key
    if key.doc_id is None:
        forwarding = forward(services, scope, receive, send, key, found.digest, found.body, b"BYPASS", cache=None)
        await kept_by_nobody(receive, found.body, forwarding)
        return
    with services.activity.using(key.rank):
        if not found.looked:
            await services.caches.get(key.rank)
            found = lookup(services.caches.opened, scope["path"], scope["headers"], found.body)
        await cached_or_forwarded(services, scope, receive, send, found)


async def cached_or_forwarded(services: Services, scope: Scope, receive: Receive, send: Send, found: Lookup) -> None:
    key, digest, body, path = found.key, found.digest, found.body, scope["path"]
    assert key.doc_id is not None
    cache = services.caches.opened(key.rank) or await services.caches.get(key.rank)
    flight_key = (key.rank, key.doc_id, key.rollout_idx, digest, path)
    if not key.no_cache:
        hit, looked_at = found.hit, found.stores if found.cache is cache else -1
        while hit is None:
            flight = services.flights.get(flight_key)
            if flight is None:
                # The lookup may be an earlier turn's (the fast path's, before this task ran, or
                # one from before a leader failed): an identical request may have been answered
                # and stored since. Look again now, with nothing awaited between this look and
                # leading, or the key is generated twice; unless nothing at all was stored since.
                if cache.stores != looked_at:
                    hit = cache.get_response(
                        key.doc_id,
                        key.rollout_idx,
                        digest,
                        datatrove_results=key.datatrove_hash is not None,
                        endpoint=path,
                    )
                break
            landed = await flight.answer()
            if landed is not None:
                await send_landed(services, send, key, digest, landed)
                return
            # the leader got no whole answer (its client left mid-stream): look again, maybe lead
        if hit is not None:
            services.metrics.replayed(key.rank, False, hit.body)
            await send_answer(send, stored_answer(hit, b"HIT", digest))
            return
    state = b"REFRESH" if key.no_cache else b"MISS"
    # A no-store request is joined by none: its followers' answer would never be stored.
    with services.flights.lead(flight_key, joinable=not key.no_cache and not key.no_store) as flight:
        forwarding = forward(services, scope, receive, send, key, digest, body, state, cache=cache)
        flight.land(await (kept_by_nobody(receive, body, forwarding) if key.no_store else forwarding))


async def send_landed(services: Services, send: Send, key: RequestKey, digest: str, landed: Landing) -> None:
    """A follower's answer: what its flight's leader got. Counted as coalesced (a generation saved) if the
    leader's answer was kept: a 429, a 5xx or an error in a 2xx shared saved nothing."""
    shared = landed.answer
    if isinstance(shared, ProxyError):
        await send_error(send, shared, [(b"x-cache", b"COALESCED"), (b"x-payload-hash", digest.encode())])
        return
    if landed.kept:
        services.metrics.replayed(key.rank, True, shared.body)
    answer = stored_answer(shared, b"COALESCED", digest)
    answer.headers.extend(landed.headers)
    await send_answer(send, answer)


async def send_answer(send: Send, answer: Answer) -> None:
    await send_bytes(send, answer.status, answer.headers, answer.body)


async def kept_by_nobody(receive: Receive, body: bytes, forwarding: Coroutine[Any, Any, T]) -> T | None:
    """A forwarding whose answer is not stored (no `X-Doc-Id`, or `no-store`), stopped when its client
    leaves, as the upstream itself would stop it; a stream stops so by itself (`stream_through`). A
    stored answer is awaited whatever the client does: for its retry, and for the followers."""
    if _streamed(body):
        return await forwarding
    return await until_client_leaves(receive, forwarding)


def _streamed(body: bytes) -> bool:
    """Whether the request may ask for a stream (`stream` set and not false, 0 or null: a value the
    upstream may take for true counts); its JSON is valid, `lookup` checked."""
    return b'"stream"' in body and orjson.loads(body).get("stream") not in (None, False)


async def forward(
    services: Services,
    scope: Scope,
    receive: Receive,
    send: Send,
    key: RequestKey,
    digest: str,
    body: bytes,
    state: bytes,
    *,
    cache: RequestCache | None,
) -> Landing | None:
    """Forward to the upstream and pass the answer back as it arrives.

    Returns, for the requests waiting on it, the whole answer when one was received (whatever its status)
    with the headers passed on beside it, or the proxy's error it was answered instead (the upstream
    unreachable, timed out, busy); None when there was neither (an answer cut short, or framed by the
    connection's close). Stores the answer as `app.service.storage_policy` says.
    """
    pool = services.pool
    ours: Headers = [(b"x-cache", state), (b"x-payload-hash", digest.encode())]
    route = request_key(key.doc_id, scope["path"], body) if pool.affine else None
    try:
        async with pool.request(
            "POST", scope["path"], headers=pool.upstream_headers(scope["headers"]), body=body, key=route
        ) as upstream:
            scope[REPLICA] = upstream.replica.url
            if key.doc_id is not None:  # generated upstream (not refused, not queued past the limit)
                counters = services.metrics.rank(key.rank)
                if key.no_cache:
                    counters.refreshed += 1
                else:
                    counters.misses += 1
            content_type = upstream.content_type
            passed_on = tuple((k, v) for k, v in response_headers(upstream.headers) if k in _PASSED_ON)
            headers: Headers = [(b"content-type", content_type.encode("latin-1")), *ours, *passed_on]
            if content_type.startswith("text/event-stream"):
                data = await stream_through(upstream, receive, send, headers, services.settings.max_response_bytes)
                if data is None:
                    return None
                answer = StoredResponse(upstream.status, data, content_type, streamed=True)
            else:
                data = await upstream.read()
                answer = StoredResponse(upstream.status, data, content_type)
                await send_bytes(send, upstream.status, headers, data)
            whole = is_whole(answer, framed_by_close=upstream.framed_by_close)
    except ProxyError as error:
        await send_error(send, error, ours)
        return Landing(error)
    kept = store_if_kept(
        cache,
        key,
        digest,
        answer,
        whole=whole,
        error_statuses=services.settings.cache_error_statuses,
        path=scope["path"],
    )
    return Landing(answer, passed_on, kept) if whole else None


async def stream_through(
    upstream: UpstreamResponse, receive: Receive, send: Send, headers: Headers, limit: int
) -> bytes | None:
    """Pass an SSE answer on chunk by chunk; return all of it, or None if the client left or the
    answer was over `limit` bytes (passed on whole all the same, but not kept to be stored).

    A client that leaves has the upstream's connection dropped at once, so that the generation stops:
    not when the upstream's next chunk comes, which may be long (a prompt still in prefill, a request
    queued behind others, an engine that runs ahead of its server and sends the rest at its end)."""
    await send({"type": "http.response.start", "status": upstream.status, "headers": headers})
    gone = asyncio.ensure_future(_disconnected(receive))
    streaming = True

    def on_gone(task: asyncio.Future[None]) -> None:
        # Runs a loop turn after the client left: by then the stream may have ended and its connection
        # gone back to the pool, another request's now.
        if streaming:
            upstream.abort()

    gone.add_done_callback(on_gone)
    pieces: list[bytes] = []
    size = 0
    try:
        async for chunk in upstream.iter_chunks():
            if gone.done():
                return None
            size += len(chunk)
            if size <= limit:
                pieces.append(chunk)
            elif pieces:
                pieces = []  # too large to store: stop holding it
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    except HTTPClientError as exc:
        if gone.done():
            return None  # the connection `on_gone` dropped
        # The upstream died mid-answer. The status line is gone already: end the
        # response without its terminating chunk so that the client sees a cut.
        logger.warning("the upstream stream broke off after %d bytes: %s", size, exc)
        raise StreamBrokeOff from exc
    finally:
        streaming = False
        gone.cancel()
    await send({"type": "http.response.body", "body": b"", "more_body": False})
    if size > limit:
        logger.warning("a streamed answer of %d bytes was passed on but not stored: over max_response_bytes", size)
        return None
    return b"".join(pieces)


class StreamBrokeOff(CutConnection):
    """The upstream's stream ended before its answer did; the client's connection is dropped (an expected
    event: a WARNING says so, no traceback)."""


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def forward_uncached(services: Services, scope: Scope, receive: Receive, send: Send) -> None:
    """Any other `/v1/*` request: forwarded unchanged (method, query, body, status, streaming).

    A client that leaves, before the answer or in the middle of it, takes the upstream call with it:
    its connection is closed, so that the upstream stops generating for nobody.
    """
    body = await read_body(scope, receive, services.settings.max_body_bytes)
    await until_client_leaves(receive, _pass_on(services, scope, send, body))


async def until_client_leaves(receive: Receive, work: Coroutine[Any, Any, T]) -> T | None:
    """`work`'s result, or None if the client leaves first: `work` is then cancelled, and an upstream
    answer it left unread (inside `pool.request`) closes its connection, so the upstream stops."""
    passing = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait((passing, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not passing.done():
            await cancel_and_wait(passing)
    return None if passing.cancelled() else passing.result()


async def _pass_on(services: Services, scope: Scope, send: Send, body: bytes) -> None:
    pool = services.pool
    # raw_path: the path as the client encoded it (%2F stays %2F, a space stays %20)
    path = scope.get("raw_path") or scope["path"].encode()
    query = scope.get("query_string") or b""
    target = path.decode("latin-1") + (f"?{query.decode('latin-1')}" if query else "")
    async with pool.request(scope["method"], target, headers=pool.upstream_headers(scope["headers"]), body=body) as up:
        scope[REPLICA] = up.replica.url
        if up.status == 404 and misplaced(scope["path"]):
            headers = [
                (k, v) for k, v in response_headers(up.headers) if k not in (b"content-type", b"content-encoding")
            ]
            await send_bytes(
                send, 404, [(b"content-type", b"application/json"), *headers], v1_hint(scope, await up.read())
            )
            return
        await send({"type": "http.response.start", "status": up.status, "headers": response_headers(up.headers)})
        size = 0
        try:
            async for chunk in up.iter_chunks():
                size += len(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except HTTPClientError as exc:
            # the path without its query, which may hold what is not for the log
            logger.warning("the upstream's answer to %s broke off after %d bytes: %s", scope["path"], size, exc)
            raise StreamBrokeOff from exc
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def misplaced(path: str) -> bool:
    """Whether `path` is an OpenAI route a client's base_url put in the wrong place: without its `/v1`
    (`V1_LESS_PATHS`), or under a second one."""
    return path in V1_LESS_PATHS or path.startswith(V1_LESS_PREFIXES) or path.startswith("/v1/v1/")


def v1_hint(scope: Scope, upstream_body: bytes) -> bytes:
    """The upstream's 404 to an OpenAI route a base_url misplaced (`misplaced`), its message saying where
    the route is: in the upstream's OpenAI error envelope when it sent one, else in the proxy's."""
    host = next((value.decode("latin-1") for name, value in scope["headers"] if name == b"host"), "HOST:PORT")
    root = f"{scope.get('scheme', 'http')}://{host}{scope.get('root_path', '')}/v1"
    where = f"{scope['method']} {scope['path']}"
    if scope["path"].startswith("/v1/v1/"):
        message = f"Not Found: {where}: the base_url ends in /v1 twice (the OpenAI routes are under one: {root})"
    else:
        message = f"Not Found: {where}: the OpenAI routes are under /v1 (a client's base_url ends in /v1: {root})"
    try:
        answer = orjson.loads(upstream_body)
    except orjson.JSONDecodeError:
        answer = None
    error = answer.get("error") if isinstance(answer, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return orjson.dumps({**answer, "error": {**error, "message": message}})
    return NotFound(message).body()
