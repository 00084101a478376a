"""The route table's index: FastAPI's table (`app.service.api`) read once into a dict of exact paths and
the few patterns after them, so that routing a `/v1/chat/completions` request costs one dict lookup.

The table holds two kinds of routes. The control plane's are FastAPI's (`APIRoute`: models, OpenAPI,
`/docs`); the index sends their requests through the FastAPI app. The hot ones, the proxied `/v1/*`
and everything forwarded, are `RawRoute`s: raw-ASGI handlers in the same table, called by the index
directly, as FastAPI's machinery costs ~80 µs of CPU per request (bench/README.md, "Routes"), more
than the rest of a cache miss's own work in the proxy.

Patterns (`Entry.path`, Starlette's syntax): one `{name}` part, ASCII digits only
(`/chunks/{i}/complete`: `/chunks/x/complete` is no route), `{name:str}`, one non-empty segment
(`/v1/files/{file_id:str}`: the route says which are its own), or `{name:path}`, any text, slashes
included (`/{path:path}`). The part lands in `scope["path_params"]`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple
from urllib.parse import quote

from starlette.datastructures import URLPath
from starlette.routing import BaseRoute, Match, NoMatchFound, Route

from app.service.asgi import Headers, Receive, Scope, Send
from app.service.errors import BadRequest
from app.service.services import Services

#: (services, scope, receive, send): one route's raw-ASGI handler.
Handler = Callable[[Services, Scope, Receive, Send], Awaitable[None]]

#: In `RawRoute.handlers`: every method the route does not name, except `NEVER_SERVED`.
OTHER = "*"
#: Refused on every route (501, as by the built-in server): a proxy must not reflect a request (TRACE)
#: or open a tunnel (CONNECT).
NEVER_SERVED = frozenset({"TRACE", "CONNECT"})
#: The forwarded part of the URL space: a path whose dot segments leave it is refused.
V1 = "/v1/"


class Pattern(NamedTuple):
    head: str
    tail: str
    name: str
    kind: str  # "path": any text, slashes included; "str": one segment; "": ASCII digits

    @classmethod
    def of(cls, path: str) -> Pattern | None:
        if "{" not in path:
            return None
        head, rest = path.split("{", 1)
        name, tail = rest.split("}", 1)
        name, _, kind = name.partition(":")
        return cls(head, tail, name, kind)

    def match(self, path: str) -> dict[str, str] | None:
        """The parameter if `path` matches, else None."""
        head, tail, name, kind = self
        if not path.startswith(head) or not path.endswith(tail) or len(path) < len(head) + len(tail):
            return None
        value = path[len(head) : len(path) - len(tail)]
        if kind == "str":
            return {name: value} if value and "/" not in value else None
        if kind != "path" and not (value.isascii() and value.isdigit()):
            return None
        return {name: value}


class RawRoute(BaseRoute):
    """A raw-ASGI route in FastAPI's table: a handler per method (`OTHER` for the rest), whether it needs
    `--api-key`, the headers added to the proxy's own error answers on it (`X-Cache: BYPASS`), and its
    name in the metrics and the request log (`label`, its path unless given)."""

    def __init__(
        self,
        path: str,
        handlers: Mapping[str, Handler],
        *,
        auth: bool = True,
        error_headers: Headers | None = None,
        label: str | None = None,
    ) -> None:
        self.path = path
        self.label = label or path
        self.handlers = handlers
        self.auth = auth
        self.error_headers = error_headers or []
        self.pattern = Pattern.of(path)

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        if scope["type"] != "http":
            return Match.NONE, {}
        if self.pattern is None:
            return (Match.FULL, {}) if scope["path"] == self.path else (Match.NONE, {})
        params = self.pattern.match(scope["path"])
        return (Match.NONE, {}) if params is None else (Match.FULL, {"path_params": params})

    def url_path_for(self, name: str, /, **path_params: Any) -> URLPath:
        raise NoMatchFound(name, path_params)

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Served by Starlette's router (the index calls the handler itself)."""
        handler = self.handlers.get(scope["method"]) or self.handlers.get(OTHER)
        assert handler is not None, f"{scope['method']} {self.path}: the index answers 405 before"
        await handler(scope["app"].services, scope, receive, send)


