"""`create_app(settings)`: the ASGI application `inferproxy serve` runs.

Where a request goes:

- a cache hit (`POST /v1/chat/completions` or `/v1/completions`): answered by
  `InferProxy.answer_fast` inside `app.http.server`'s protocol callback, with no
  task, ASGI message or framework code at all;
- `/v1/*`: `app.routes.proxy`, on raw ASGI, before any framework code runs:
  the hot path pays for no routing, middleware or telemetry layers;
- `/documents`, `/chunks/{i}/complete`, `/resume`: `app.routes.checkpoints` (raw ASGI too);
- `/lookup`: `app.routes.lookup`, many cache lookups in one request (a restarted job's replay);
- `/healthz`, `/readyz`, `/stats`: `app.routes.ops`, through FastAPI;
- everything passes `--api-key` authentication first, except `/healthz`.

The lifespan opens the upstream pool and the per-rank registries into one
`Services` on `app.state.services`, and closes them (flushing every cache)
on shutdown. A rank is claimed (`app.ownership`) and restored from disk on
its first request, so several proxies can share one checkpoints dir.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from app import __version__
from app.asgi import ASGIApp, ClientGone, Headers, JSONResponse, Message, Receive, Scope, Send, header, send_error
from app.durable import make_dirs_durable
from app.errors import ProxyError, Unauthorized, error_body
from app.http.asgi import Answer
from app.http.server import HTTPServer
from app.layout import CheckpointsLayout
from app.output_check import redact_url
from app.ownership import RankOwnership
from app.resume import check_records_per_chunk
from app.routes import ops
from app.routes.checkpoints import CHECKPOINT_PATHS, handle_checkpoints
from app.routes.lookup import handle_lookup
from app.routes.proxy import CACHEABLE_PATHS, answer_hit, handle_v1
from app.services import CacheRegistry, CheckpointRegistry, Services
from app.settings import Settings
from app.upstream import UpstreamPool

logger = logging.getLogger(__name__)


def create_app(settings: Settings | None = None) -> InferProxy:
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            # Several proxies may share the checkpoints dir: each rank is owned by one of them,
            # claimed on its first request and released when this proxy stops (or dies).
            layout = CheckpointsLayout(str(settings.checkpoints_dir))
            check_records_per_chunk(layout, settings.records_per_chunk, record=False)
            make_dirs_durable(layout.root)
            ownership = RankOwnership(layout, port=settings.port)
            stack.callback(ownership.release_all)
            pool = UpstreamPool(
                settings.upstream,
                retries=settings.upstream_retries,
                backoff_s=settings.retry_backoff_s,
                connect_timeout_s=settings.connect_timeout_s,
                read_timeout_s=settings.read_timeout_s,
                api_key=settings.upstream_api_key,
                health_interval_s=settings.health_interval_s,
                max_response_bytes=settings.max_response_bytes,
            )
            await pool.start()
            stack.push_async_callback(pool.close)
            caches = CacheRegistry(settings.checkpoints_dir, ownership, flush_interval_ms=settings.flush_interval_ms)
            stack.push_async_callback(caches.close)
            checkpoints = CheckpointRegistry(settings, caches)
            stack.push_async_callback(checkpoints.close)
            services = Services(settings=settings, pool=pool, caches=caches, checkpoints=checkpoints)
            if settings.rank_idle_s > 0:
                janitor = asyncio.create_task(release_idle_ranks(services), name="release-idle-ranks")
                stack.push_async_callback(cancel, janitor)
            api.state.services = proxy.services = services
            stack.callback(setattr, proxy, "services", None)
            logger.info("inferproxy %s forwarding to %s", __version__, ", ".join(r.url for r in pool.replicas))
            shown = settings.model_dump(mode="json")
            for secret in ("api_key", "upstream_api_key"):
                shown[secret] = "***" if shown[secret] else None
            shown["output"] = redact_url(settings.output)
            shown["upstream"] = [r.url for r in pool.replicas]
            logger.info("settings: %s", shown)
            yield

    api = FastAPI(title="inferproxy", version=__version__, lifespan=lifespan, default_response_class=JSONResponse)
    api.include_router(ops.router)

    @api.exception_handler(ProxyError)
    async def proxy_error(request: Request, exc: ProxyError) -> JSONResponse:
        return JSONResponse(orjson.loads(exc.body()), status_code=exc.status)

    @api.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
        message = f"{exc.detail}: {request.method} {request.url.path}"
        body = error_body(message, type_=kind, code=exc.status_code)
        return JSONResponse(orjson.loads(body), status_code=exc.status_code, headers=exc.headers)

    @api.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        param = ".".join(str(part) for part in first.get("loc", ()))
        body = error_body(f"{param}: {first.get('msg')}", type_="invalid_request_error", param=param, code=400)
        return JSONResponse(orjson.loads(body), status_code=400)

    proxy = InferProxy(api, api_key=settings.api_key)
    return proxy


async def release_idle_ranks(services: Services) -> None:
    """Give up ranks no request has used for `rank_idle_s`, so that a moved job can take them elsewhere."""
    idle_s = services.settings.rank_idle_s
    while True:
        await asyncio.sleep(min(max(idle_s / 4, 0.05), 15.0))
        try:
            released = await services.checkpoints.release_idle(services.activity, idle_s)
        except Exception:  # a rank whose close failed is released all the same, with nothing of it left open
            logger.exception("releasing idle ranks failed")
            continue
        if released:
            logger.info("released ranks %s, unused for %g s: another proxy may take them over", released, idle_s)


async def cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def create_server(settings: Settings, app: InferProxy | None = None) -> HTTPServer:
    """`inferproxy serve`'s HTTP server around `create_app(settings)`, hits on its fast path."""
    app = app or create_app(settings)
    return HTTPServer(
        app,
        host=settings.host,
        port=settings.port,
        fast=app.answer_fast,
        fast_paths=CACHEABLE_PATHS,
        render_error=render_error,
        shutdown_grace_s=settings.shutdown_grace_s,
    )


