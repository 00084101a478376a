"""Every route of the proxy, in one table: FastAPI's (`routes(app)` adds them to `InferProxy`).

- the control plane, FastAPI routes with their models (`app.service.models`), described at
  `/openapi.json` and `/docs`: the checkpoint routes, `/lookup`, OpenAI's `/v1/files`, `/stats`,
  `/metrics`, `/readyz` (all behind `--api-key`), and `/healthz`, the page at `/` and the docs themselves, open (they
  hold no data);
- the proxied `/v1/chat/completions` and `/v1/completions`, and every other path forwarded to the
  upstream unchanged (`/{path:path}`, last): raw-ASGI routes (`app.service.routing.RawRoute`) in the
  same table, served without FastAPI's per-request machinery (bench/README.md, "Routes").

The routes read their bodies and headers themselves (`app.service.routes`), with the body limit applied
as it arrives and docs/contract.md's one-line errors; the models and `described` tell the schema what
they accept. A control route's error, whatever raised it, is answered in the proxy's envelope
(`ProxyRoute`), as the raw routes' are by `InferProxy.dispatch`.

The docs page's script and styles are served by the proxy (from `fastapi-offline`'s copy of Swagger UI
5, which renders the OpenAPI 3.1 FastAPI writes), never from a CDN: GPU clusters are often offline.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from importlib import resources
from typing import Annotated, Any, TypeVar

import orjson
from fastapi import FastAPI, Path, Request, Response, Security
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.routing import APIRoute
from fastapi.security import HTTPBearer
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from app.service import models
from app.service.asgi import ClientGone, Receive, Scope, error_headers
from app.service.batches import models as batch_models
from app.service.errors import ProxyError, failure
from app.service.keys import rank_of
from app.service.routes import batches, checkpoints, files, lookup, ops
from app.service.routes.proxy import cacheable, forward_uncached
from app.service.routing import OTHER, RawRoute
from app.service.services import Services

logger = logging.getLogger(__name__)

_BYPASS = [(b"x-cache", b"BYPASS")]
#: The raw routes, after the control plane's; the last one forwards every other path unchanged and
#: uncached, so that whatever worked against vLLM or SGLang (`/tokenize`, `/health`, ...) works here.
RAW_ROUTES = [
    RawRoute("/v1/chat/completions", {"POST": cacheable, OTHER: forward_uncached}, error_headers=_BYPASS),
    RawRoute("/v1/completions", {"POST": cacheable, OTHER: forward_uncached}, error_headers=_BYPASS),
    # labelled as before the table was FastAPI's, for the dashboards counting forwarded requests
    RawRoute("/{path:path}", {OTHER: forward_uncached}, error_headers=_BYPASS, label="/{path...}"),
]
FORWARDED = RAW_ROUTES[-1].path
OPENAPI_URL = "/openapi.json"
DOCS_URL = "/docs"
#: The docs page's files, served from the proxy (name -> content type).
DOCS_ASSETS = {"swagger-ui-bundle.js": "text/javascript", "swagger-ui.css": "text/css", "favicon.png": "image/png"}


class NoAnswer(Response):
    """For a client that left before its request was read: nothing is sent (counted as 499)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Any) -> None:
        return None


def error_response(error: ProxyError) -> Response:
    response = Response(error.body(), status_code=error.status)
    response.raw_headers = [*error_headers(error), (b"content-length", str(len(response.body)).encode())]
    return response