@dataclass(frozen=True)
class Entry:
    """One route of the table as the index serves it."""

    path: str
    handlers: Mapping[str, Handler]
    auth: bool
    error_headers: Headers
    label: str
    pattern: Pattern | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "pattern", Pattern.of(self.path))  # a frozen dataclass sets its own derived fields so

    def handler(self, method: str) -> Handler | None:
        handler = self.handlers.get(method)
        if handler is None and method not in NEVER_SERVED:
            handler = self.handlers.get(OTHER)
        return handler

    def allow(self) -> bytes:
        """The `Allow` header of a 405: the methods served here."""
        if OTHER in self.handlers:
            return b"GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS"
        return ", ".join(sorted(self.handlers)).encode()


class Index:
    """`routes` (FastAPI's table, in order) as entries: a `RawRoute` served by its own handlers, any other
    route by `framework` (the FastAPI app), for its methods; each needs the key unless in `open_paths`.
    FastAPI routes of one path (`GET` and `POST /v1/files`) are one entry, where the first was."""

    def __init__(self, routes: Iterable[BaseRoute], framework: Handler, open_paths: Collection[str]) -> None:
        entries: dict[str, Entry] = {}
        for route in routes:
            if isinstance(route, RawRoute):
                entry = Entry(route.path, route.handlers, route.auth, route.error_headers, route.label)
            elif isinstance(route, Route):  # FastAPI's own (`/openapi.json`) and every `APIRoute`
                handlers = {**(entries[route.path].handlers if route.path in entries else {})}
                handlers.update(dict.fromkeys(route.methods or (), framework))
                label = getattr(route, "path_format", route.path)  # `{batch_id}`, not `{batch_id:str}`
                entry = Entry(route.path, handlers, route.path not in open_paths, [], label)
            else:
                raise TypeError(f"{route!r}: the index serves routes and raw routes, not mounts")
            entries[route.path] = entry
        self.entries = list(entries.values())
        self.exact = {entry.path: entry for entry in self.entries if entry.pattern is None}
        self.patterns = [entry for entry in self.entries if entry.pattern is not None]

    def find(self, path: str) -> tuple[Entry, dict[str, str] | None] | None:
        entry = self.exact.get(path)
        if entry is not None:
            return entry, None
        for entry in self.patterns:
            assert entry.pattern is not None
            params = entry.pattern.match(path)
            if params is not None:
                return entry, params
        return None


def remove_dot_segments(path: str) -> str:
    """RFC 3986 §5.2.4 on an absolute path: `/v1/./a/../b` is `/v1/b`; `..` never climbs above `/`."""
    segments = path.split("/")
    kept: list[str] = []
    for segment in segments[1:]:
        if segment == "..":
            if kept:
                kept.pop()
        elif segment != ".":
            kept.append(segment)
    if segments[-1] in (".", ".."):
        kept.append("")  # `/v1/.` is the folder `/v1/`
    return "/" + "/".join(kept)


def resolve_dot_segments(scope: Scope) -> None:
    """Route (and forward) a path with `.` or `..` segments by its resolved form; one that leaves `/v1/` is
    refused, so that the upstream, which may resolve them itself, never sees it with the upstream key.

    The decoded path is resolved: `%2e%2e` and `%2F` were decoded before, as the upstream may decode them.
    """
    path: str = scope["path"]
    resolved = remove_dot_segments(path)
    if resolved == path:
        return
    if path.startswith(V1) and not resolved.startswith(V1):
        raise BadRequest(
            f"the path {path!r} leaves {V1} once its dot segments are resolved (it is {resolved!r}): "
            f"send the path without '.' and '..' segments"
        )
    scope["path"] = resolved
    scope["raw_path"] = quote(resolved, safe="/:@!$&'()*+,;=-._~").encode("ascii")
