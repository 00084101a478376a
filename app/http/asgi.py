"""The port between `app.http` and the application it serves: ASGI 3 types, plus the fast path's.

The server runs any ASGI 3 app. Two optional callables narrow the rest of the contact:

- a `FastHandler` is called synchronously, inside the protocol callback, with a whole
  `POST` to one of its paths (before any task, scope or ASGI message exists); it returns a
  complete `Answer` or None, and then the request goes to the ASGI app like any other, with
  what the handler left in `extensions` (the scope's `extensions`);
- an `ErrorRenderer` turns the server's own refusals (a malformed request, a head over
  its limits, an app that failed before answering) into the app's error format.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, NamedTuple

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]


class CutConnection(Exception):
    """Raised by an app mid-answer to end the connection without the answer's end, on purpose (its own
    source broke off, and the client must see a cut): the server cuts it and logs nothing; the app said why."""


class Answer(NamedTuple):
    """A complete answer from a fast handler; the server adds the framing (length, date, connection)."""

    status: int
    headers: Headers
    body: bytes


#: (path, headers, body, extensions) -> the answer, or None: the ASGI app answers instead.
FastHandler = Callable[[str, Headers, bytes, dict[str, Any]], "Answer | None"]

#: (status, message) -> (content type, body) of the server's own error answers.
ErrorRenderer = Callable[[int, str], tuple[bytes, bytes]]


def plain_error(status: int, message: str) -> tuple[bytes, bytes]:
    """The default `ErrorRenderer`: the message as plain text."""
    return b"text/plain; charset=utf-8", message.encode("utf-8", "replace") + b"\n"
