"""`create_app(settings)`: the application `inferproxy serve` runs, a FastAPI app with every route in one
table (`app.service.api`).

Where a request goes: `InferProxy.dispatch` finds its route in an index of that table
(`app.service.routing`: one dict lookup for an exact path), checks `--api-key`, and calls the raw
route's handler (the proxied `/v1/*`, everything forwarded) or hands the request to FastAPI (the
control plane, its models and `/docs`). A path with dot segments is routed by its resolved form, and
refused if that leaves `/v1/`. A path no route has gets 404, a method its route does not serve 405
(with `Allow`); `TRACE` and `CONNECT` are never served (501, as the built-in server answers them
itself). Every request is counted and logged, however it ends.

A cache hit on the built-in server (`app.http`) is answered before that, by
`InferProxy.answer_fast` inside the server's protocol callback, with no task or
ASGI message at all; it runs the same `authenticate` and `lookup` as the ASGI
path and leaves its `Lookup` in the scope's extensions for it when it cannot
answer. Under uvicorn (`--http uvicorn`) everything goes the ASGI way.

The lifespan opens the upstream pool and the per-rank registries into one
`Services` (`InferProxy.services`), and closes them (flushing every cache) on
shutdown. A rank is claimed (`app.store.ownership`) and restored from disk on its
first request, so several proxies can share one checkpoints dir.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import AsyncExitStack
from typing import Any, Protocol

from fastapi import FastAPI

from app import __version__
from app.checkpoints.output import redact_url
from app.checkpoints.resume import check_records_per_chunk
from app.http.asgi import Answer
from app.http.server import HTTPServer
from app.ops.logs import RequestLog
from app.ops.memory import release_free_memory
from app.ops.metrics import SAMPLE_EVERY_S, Metrics
from app.service import api
from app.service.asgi import ClientGone, Headers, Message, Receive, Scope, Send, send_error
from app.service.batches.engine import BatchEngine
from app.service.errors import (
    BadRequest,
    MethodNotAllowed,
    MethodNotSupported,
    NotFound,
    ProxyError,
    Unauthorized,
    error_body,
    failure,
)
from app.service.keys import CACHEABLE_PATHS, LOOKUP, Lookup, lookup, stored_answer
from app.service.limits import default_max_connections, max_connections
from app.service.routes.files import remove_expired
from app.service.routes.proxy import REPLICA
from app.service.routing import NEVER_SERVED, Entry, Handler, Index, resolve_dot_segments
from app.service.services import CheckpointRegistry, RankActivity, Services
from app.service.settings import Settings
from app.service.upstream import UpstreamPool
from app.store.durable import make_dirs_durable
from app.store.files import FileStore
from app.store.layout import CheckpointsLayout
from app.store.ownership import RankOwnership
from app.tasks import cancel_and_wait

logger = logging.getLogger(__name__)

DESCRIPTION = """The control plane of inferproxy: the checkpoint routes, cache lookups and what the proxy
counts (docs/contract.md has the whole contract). `POST /v1/chat/completions` and `/v1/completions`
are OpenAI's, cached by `X-Doc-Id`, `X-Rollout-Idx` and `X-Rank`; every other path is forwarded to the
upstream unchanged. With `--api-key`, every route but `/`, `/healthz` and these docs needs
`Authorization: Bearer KEY`."""

#: How often the files that expired are looked for, to remove their bytes (a request for one removes them at once).
EXPIRED_FILES_EVERY_S = 300.0
#: Scope keys: the route that served the request, and the replica that answered it (set by the handler).
ROUTE = "inferproxy.route"
#: The status counted and logged for a request whose client left before an answer was started (nginx's).
CLIENT_LEFT = 499


#: The proxy's own `X-Cache` values; a forwarded answer may carry another's (a cache upstream), not counted.
OUTCOMES = {value.encode(): value for value in ("HIT", "MISS", "COALESCED", "BYPASS", "REFRESH")}


def cache_outcome(headers: Iterable[tuple[bytes, bytes]]) -> str:
    """The answer's `X-Cache` value (HIT, MISS, ...), "" for a route that does not cache."""
    for name, value in headers:
        if name == b"x-cache":
            return OUTCOMES.get(value, "")
    return ""