def render_error(status: int, message: str) -> tuple[bytes, bytes]:
    """The HTTP server's own refusals, in the proxy's error envelope."""
    kind = "internal_error" if status >= 500 else "invalid_request_error"
    return b"application/json", error_body(message, type_=kind, code=status)


class InferProxy:
    """The outermost ASGI app: authentication, then `/v1/*` to the proxy, everything else to FastAPI."""

    def __init__(self, api: FastAPI, *, api_key: str | None) -> None:
        self.app: ASGIApp = api
        self.api = api
        self.router = api.router  # lifespan_context, for in-process tests
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.services: Services | None = None  # while the lifespan runs

    @property
    def state(self) -> Any:
        return self.api.state

    def answer_fast(self, path: str, headers: Headers, body: bytes, extensions: dict[str, Any]) -> Answer | None:
        """`app.http.server`'s fast path: a cache hit answered synchronously, or None.

        Only for an authenticated `POST` to a cacheable path (the server routes those here);
        whatever needs an error answer is left to `__call__`.
        """
        if self.expected is not None:
            given = next((value for name, value in headers if name == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected):
                return None
        services = self.services
        return answer_hit(services, headers, body, extensions) if services is not None else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        if self.expected is not None and path != "/healthz":
            given = header(scope, b"authorization") or b""
            if not hmac.compare_digest(given, self.expected):
                reason = "missing" if not given else "wrong"
                await send_error(send, Unauthorized(f"the Authorization header is {reason}: send Bearer <api key>"))
                return
        if path.startswith("/v1/") or path in CHECKPOINT_PATHS or path.startswith("/chunks/") or path == "/lookup":
            handler = (
                handle_v1 if path.startswith("/v1/") else handle_lookup if path == "/lookup" else handle_checkpoints
            )
            started = False

            async def tracking_send(message: Message) -> None:
                nonlocal started
                started = started or message["type"] == "http.response.start"
                await send(message)

            try:
                await handler(self.api.state.services, scope, receive, tracking_send)
            except ClientGone:
                logger.debug("client left before its request was read: %s", path)
            except Exception as exc:
                if started:
                    raise  # mid-answer: all that is left is to cut the connection
                logger.exception("%s %s failed", scope["method"], path)
                error = ProxyError(f"inferproxy failed on this request: {type(exc).__name__}: {exc}")
                await send_error(send, error, [(b"x-cache", b"BYPASS")] if path.startswith("/v1/") else None)
            return
        await self.app(scope, receive, send)
