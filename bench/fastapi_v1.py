"""`python bench/fastapi_v1.py serve ...`: `inferproxy serve` with `/v1/chat/completions` and `/v1/completions`
as FastAPI routes (an `APIRoute` whose answer runs the same handler) instead of raw ASGI routes.

bench_proxy.py measures the raw routes against this, in the same run: issue 19 has misses go through
FastAPI unless that costs more than 15 µs of CPU per miss (bench/README.md, "Routes").
"""

from __future__ import annotations

import sys
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

from app.cli import main
from app.service import api
from app.service.routing import Handler, RawRoute


class Handled(Response):
    """An answer that is the raw route's handler itself, run with FastAPI's scope, receive and send."""

    def __init__(self, handler: Handler) -> None:
        super().__init__()
        self.handler = handler

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.handler(scope["app"].services, scope, receive, send)


def through_fastapi(raw: RawRoute) -> APIRoute:
    handler = raw.handlers["POST"]

    async def endpoint(request: Request) -> Response:
        return Handled(handler)

    return APIRoute(raw.path, endpoint, methods=["POST"], include_in_schema=False)


*v1, forwarded = api.RAW_ROUTES
api.RAW_ROUTES[:] = [*(through_fastapi(route) for route in v1), forwarded]  # type: ignore[list-item]

if __name__ == "__main__":
    sys.exit(main())