def own_segment(path: str) -> str:
    """What of `path` names the part of the URL space a route is in: its first segment, two under `/v1/`."""
    parts = path.split("/", 3)
    return "/".join(parts[1:3]) if parts[1] == "v1" else parts[1]


def create_app(settings: Settings | None = None, *, clock: Callable[[], float] = time.time) -> InferProxy:
    """`clock`: the time the files' expiry is told by (tests move it)."""
    return InferProxy(settings or Settings(), clock=clock)


class InferProxy(FastAPI):
    """The app: lifespan, authentication, then the route table."""

    def __init__(self, settings: Settings, *, clock: Callable[[], float] = time.time) -> None:
        super().__init__(
            title="inferproxy",
            version=__version__,
            summary="A caching and checkpointing proxy for batch LLM inference",
            description=DESCRIPTION,
            openapi_url=api.OPENAPI_URL,
            docs_url=None,  # `app.service.api`'s, with its files served here
            redoc_url=None,
        )
        open_paths = api.routes(self)
        self.index = Index(self.routes, self.through_fastapi, open_paths)
        # The first path segments of the proxy's own routes (two under /v1/: `v1/files`): a path under one of
        # them that no route has is the proxy's 404 (a mistyped `/chunks/x/complete`), not the upstream's.
        raw = {route.path for route in api.RAW_ROUTES}
        self.own_segments = frozenset(own_segment(e.path) for e in self.index.entries if e.path not in raw)
        self.settings = settings
        self.clock = clock
        self.expected = f"Bearer {settings.api_key}".encode() if settings.api_key else None
        self.services: Services | None = None  # while the lifespan runs
        self.request_log = RequestLog(settings.log_hits_every)
        self.startup_error: BaseException | None = None  # why the last startup failed, for the server to raise

    def shutting_down(self) -> None:
        """The server begins to stop (SIGTERM): the batches send no new line from now, while the requests in
        flight are answered; their own lines in flight are answered and kept meanwhile."""
        if self.services is not None and self.services.batches is not None:
            self.services.batches.stop_sending()

    def openapi(self) -> dict[str, Any]:
        """FastAPI's schema, with the models of the bodies the routes read themselves (`api.described`)."""
        if self.openapi_schema is None:
            schemas = super().openapi().setdefault("components", {}).setdefault("schemas", {})
            for model in api.REQUEST_MODELS:
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
        return super().openapi()

    # -- the one authentication check ----------------------------------------------

    def authenticate(self, headers: Headers) -> Unauthorized | None:
        """None if the request may pass (`--api-key` unset, or `Authorization: Bearer KEY` given), else why not."""
        if self.expected is None:
            return None
        given = next((value for name, value in headers if name == b"authorization"), b"")
        if hmac.compare_digest(given, self.expected):
            return None
        if not given:
            return Unauthorized("the Authorization header is missing: send Bearer <api key>")
        if given[:7].lower() != b"bearer ":
            return Unauthorized("the Authorization header is not Bearer <api key>: send Bearer <api key>")
        return Unauthorized(
            "the API key sent is not this proxy's: send the one it was started with (--api-key / INFERPROXY_API_KEY)"
        )

    # -- the fast path ------------------------------------------------------------

    def answer_fast(self, path: str, headers: Headers, body: bytes, extensions: dict[str, Any]) -> Answer | None:
        """`app.http.server`'s fast path: a cache hit answered synchronously, or None.

        Only for a whole `POST` to a cacheable path (the server routes those here). What needs an
        error answer is left to the ASGI path; what it looked up is left in `extensions` for it.
        """
        services = self.services
        if services is None or len(body) > services.settings.max_body_bytes:
            return None
        if self.expected is not None and self.authenticate(headers) is not None:
            return None
        started = time.perf_counter() if self.request_log.hit_due() else 0.0
        try:
            found = lookup(services.caches.opened, path, headers, body)
        except ProxyError:  # a bad header or body: the ASGI path answers with its error
            return None
        extensions[LOOKUP] = found
        hit = found.hit
        if hit is None:
            return None
        rank = found.key.rank
        services.activity.touch(rank)
        services.metrics.hit(rank, path, hit.status, hit.body)
        if self.request_log.hit():
            self.request_log.write("POST", path, hit.status, "HIT", headers, None, time.perf_counter() - started)
        return stored_answer(hit, b"HIT", found.digest)

    # -- ASGI ---------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self.dispatch(scope, receive, send)
        elif scope["type"] == "lifespan":
            await self.run_lifespan(receive, send)

    async def through_fastapi(self, services: Services, scope: Scope, receive: Receive, send: Send) -> None:
        """The handler of the table's FastAPI routes: the request as FastAPI serves it."""
        await super().__call__(scope, receive, send)

    async def dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Route the request; count it, and write its line, however it ends."""
        services = self.services
        assert services is not None, "a request before the lifespan's startup"
        started = time.perf_counter()
        status, outcome = CLIENT_LEFT, ""

        async def tracking_send(message: Message) -> None:
            nonlocal status, outcome
            if message["type"] == "http.response.start":
                status = message["status"]
                if scope.get(ROUTE) in CACHEABLE_PATHS:  # a forwarded answer's X-Cache is another cache's
                    outcome = cache_outcome(message.get("headers") or ())
            await send(message)

        try:
            found = await self.find_route(services, scope, tracking_send)
            if found is not None:
                entry, handler = found
                try:
                    await handler(services, scope, receive, tracking_send)
                except ClientGone:
                    logger.debug("client left before its request was read: %s", scope["path"])
                except Exception as exc:
                    if status != CLIENT_LEFT:
                        raise  # mid-answer: all that is left is to cut the connection
                    error = failure(exc, f"{scope['method']} {scope['path']}")
                    await send_error(tracking_send, error, entry.error_headers)
        finally:
            services.metrics.request(scope.get(ROUTE, "-"), outcome, status)
            log = self.request_log
            if (outcome != "HIT" or log.hit()) and log.enabled():
                seconds = time.perf_counter() - started
                replica = scope.get(REPLICA)
                log.write(scope["method"], scope["path"], status, outcome, scope["headers"], replica, seconds)

    async def find_route(self, services: Services, scope: Scope, send: Send) -> tuple[Entry, Handler] | None:
        """The request's route and handler, or None once a refusal is sent (404, 405, 401, ...)."""
        if "/." in scope["path"]:
            try:
                resolve_dot_segments(scope)
            except BadRequest as error:
                await send_error(send, error)
                return None
        path: str = scope["path"]
        method: str = scope["method"]
        if method in NEVER_SERVED:  # under uvicorn; the built-in server refuses them itself
            await send_error(send, MethodNotSupported(f"{method} is not supported by this server"))
            return None
        found = self.index.find(path)
        route = found[0] if found is not None else None
        if route is not None and route.path == api.FORWARDED and own_segment(path) in self.own_segments:
            route = None  # under one of the proxy's own routes: not the upstream's to answer
        if route is None or route.auth:
            extensions = scope.get("extensions")
            fast: Lookup | None = extensions.get(LOOKUP) if extensions else None
            refusal = self.authenticate(scope["headers"]) if fast is None else None  # the fast path checked it
            if refusal is not None:
                await send_error(send, refusal)
                return None
        if route is None:
            await send_error(send, NotFound(f"no route {method} {path}: see docs/contract.md for the routes served"))
            return None
        handler = route.handler(method)
        if handler is None:
            allow = route.allow()
            not_allowed = MethodNotAllowed(f"{method} {path} is not served: only {allow.decode() or 'nothing'}")
            await send_error(send, not_allowed, [(b"allow", allow)])
            return None
        scope[ROUTE] = route.label
        if found is not None and found[1] is not None:
            scope["path_params"] = found[1]
        return route, handler

    async def run_lifespan(self, receive: Receive, send: Send) -> None:
        """The ASGI lifespan protocol around `lifespan()`."""
        await receive()  # lifespan.startup
        started = False
        try:
            async with self.lifespan():
                started = True
                await send({"type": "lifespan.startup.complete"})
                await receive()  # lifespan.shutdown
        except BaseException as exc:
            if started:
                await send({"type": "lifespan.shutdown.failed", "message": f"{type(exc).__name__}: {exc}"})
            else:
                self.startup_error = exc
                await send({"type": "lifespan.startup.failed", "message": f"{type(exc).__name__}: {exc}"})
            raise
        await send({"type": "lifespan.shutdown.complete"})

    @contextlib.asynccontextmanager
    async def lifespan(self) -> AsyncIterator[Services]:
        """Open every resource into `self.services`; close them all (flushing every cache) at the end."""
        settings = self.settings
        async with AsyncExitStack() as stack:
            # Several proxies may share the checkpoints dir: each rank is owned by one of them,
            # claimed on its first request and released when this proxy stops (or dies).
            layout = CheckpointsLayout(str(settings.checkpoints_dir))
            check_records_per_chunk(layout, settings.records_per_chunk, record=False)
            make_dirs_durable(layout.root)
            ownership = RankOwnership(layout, port=settings.port)
            stack.callback(ownership.release_all)
            pool = upstream_pool(settings)
            await pool.start()
            stack.push_async_callback(pool.close)
            activity = RankActivity()
            checkpoints = CheckpointRegistry(settings, ownership, activity)
            caches = checkpoints.caches
            stack.push_async_callback(caches.close)  # after the managers, which write through them
            stack.push_async_callback(checkpoints.close)
            files = FileStore(layout.files_dir, fsync=settings.fsync == "always", clock=self.clock)
            await asyncio.to_thread(files.open)
            services = Services(
                settings=settings,
                pool=pool,
                caches=caches,
                checkpoints=checkpoints,
                files=files,
                activity=activity,
                metrics=Metrics(enabled=settings.metrics, max_tracked_ranks=settings.max_tracked_ranks),
            )
            counted = services.metrics.batch_lines if settings.metrics else None  # as the requests are, or not
            batches = BatchEngine(settings, pool, services.flights, files, layout.batches_dir, counted, per_host=True)
            await batches.start()
            stack.push_async_callback(batches.close)  # before the pool closes: its lines stop first
            services.batches = batches
            ticker = asyncio.create_task(every_few_seconds(services), name="every-few-seconds")
            stack.push_async_callback(cancel_and_wait, ticker)
            expiry = asyncio.create_task(remove_expired_files(services), name="remove-expired-files")
            stack.push_async_callback(cancel_and_wait, expiry)
            if settings.rank_idle_s > 0:
                janitor = asyncio.create_task(release_idle_ranks(services), name="release-idle-ranks")
                stack.push_async_callback(cancel_and_wait, janitor)
            self.services = services
            stack.callback(setattr, self, "services", None)
            logger.info("inferproxy %s forwarding to %s", __version__, ", ".join(r.url for r in pool.replicas))
            shown = settings.model_dump(mode="json")
            for secret in ("api_key", "upstream_api_key"):
                shown[secret] = "***" if shown[secret] else None
            shown["output"] = redact_url(settings.output)
            shown["upstream"] = [r.url for r in pool.replicas]
            if settings.max_connections is None:  # the limit in force, derived from the open files limit
                shown["max_connections"] = default_max_connections(settings.max_open_ranks)
            logger.info("settings: %s", shown)
            # In the background: a dead upstream must not delay or fail the start, only be said at once.
            probe = asyncio.create_task(pool.warn_about_silent_replicas(), name="probe-upstreams")
            stack.push_async_callback(cancel_and_wait, probe)
            yield services


