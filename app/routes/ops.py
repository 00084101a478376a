"""Health, readiness and counters: `GET /healthz`, `GET /readyz`, `GET /stats`."""

from __future__ import annotations

import orjson

from app.asgi import JSON_HEADERS, Receive, Scope, Send, send_bytes, send_error
from app.errors import ServiceUnavailable
from app.services import Services


async def healthz(services: Services, scope: Scope, receive: Receive, send: Send) -> None:
    """200 as soon as the server accepts requests."""
    await send_bytes(send, 200, JSON_HEADERS, b'{"status":"ok"}')


async def readyz(services: Services, scope: Scope, receive: Receive, send: Send) -> None:
    """200 while at least one upstream answers `GET /v1/models`, else 503."""
    replicas = services.pool.replicas
    if await services.pool.probe_all():
        answer = {"status": "ready", "upstreams": {r.url: r.healthy for r in replicas}}
        await send_bytes(send, 200, JSON_HEADERS, orjson.dumps(answer))
        return
    await send_error(
        send, ServiceUnavailable("no upstream answers GET /v1/models: " + ", ".join(r.url for r in replicas))
    )


async def stats(services: Services, scope: Scope, receive: Receive, send: Send) -> None:
    """Counters since start: hits, misses, coalesced, bypassed, refreshed, errors by status."""
    answer = {
        "requests": dict(services.stats),
        "in_flight": len(services.flights),
        "upstreams": [{"url": r.url, "healthy": r.healthy, "in_flight": r.in_flight} for r in services.pool.replicas],
        "ranks": services.caches.ownership.owned(),  # released only once all of a rank is closed
    }
    await send_bytes(send, 200, JSON_HEADERS, orjson.dumps(answer))