class ProxyRoute(APIRoute):
    """A control route: every error answered as the proxy's envelope, with its status and message."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            try:
                return await handler(request)
            except ClientGone:
                logger.debug("client left before its request was read: %s", request.url.path)
                return NoAnswer()
            except Exception as exc:
                return error_response(failure(exc, f"{request.method} {request.url.path}"))

        return handle


#: `--api-key`, for the schema (and the docs page's "Authorize"); `InferProxy` checks it on every route.
BEARER = HTTPBearer(auto_error=False, description="`--api-key`: every route but `/`, `/healthz` and the docs")

Endpoint = TypeVar("Endpoint", bound=Callable[..., Any])


@dataclass(frozen=True)
class Control:
    """A control route, as `route` declared it; `routes` adds it to the app."""

    method: str
    path: str
    endpoint: Callable[..., Any]
    keyed: bool
    options: dict[str, Any]


#: The control plane's routes, in the order declared below.
CONTROL: list[Control] = []


def route(method: str, path: str, *, keyed: bool = True, **options: Any) -> Callable[[Endpoint], Endpoint]:
    """Declare a control route (`options`: FastAPI's); `keyed`: it needs `--api-key`."""

    def declare(endpoint: Endpoint) -> Endpoint:
        CONTROL.append(Control(method, path, endpoint, keyed, options))
        return endpoint

    return declare


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": models.ErrorEnvelope, "description": _STATUS[status]} for status in (401, *statuses)}


_STATUS = {
    400: "a header or the body is malformed; nothing was written",
    401: "the `Authorization` header is missing, or its key is not the proxy's `--api-key`",
    404: "no such batch or file: the id names none",
    409: "the chunk is complete already, the rank is owned by another proxy, chunks left the output, or the "
    "file is the input of a running batch",
    413: "the body exceeds `max_body_bytes` (an upload: `max_file_bytes`), or holds too many JSON values",
    503: "the output (or every open rank) is busy or failing: retry after `Retry-After`",
    507: "the checkpoints disk is full: nothing was written, free space and retry",
}


def header(name: str, description: str, *, required: bool = False, minimum: int = 0) -> dict[str, Any]:
    schema = {"type": "integer", "minimum": minimum}
    return {"name": name, "in": "header", "required": required, "schema": schema, "description": description}


X_RANK = header("X-Rank", "the job's rank (datatrove's task), 0 if absent")
X_TOTAL_DOCUMENTS = header("X-Total-Documents", "the rank's documents in all, for progress and ETA")
X_TOTAL_RANKS = header("X-Total-Ranks", "the job's ranks in all (datatrove's world size)", minimum=1)


def described(*parameters: dict[str, Any], body: type[BaseModel] | None = None) -> dict[str, Any]:
    """The OpenAPI of what a route reads itself: its headers, and its JSON body's model (its schema is
    added to the components by `InferProxy.openapi`)."""
    extra: dict[str, Any] = {"parameters": list(parameters)}
    if body is not None:
        schema = {"$ref": f"#/components/schemas/{body.__name__}"}
        extra["requestBody"] = {"required": True, "content": {"application/json": {"schema": schema}}}
    return extra


#: The request models `described` names: `InferProxy.openapi` adds their schemas.
REQUEST_MODELS: list[type[BaseModel]] = [models.Documents, models.Lookups, batch_models.BatchCreate]


def services_of(request: Request) -> Services:
    services: Services | None = request.app.services
    assert services is not None, "a request before the lifespan's startup"
    return services


def json_answer(body: bytes) -> Response:
    return Response(body, media_type="application/json")


async def with_rank(request: Request, work: checkpoints.Work) -> Response:
    """A checkpoint route's work with its rank in use (never released meanwhile), answered as JSON."""
    services = services_of(request)
    with services.activity.using(rank_of(request.scope)):
        answer = await work(services, request.scope, request.receive)
    return json_answer(orjson.dumps(answer))


# -- the checkpoint service (docs/contract.md §5) ----------------------------------------


@route(
    "POST",
    "/documents",
    summary="Checkpoint finished documents",
    description="One document or a JSON array of them, for the chunk `X-Chunk-Index`: 200 once they are "
    "durable; a duplicate id is counted, not written again; on any error nothing of the request is written.",
    response_model=models.DocumentsWritten,
    responses=errors(400, 409, 413, 503, 507),
    openapi_extra=described(
        header("X-Chunk-Index", "the chunk the documents belong to", required=True),
        X_RANK,
        X_TOTAL_DOCUMENTS,
        body=models.Documents,
    ),
)
async def post_documents(request: Request) -> Response:
    return await with_rank(request, checkpoints.post_documents)


@route(
    "POST",
    "/chunks/{i}/complete",
    summary="End the job's last chunk",
    description="Chunk `i`, short of `records_per_chunk`, is complete: it is published once every earlier one is.",
    response_model=models.ChunkCompleted,
    responses=errors(400, 409, 503, 507),
    openapi_extra=described(
        {"name": "i", "in": "path", "required": True, "schema": {"type": "integer", "minimum": 0}},
        X_RANK,
        X_TOTAL_DOCUMENTS,
        X_TOTAL_RANKS,
    ),
)
async def complete_chunk(request: Request) -> Response:
    return await with_rank(request, checkpoints.complete_chunk)


@route(
    "GET",
    "/resume",
    summary="Where a restarted job carries on",
    description="The documents to skip and the ids already checkpointed, and where the proxy publishes.",
    response_model=models.ResumePoint,
    responses=errors(400, 409, 503),
    openapi_extra=described(X_RANK, X_TOTAL_DOCUMENTS, X_TOTAL_RANKS),
)
async def get_resume(request: Request) -> Response:
    return await with_rank(request, checkpoints.get_resume)


@route(
    "POST",
    "/lookup",
    summary="Many cache lookups at once",
    description="For the replay storm of a restarted job: what each request would replay as a HIT, or null.",
    response_model=models.LookedUp,
    responses=errors(400, 409, 413),
    openapi_extra=described(X_RANK, body=models.Lookups),
)
async def post_lookup(request: Request) -> Response:
    return json_answer(await lookup.lookups(services_of(request), request.scope, request.receive))


# -- files (OpenAI's Files API, for batches) ---------------------------------------------

FILE_ID = Annotated[str, Path(description="the file's id, `file-` and 24 hex digits")]
_UPLOAD = {
    "required": True,
    "content": {
        "multipart/form-data": {
            "schema": {
                "type": "object",
                "required": ["file", "purpose"],
                "properties": {
                    "file": {"type": "string", "format": "binary", "description": "the upload, with a filename"},
                    "purpose": {"type": "string", "enum": list(files.PURPOSES)},
                    "expires_after[anchor]": {"type": "string", "enum": [files.ANCHOR], "description": "with seconds"},
                    "expires_after[seconds]": {
                        "type": "integer",
                        "minimum": files.EXPIRES_AFTER_S[0],
                        "maximum": files.EXPIRES_AFTER_S[1],
                        "description": "the file expires this long after `created_at`: 404 from then on",
                    },
                },
            }
        }
    },
}


def query(name: str, schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "schema": schema, "description": description}


@route(
    "POST",
    "/v1/files",
    summary="Upload a file",
    description="A multipart form with `file` and `purpose=batch`, streamed to disk as it arrives (`max_file_bytes`, "
    "not `max_body_bytes`, bounds it): OpenAI's `client.files.create`. On any error nothing of it is kept.",
    response_model=models.FileObject,
    responses=errors(400, 413, 503, 507),
    openapi_extra={"requestBody": _UPLOAD},
)
async def create_file(request: Request) -> Response:
    return json_answer(orjson.dumps(await files.create(services_of(request), request.scope, request.receive)))


@route(
    "GET",
    "/v1/files",
    summary="List the files",
    description="OpenAI's cursor page: `after` the `last_id` of the page before, while `has_more`.",
    response_model=models.FileList,
    responses=errors(400),
    openapi_extra=described(
        query("purpose", {"type": "string"}, "only the files of this purpose"),
        query("limit", {"type": "integer", "minimum": 1, "maximum": files.MAX_LIST}, "at most this many (10000)"),
        query("order", {"type": "string", "enum": ["asc", "desc"]}, "by `created_at` (desc)"),
        query("after", {"type": "string"}, "the files after this id in that order"),
    ),
)
async def list_files(request: Request) -> Response:
    answer = await asyncio.to_thread(files.listing, services_of(request), request.scope)
    return json_answer(orjson.dumps(answer))


@route("HEAD", "/v1/files/{file_id:str}", include_in_schema=False)  # as GET: the servers send no body
@route(
    "GET",
    "/v1/files/{file_id:str}",
    summary="A file's object",
    response_model=models.FileObject,
    responses=errors(404),
)
async def retrieve_file(request: Request, file_id: FILE_ID) -> Response:
    return json_answer(orjson.dumps(await asyncio.to_thread(files.retrieve, services_of(request), file_id)))


@route(
    "GET",
    "/v1/files/{file_id:str}/content",
    summary="A file's bytes",
    description="As stored, streamed from disk: OpenAI's `client.files.content`.",
    response_class=Response,
    responses={200: {"content": {"application/octet-stream": {}}, "description": "the bytes"}, **errors(404)},
)
async def file_content(request: Request, file_id: FILE_ID) -> Response:
    stored, fd = await asyncio.to_thread(files.opened, services_of(request), file_id)
    return files.FileContent(stored, fd)


@route("HEAD", "/v1/files/{file_id:str}/content", include_in_schema=False)
async def file_content_head(request: Request, file_id: FILE_ID) -> Response:
    """GET's status and headers, without reading the bytes."""
    stored, size = await asyncio.to_thread(files.content_size, services_of(request), file_id)
    response = Response()
    response.raw_headers = files.content_headers(stored, size)
    return response


@route(
    "DELETE",
    "/v1/files/{file_id:str}",
    summary="Delete a file",
    response_model=models.FileDeleted,
    responses=errors(404, 409),
)
async def delete_file(request: Request, file_id: FILE_ID) -> Response:
    services = services_of(request)
    if services.batches is not None and services.files.get(file_id) is not None:  # expired: 404, as if deleted
        await services.batches.check_deletable(file_id)
        await batches.forget_output(services, file_id)
    deleted = await asyncio.to_thread(files.delete, services, file_id)
    return json_answer(orjson.dumps(deleted))


# -- operations ----------------------------------------------------------------------------


@route("GET", "/healthz", keyed=False, summary="Accepting requests", response_model=models.Health)
async def healthz() -> Response:
    return json_answer(ops.HEALTHY)


@route(
    "GET",
    "/readyz",
    summary="An upstream answers",
    description="200 while at least one upstream answers `GET /v1/models`, else 503.",
    response_model=models.Ready,
    responses=errors(503),
)
async def readyz(request: Request) -> Response:
    return json_answer(orjson.dumps(await ops.readiness(services_of(request))))


@route("GET", "/stats", summary="Everything the proxy counts", response_model=models.Stats, responses=errors())
async def stats(request: Request) -> Response:
    return json_answer(await ops.stats(services_of(request)))


@route(
    "GET",
    "/metrics",
    summary="The same numbers for Prometheus",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus' text format"}, **errors()},
)
async def metrics(request: Request) -> Response:
    return Response(await ops.metrics(services_of(request)), media_type=CONTENT_TYPE_LATEST)


@route(
    "GET",
    "/",
    keyed=False,
    summary="The live page",
    description="One HTML file that asks for the key itself, then polls `/stats`.",
    response_class=Response,
    responses={200: {"content": {"text/html": {}}, "description": "the page"}},
)
async def page() -> Response:
    return Response(ops.page(), media_type="text/html; charset=utf-8", headers={"cache-control": "no-cache"})


# -- batches (OpenAI's Batch API, docs/contract.md §12) -----------------------------------

BATCH_ID = {"name": "batch_id", "in": "path", "required": True, "schema": {"type": "string"}}


@route(
    "POST",
    "/v1/batches",
    summary="Create a batch",
    description="Runs every line of an uploaded input file through the cache and the upstream, resumed after "
    "any crash; answered at once, `validating`.",
    response_model=batch_models.Batch,
    responses=errors(400, 413),
    openapi_extra=described(body=batch_models.BatchCreate),
)
async def create_batch(request: Request) -> Response:
    services = services_of(request)
    return json_answer(orjson.dumps(await batches.create(services, request.scope, request.receive)))


@route(
    "GET",
    "/v1/batches",
    summary="List batches",
    description="Newest first; `after` (a batch id) and `limit` (1-100, default 20) page through them.",
    response_model=batch_models.BatchList,
    responses=errors(400),
)
async def list_batches(request: Request, after: str | None = None, limit: str = "20") -> Response:
    return json_answer(orjson.dumps(await asyncio.to_thread(batches.listing, services_of(request), after, limit)))


@route(
    "GET",
    "/v1/batches/{batch_id:str}",
    summary="A batch",
    response_model=batch_models.Batch,
    responses=errors(404),
    openapi_extra=described(BATCH_ID),
)
async def get_batch(request: Request) -> Response:
    return json_answer(orjson.dumps(batches.get(services_of(request), request.path_params["batch_id"])))


@route(
    "POST",
    "/v1/batches/{batch_id:str}/cancel",
    summary="Cancel a batch",
    description="`cancelling` at once: no new line is sent; `cancelled` once the lines in flight are answered, "
    "with every line finished before in its output file.",
    response_model=batch_models.Batch,
    responses=errors(404),
    openapi_extra=described(BATCH_ID),
)
async def cancel_batch(request: Request) -> Response:
    return json_answer(orjson.dumps(await batches.cancel(services_of(request), request.path_params["batch_id"])))


# -- the docs -----------------------------------------------------------------------------


@route("GET", DOCS_URL, keyed=False, include_in_schema=False)
async def docs(request: Request) -> Response:
    root = request.scope.get("root_path", "")
    return get_swagger_ui_html(
        openapi_url=f"{root}{OPENAPI_URL}",
        title="inferproxy: the API",
        swagger_js_url=f"{root}{DOCS_URL}/swagger-ui-bundle.js",
        swagger_css_url=f"{root}{DOCS_URL}/swagger-ui.css",
        swagger_favicon_url=f"{root}{DOCS_URL}/favicon.png",
    )


def _asset(name: str, content_type: str) -> None:
    async def asset() -> Response:
        body = resources.files("fastapi_offline").joinpath("static", name).read_bytes()
        return Response(body, media_type=content_type, headers={"cache-control": "public, max-age=86400"})

    route("GET", f"{DOCS_URL}/{name}", keyed=False, include_in_schema=False, name=name)(asset)


for _name, _type in DOCS_ASSETS.items():
    _asset(_name, _type)


def routes(app: FastAPI) -> frozenset[str]:
    """Every route added to `app`, in order (after FastAPI's `/openapi.json`); the paths served without the key.
    A `GET` route answers `HEAD` too (RFC 9110: a health checker may ask so), as its `GET` without the body,
    which the servers do not send, unless a `HEAD` of its own is declared (a file's content: no bytes read)."""
    declared_heads = {control.path for control in CONTROL if control.method == "HEAD"}
    for control in CONTROL:
        answers = [(control.method, control.options)]
        if control.method == "GET" and control.path not in declared_heads:
            answers.append(("HEAD", {**control.options, "include_in_schema": False}))
        for method, options in answers:
            app.router.add_api_route(
                control.path,
                control.endpoint,
                methods=[method],
                route_class_override=ProxyRoute,
                dependencies=[Security(BEARER)] if control.keyed else None,
                **options,
            )
    app.router.routes.extend(RAW_ROUTES)
    return frozenset({OPENAPI_URL, *(control.path for control in CONTROL if not control.keyed)})