def upstream_pool(settings: Settings) -> UpstreamPool:
    """The one upstream pool of a process, as the settings say (`serve`'s lifespan, `run-batch`)."""
    return UpstreamPool(
        settings.upstream,
        retries=settings.upstream_retries,
        backoff_s=settings.retry_backoff_s,
        connect_timeout_s=settings.connect_timeout_s,
        read_timeout_s=settings.read_timeout_s,
        api_key=settings.upstream_api_key,
        health_interval_s=settings.health_interval_s,
        max_response_bytes=settings.max_response_bytes,
        max_inflight=settings.max_inflight_per_upstream,
        max_queued=settings.max_queued_requests,
        routing=settings.routing,
        load_bound=settings.affinity_load_bound,
    )


async def release_idle_ranks(services: Services) -> None:
    """Give up ranks no request has used for `rank_idle_s`, so that a moved job can take them elsewhere."""
    idle_s = services.settings.rank_idle_s
    while True:
        await asyncio.sleep(min(max(idle_s / 4, 0.05), 15.0))
        try:
            released = await services.checkpoints.release_idle(idle_s)
        except Exception:  # a rank whose close failed is released all the same, with nothing of it left open
            logger.exception("releasing idle ranks failed")
            continue
        if released:
            logger.info("released ranks %s, unused for %g s: another proxy may take them over", released, idle_s)


