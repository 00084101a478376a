"""The route table's mechanics: exact paths in a dict, the few patterns after them, dot segments resolved.

`app.service.app` lists every route once (`ROUTES`); `Router.find` is a dict lookup
for an exact path, then a prefix/suffix test per pattern (no regular
expression), so a `/v1/chat/completions` request costs one dict lookup.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple
from urllib.parse import quote

from app.service.asgi import Headers, Receive, Scope, Send
from app.service.errors import BadRequest
from app.service.services import Services

#: (services, scope, receive, send): one route's raw-ASGI handler.
Handler = Callable[[Services, Scope, Receive, Send], Awaitable[None]]

#: In `Route.handlers`: every method the route does not name, except `NEVER_SERVED`.
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
    anything: bool  # `{name...}`: any text, slashes included; `{name}`: ASCII digits


@dataclass(frozen=True)
class Route:
    """`path` is exact (`/documents`) or a pattern with one `{name}` (digits only) or `{name...}`
    (anything) part: `/chunks/{i}/complete`, `/v1/{path...}`. Its value lands in `scope["path_params"]`."""

    path: str
    handlers: Mapping[str, Handler]
    auth: bool = True
    #: added to the proxy's own error answers on this route (`X-Cache: BYPASS` on `/v1/*`)
    error_headers: Headers = field(default_factory=list)
    pattern: Pattern | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        pattern = None
        if "{" in self.path:
            head, rest = self.path.split("{", 1)
            name, tail = rest.split("}", 1)
            pattern = Pattern(head, tail, name.removesuffix("..."), name.endswith("..."))
        object.__setattr__(self, "pattern", pattern)  # a frozen dataclass sets its own derived fields so

    def match(self, path: str) -> dict[str, str] | None:
        """The pattern's parameter if `path` matches it, else None."""
        assert self.pattern is not None
        head, tail, name, anything = self.pattern
        if not path.startswith(head) or not path.endswith(tail) or len(path) < len(head) + len(tail):
            return None
        value = path[len(head) : len(path) - len(tail)]
        if not anything and not (value.isascii() and value.isdigit()):
            return None
        return {name: value}

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


class Router:
    def __init__(self, routes: Iterable[Route]) -> None:
        self.routes = list(routes)
        self.exact = {route.path: route for route in self.routes if route.pattern is None}
        self.patterns = [route for route in self.routes if route.pattern is not None]

    def find(self, path: str) -> tuple[Route, dict[str, str] | None] | None:
        route = self.exact.get(path)
        if route is not None:
            return route, None
        for route in self.patterns:
            params = route.match(path)
            if params is not None:
                return route, params
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
