"""The few raw-ASGI helpers the hot paths use instead of a framework's request/response objects."""

from __future__ import annotations

import contextlib
import json
import re
from typing import Any

import orjson

from app.http.asgi import ASGIApp, Headers, Message, Receive, Scope, Send
from app.service.errors import BadRequest, PayloadTooLarge, ProxyError

__all__ = ["ASGIApp", "Headers", "Message", "Receive", "Scope", "Send"]

JSON_HEADERS: Headers = [(b"content-type", b"application/json")]


def header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The whole request body; `PayloadTooLarge` as soon as it is known to exceed `limit`."""
    declared = header(scope, b"content-length")
    if declared is not None:
        declared = declared.strip(b" \t")  # optional whitespace around a field value is legal (RFC 9110 §5.5)
        if not declared.isdigit():
            raise BadRequest(f"Content-Length must be an integer, got {declared!r}", param="Content-Length")
        if int(declared) > limit:
            raise PayloadTooLarge(f"the request body is {int(declared)} bytes; the limit is {limit} (max_body_bytes)")
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"the request body exceeds {limit} bytes (max_body_bytes)")
        chunks.append(chunk)
        if not message.get("more_body"):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


#: Values (separators and containers) a JSON request body may hold: parsing one costs memory and event
#: loop time by value, not by byte (a 31 MB `[{},{},...]` took ~1 GB and stalled every request for a
#: second). Far more than any inference request or batch of documents holds.
MAX_JSON_VALUES = 1 << 20


def json_kind(value: Any) -> str:
    """What JSON calls a decoded value's type (`null`, `array`, ...), for a message a client reads."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    kinds = {dict: "object", list: "array", str: "string", int: "number", float: "number"}
    return kinds.get(type(value), type(value).__name__)


def shown_value(value: Any, limit: int = 40) -> str:
    """A value a client sent, as a message quotes it: a string's repr, cut at `limit` characters (a 3,000
    character `after` is not echoed whole), anything else by its JSON kind."""
    if not isinstance(value, str):
        return json_kind(value)
    return repr(value[:limit]) + ("..." if len(value) > limit else "")


def check_json_cost(body: bytes) -> None:
    """`PayloadTooLarge` for a body whose JSON would hold more than `MAX_JSON_VALUES` values."""
    # A small body cannot hold that many: the hit path does not pay for the count.
    if len(body) > MAX_JSON_VALUES // 16:
        values = body.count(b",") + body.count(b"{") + body.count(b"[")
        if values > MAX_JSON_VALUES:
            raise PayloadTooLarge(
                f"the request body holds about {values} JSON values; the limit is {MAX_JSON_VALUES}: "
                f"split it (a batch of documents or lookups into several requests)"
            )


#: A run of digits that may be an integer past 64 bits, which orjson reads as a float (and writes as one):
#: 20 digits (past 2**64 - 1 from 18446744073709551616), or 19 after a minus (past -2**63).
LONG_NUMBER = re.compile(rb"[0-9]{20,}|-[0-9]{19}")


def check_integers(body: bytes, where: str) -> None:
    """`BadRequest` for a JSON body holding an integer past 64 bits, which orjson would read as a float, changing
    it without a word (and which datatrove's writer refuses); the common body, without 19 digits in a row, is
    not parsed again."""
    if LONG_NUMBER.search(body) is None:
        return

    def integer(text: str) -> int:
        try:
            value = int(text)
        except ValueError:  # past Python's own limit of digits
            value = 2**64
        if not -(2**63) <= value < 2**64:
            shown = text if len(text) <= 40 else text[:20] + "..." + text[-8:]
            raise BadRequest(f"{where} holds the integer {shown}, past 64 bits: no JSON writer here keeps it exact")
        return value

    with contextlib.suppress(ValueError):  # bad JSON otherwise: said by the caller's own parse
        json.loads(body, parse_int=integer)


def json_object(body: bytes) -> dict[str, Any]:
    """The body's JSON object: `PayloadTooLarge` past `MAX_JSON_VALUES` values, `BadRequest` for anything
    else than an object."""
    check_json_cost(body)
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"the request body must be a JSON object: {exc}") from None
    if not isinstance(value, dict):
        raise BadRequest(f"the request body must be a JSON object, got {json_kind(value)}")
    return value


class ClientGone(Exception):
    """The client disconnected before its request was read."""


async def send_bytes(send: Send, status: int, headers: Headers, body: bytes) -> None:
    """A whole answer; a 204 or a 304 goes without Content-Length or body (RFC 9110 §8.6, §15.4.5),
    whichever server writes it (uvicorn writes what it is given: a 304's body would be read by the
    client as the start of the next answer on the connection)."""
    if status == 204 or status == 304:
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": b""})
        return
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*headers, (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


def error_headers(error: ProxyError, extra_headers: Headers | None = None) -> Headers:
    """The headers of the proxy's own error answer (its body is `error.body()`), `Content-Length` aside."""
    headers = [*JSON_HEADERS, *error.headers, *(extra_headers or [])]
    if error.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    return headers


async def send_error(send: Send, error: ProxyError, extra_headers: Headers | None = None) -> None:
    """The proxy's own error, as the OpenAI envelope with the error's status."""
    await send_bytes(send, error.status, error_headers(error, extra_headers), error.body())


async def lifespan_noop(receive: Receive, send: Send) -> None:
    """Answer the lifespan protocol for an app that holds no resources."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
