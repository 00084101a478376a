"""`inferproxy serve --http uvicorn`: the same ASGI app under uvicorn (httptools, uvloop, lifespan on).

For whoever prefers a server that many others run: every route behaves the
same, but there is no fast path, so a cache hit costs more CPU
(`bench/README.md`). The interface is the built-in server's (`start`,
`shutdown`, `serve`, `port`), so `inferproxy serve` and the tests run either.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Protocol

import uvicorn

from app.http.asgi import Receive, Scope, Send
from app.http.server import CannotListen, ExitSignal
from app.service.limits import max_connections
from app.service.settings import Settings


class ServedApp(Protocol):
    """What this server needs of the app (`app.service.app.InferProxy`): an ASGI app that keeps the
    exception its lifespan startup failed with, and is told when the shutdown begins."""

    startup_error: BaseException | None

    def shutting_down(self) -> None: ...

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None: ...


logger = logging.getLogger(__name__)


def _not_a_cut_request(record: logging.LogRecord) -> bool:
    """uvicorn logs a request task cancelled at a forced exit as an "Exception in ASGI application"
    traceback; a request cut by a second Ctrl-C is what was asked for (and said once, as a warning)."""
    return not (record.exc_info and isinstance(record.exc_info[1], asyncio.CancelledError))


class UvicornServer:
    def __init__(self, app: ServedApp, settings: Settings) -> None:
        self.app = app
        self.host, self.port = settings.host, settings.port
        self.config = uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            http="httptools",
            loop="uvloop",
            lifespan="on",
            ws="none",  # an Upgrade: websocket request is answered as plain HTTP, as by the built-in server
            access_log=False,
            server_header=False,
            log_config=None,  # the logging `inferproxy serve` set up stays as it is
            timeout_graceful_shutdown=math.ceil(settings.shutdown_grace_s),
            # uvicorn counts the connection asking among those open: one more lets exactly
            # max_connections in. It answers past them with 503 when a request comes.
            limit_concurrency=max_connections(settings) + 1,
        )
        self.server = uvicorn.Server(self.config)
        self.exit = ExitSignal(force=self._force)
        logging.getLogger("uvicorn.error").addFilter(_not_a_cut_request)  # the same function: added once

    async def start(self) -> None:
        """Lifespan startup, then listen; the app's own exception if its startup failed."""
        self.config.load()
        self.server.lifespan = self.config.lifespan_class(self.config)
        try:
            await self.server.startup()
        except SystemExit as exc:  # uvicorn's way out of a failed startup or a port it cannot bind
            if self.app.startup_error is not None:
                raise self.app.startup_error from None
            raise CannotListen(f"cannot listen on {self.host}:{self.port} (uvicorn's log says why)") from exc
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        logger.info("listening on http://%s:%d (uvicorn)", self.host, self.port)

    async def shutdown(self) -> None:
        """Stop accepting, let requests in flight finish within `shutdown_grace_s`, then the lifespan."""
        self.app.shutting_down()
        self.server.should_exit = True
        await self.server.shutdown()
        if self.server.force_exit:
            # uvicorn leaves the requests in flight to be cancelled when the loop ends, after the
            # lifespan: cut them now, then close the caches, which uvicorn would skip.
            cut = list(self.server.server_state.tasks)
            if cut:
                logger.warning("%d requests still in flight: cut off", len(cut))
            for task in cut:
                task.cancel()
            await asyncio.gather(*cut, return_exceptions=True)
            await self.server.lifespan.shutdown()

    def request_exit(self) -> None:
        self.exit.request_exit()

    async def serve(self, *, install_signal_handlers: bool = False) -> None:
        """As `app.http.server.HTTPServer.serve`: until SIGTERM/SIGINT (a second one cuts what is in flight)."""
        await self.exit.serve(self.start, self.shutdown, install_signal_handlers=install_signal_handlers)

    def _force(self) -> None:
        self.server.force_exit = True