async def remove_expired_files(services: Services) -> None:
    """The bytes of the files that expired since (`expires_after`) removed, at the start and every
    `EXPIRED_FILES_EVERY_S`, for those no request asks for (one that does removes them itself)."""
    while True:
        try:
            await asyncio.to_thread(remove_expired, services)
        except Exception:  # a checkpoints dir unreadable for a while, say: the next round tries again
            logger.exception("removing the expired files failed")
        await asyncio.sleep(EXPIRED_FILES_EVERY_S)


async def every_few_seconds(services: Services) -> None:
    """The totals sampled (the last minute's rates, the history in `/stats`), the ranks counted one by
    one kept to `max_tracked_ranks` (the open ones kept), and the memory freed since given back."""
    metrics = services.metrics
    while True:
        metrics.sample()
        metrics.forget_idle_ranks(keep=set(services.caches.ownership.owned()))
        release_free_memory()
        await asyncio.sleep(SAMPLE_EVERY_S)


class Server(Protocol):
    """What `inferproxy serve` and the tests need of a server, built-in or uvicorn."""

    port: int

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    async def serve(self, *, install_signal_handlers: bool = False) -> None: ...


def create_server(settings: Settings, app: InferProxy | None = None) -> Server:
    """`inferproxy serve`'s server around `create_app(settings)`: the built-in one (hits on its fast path),
    or uvicorn with `http = "uvicorn"`."""
    app = app or create_app(settings)
    if settings.http == "uvicorn":
        from app.service.uvicorn_server import UvicornServer

        return UvicornServer(app, settings)
    return HTTPServer(
        app,
        host=settings.host,
        port=settings.port,
        fast=app.answer_fast,
        fast_paths=CACHEABLE_PATHS,
        fast_body_bytes=settings.max_body_bytes,  # a larger one is the app's 413, at once
        render_error=render_error,
        shutdown_grace_s=settings.shutdown_grace_s,
        on_shutdown=app.shutting_down,
        head_timeout_s=settings.head_timeout_s,
        body_timeout_s=settings.body_timeout_s,
        max_connections=max_connections(settings),
    )


def render_error(status: int, message: str) -> tuple[bytes, bytes]:
    """The HTTP server's own refusals, in the proxy's error envelope."""
    # 501: a method this proxy serves on no route is the request's fault, as the app says under uvicorn too.
    kind = "internal_error" if status >= 500 and status != 501 else "invalid_request_error"
    return b"application/json", error_body(message, type_=kind, code=status)
