"""Differential fuzzing of `app.http` against h11: generators, drivers and the comparison.

Used by tests/http/test_fuzz.py (a short run in `make test`) and bench/fuzz_http.py (`make fuzz`).

- Requests: `request_streams()` draws pipelined requests, each built from parts (valid,
  near-valid, hostile) and tagged with the odd features it uses; `run_server()` feeds the
  stream, cut at random points, to one `HTTPConnection` over a fake transport, with a recording
  ASGI app and fast handler; `h11_server()` parses the same bytes with h11; `compare_server()`
  says where they part ways, as `Finding`s.
- Responses: `response_streams()` draws answers (interim, framing, trailers, truncation, extra
  bytes); `run_client()` serves them from a loopback server to `HTTPClient`; `h11_client()`
  parses them with h11; `compare_client()` says where they part ways.

A finding carries the tags of the generated request (or response) where the two first
disagree, so that a known bug or an accepted leniency is named by (kind, tag).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote_to_bytes

import h11
from hypothesis import strategies as st

from app.http.asgi import Answer, Headers
from app.http.client import HTTPClient, HTTPClientError
from app.http.connection import HTTPConnection
from app.http.server import HTTPServer

FAST_PATHS = ("/fast", "/fastmiss")  # the fast handler answers the first and declines the second
HEAD_LIMIT = 64 * 1024  # h11's limit on a head, set to the server's own (MAX_HEADER_BYTES)


# -- findings ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Finding:
    """Where ours and h11 part ways, or an invariant ours broke.

    kind: `crash` (an exception out of data_received or logged by the server), `forwarded`
    (a request reached the app after a refusal or a close), `framing` (the answers written
    break HTTP: something after `connection: close`, an answer missing), `differs` (both
    accept, they see different requests), `lenient` (h11 refuses, ours accepts), `strict`
    (h11 accepts, ours refuses), `short-body` (the client returns a body cut short as complete),
    `keep-alive` (ours reads on where h11 closes after an answer), `closed` (the reverse).
    The client's are `client-crash` (an exception not the client's own, or a hang),
    `client-differs`, `client-lenient`, `client-strict`, and `short-body`.
    """

    kind: str
    part: Part  # the generated request or response where it happened
    detail: str


@dataclass(frozen=True)
class Part:
    """One generated request or response: its bytes, its one odd feature if any, and its tags."""

    data: bytes
    mutation: str | None
    tags: frozenset[str]  # the mutation, and valid features worth naming (http10, upgrade, trailers...)


def part_at(parts: list[Part], offset: int) -> Part:
    """The part that holds byte `offset` of the stream (the last one past the end)."""
    start = 0
    for part in parts:
        if offset < start + len(part.data):
            return part
        start += len(part.data)
    return parts[-1]


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({0, len(data), *(c for c in cuts if 0 < c < len(data))})
    return [data[a:b] for a, b in itertools.pairwise(points)] or [b""]


# -- generated requests ------------------------------------------------------------------------
#
# A request is valid but for at most one `mutation` (a near-valid or hostile feature), so that
# a finding's tags name its cause. Valid features worth naming (HTTP/1.0, Upgrade, trailers,
# optional whitespace...) are tagged too and combine freely.

_TARGET_MUTATIONS: dict[str, list[bytes]] = {
    "target-asterisk": [b"*"],
    "target-absolute": [b"http://example.com/x?y=1", b"http://example.com"],
    "target-authority": [b"example.com:443"],
    "target-fragment": [b"/a#frag", b"/a?b=1#frag"],
    "target-non-ascii": [b"/caf\xc3\xa9", b"/\xff"],
    "target-space": [b"/a b", b"/a\tb"],
    "target-nul": [b"/a\x00b"],
    "target-empty": [b""],
}
_HEADER_MUTATIONS = [
    "ows",
    "obs-fold",
    "nul",
    "bare-cr",
    "del",
    "ctl",
    "obs-text",
    "space-before-colon",
    "empty-name",
    "bad-name",
    "no-colon",
]
_CL_MUTATIONS = ["cl-ows", "cl-sign", "cl-list", "cl-dup", "cl-conflict", "cl-invalid", "cl-huge"]
_TE_MUTATIONS = [
    "te-and-cl",
    "te-gzip-chunked",
    "te-chunked-not-last",
    "te-identity",
    "te-double",
    "te-multi",
    "te-invalid",
]
_CHUNK_MUTATIONS = ["chunk-ext-ws", "chunk-bad-end", "chunk-huge", "chunk-invalid", "chunk-size-ws", "chunk-bare-lf"]
MUTATIONS = [
    "method-case",
    "method-unknown",
    "method-invalid",
    *_TARGET_MUTATIONS,
    "version-odd",
    "version-case",
    "no-host",
    "host-dup",
    *_HEADER_MUTATIONS,
    *_CL_MUTATIONS,
    *_TE_MUTATIONS,
    *_CHUNK_MUTATIONS,
    "bare-lf",
    "leading-crlf",
]
_METHODS = [b"GET", b"POST", b"POST", b"PUT", b"HEAD", b"DELETE", b"OPTIONS", b"PATCH", b"CONNECT", b"TRACE"]
_PATHS = [b"/", b"/fast", b"/fast", b"/fastmiss", b"/v1/chat/completions", b"/a/b", b"/f%61st", b"/%2e%2e/x", b"//x"]
_SMUGGLED = b"GET /smuggled HTTP/1.1\r\nHost: a\r\n\r\n"


def _odd_header(name: bytes, value: bytes, mutation: str) -> bytes:
    return {
        "ows": name + b":" + value + b" \t ",
        "obs-fold": name + b": " + value + b"\r\n  more",
        "nul": name + b": a\x00" + value,
        "bare-cr": name + b": a\r" + value,
        "del": name + b": a\x7f" + value,
        "ctl": name + b": a\x01" + value,
        "obs-text": name + b": caf\xe9 \xff" + value,
        "space-before-colon": name + b" : " + value,
        "empty-name": b": " + value,
        "bad-name": name + b"(x): " + value,
        "no-colon": name + b" " + value,
    }[mutation]


@st.composite
def header_lines(draw: st.DrawFn, mutation: str | None) -> tuple[list[bytes], set[str]]:
    """Extra header lines (without their line ends); one of them odd if `mutation` says so."""
    lines: list[bytes] = []
    tags: set[str] = set()
    names = st.sampled_from([b"X-Doc-Id", b"x-rollout-idx", b"Authorization", b"Content-Type", b"X-A", b"Y"])
    values = st.sampled_from([b"abc", b"1", b"Bearer k", b"application/json", b"a, b", b"", b"a  b"])
    for _ in range(draw(st.integers(0, 3))):
        # Leading whitespace is part of no value (both drop it); trailing is the `ows` mutation.
        lines.append(draw(names) + b":" + draw(st.sampled_from([b" ", b"", b"\t", b"   "])) + draw(values))
    if mutation in _HEADER_MUTATIONS:
        lines.append(_odd_header(draw(names), draw(values), mutation))
        tags.add(mutation)
    return lines, tags


@st.composite
def chunked_body(draw: st.DrawFn, body: bytes, mutation: str | None) -> tuple[bytes, set[str]]:
    """`body` in chunks (valid variants: case, leading zeros, extensions, trailers), maybe one odd."""
    tags: set[str] = set()
    out: list[bytes] = []
    rest = body
    bad_end = b""
    if mutation == "chunk-bad-end" and rest:
        bad_end = draw(st.sampled_from([b"\n", b"", b"xx"]))
        tags.add(mutation)
    while rest:
        n = draw(st.integers(1, len(rest)))
        piece, rest = rest[:n], rest[n:]
        size = b"%x" % n
        variant = draw(st.sampled_from([None] * 6 + ["chunk-upper", "chunk-leading-zero", "chunk-ext", "chunk-ext"]))
        if variant == "chunk-upper":
            size = b"%X" % n
        elif variant == "chunk-leading-zero":
            size = b"000" + size
        elif variant == "chunk-ext":
            size += draw(st.sampled_from([b";a=b", b';a="x y"', b";a", b";a=b;c=d"]))
        if variant is not None:
            tags.add(variant)
        if mutation == "chunk-ext-ws" and variant is None:
            size += b" ;a=b"
            tags.add(mutation)
        end = b"\r\n"
        if bad_end and not rest:
            end, bad_end = bad_end, b""
        out.append(size + b"\r\n" + piece + end)
    if mutation in ("chunk-huge", "chunk-invalid", "chunk-size-ws", "chunk-bare-lf"):
        out.append(
            {
                "chunk-huge": b"ffffffffffffffffffff\r\n",
                "chunk-invalid": b"0x5\r\nhello\r\n",
                "chunk-size-ws": b" 5 \r\nhello\r\n",
                "chunk-bare-lf": b"5\nhello\n",
            }[mutation]
        )
        tags.add(mutation)
    last = b"0\r\n"
    if draw(st.integers(0, 4)) == 0:
        tags.add("trailers")
        name = draw(st.sampled_from([b"X-Doc-Id", b"Content-Length", b"Authorization", b"X-T"]))
        last += name + b": " + draw(st.sampled_from([b"1", b"t", b"Bearer k"])) + b"\r\n"
    return b"".join(out) + last + b"\r\n", tags


_ODD_LENGTHS: dict[str, list[str]] = {
    "cl-ows": ["{n} ", "{n}\t"],
    "cl-sign": ["+{n}"],
    "cl-list": ["{n}, {n}", "{n},{n}"],
    "cl-dup": ["{n}|{n}"],
    "cl-conflict": ["{n}|{m}", "{n}, {m}"],
    "cl-invalid": ["-1", "0x5", "5a", "", "1 2"],
    "cl-huge": ["99999999999999999999999"],
}
_ODD_TE: dict[str, list[bytes]] = {
    "te-gzip-chunked": [b"Transfer-Encoding: gzip, chunked"],
    "te-chunked-not-last": [b"Transfer-Encoding: chunked, gzip"],
    "te-identity": [b"Transfer-Encoding: identity"],
    "te-double": [b"Transfer-Encoding: chunked, chunked"],
    "te-multi": [b"Transfer-Encoding: gzip", b"Transfer-Encoding: chunked"],
    "te-invalid": [b"Transfer-Encoding: xchunked"],
}


@st.composite
def framed_body(draw: st.DrawFn, mutation: str | None) -> tuple[list[bytes], bytes, set[str]]:
    """Framing header lines and the body bytes that follow the head."""
    body = draw(st.sampled_from([b"", b"hello", b'{"model":"m","messages":[]}', b"a\r\n\r\nb", _SMUGGLED]))
    if draw(st.booleans()):
        body = draw(st.binary(max_size=24))
    tags: set[str] = set()
    n = len(body)
    if mutation in _ODD_LENGTHS:
        tags.add(mutation)
        form = draw(st.sampled_from(_ODD_LENGTHS[mutation])).format(n=n, m=n + 1)
        return [b"Content-Length: " + v.encode() for v in form.split("|")], body, tags
    if mutation in _TE_MUTATIONS:
        chunked, chunk_tags = draw(chunked_body(body, None))
        tags |= chunk_tags | {mutation}
        if mutation == "te-and-cl":
            return [b"Transfer-Encoding: chunked", b"Content-Length: %d" % n], chunked, tags
        return _ODD_TE[mutation], chunked, tags
    framing = draw(st.sampled_from(["none", "cl", "cl", "chunked", "chunked", "cl-mismatch"]))
    if mutation in _CHUNK_MUTATIONS:
        framing = "chunked"
    if framing == "none":
        return [], b"", tags
    if framing == "chunked":
        chunked, chunk_tags = draw(chunked_body(body, mutation))
        te = draw(st.sampled_from([b"chunked"] * 4 + [b"Chunked", b"CHUNKED"]))
        if te != b"chunked":
            tags.add("te-variant")
        return [b"Transfer-Encoding: " + te], chunked, tags | chunk_tags
    declared = str(n)
    if framing == "cl-mismatch":  # valid bytes, wrongly framed: both must cut them the same way
        tags.add("cl-mismatch")
        declared = str(max(0, n + draw(st.sampled_from([-3, -1, 1, 5]))))
    variant = draw(st.sampled_from(["{}"] * 6 + ["  {}", "00{}"]))
    if variant != "{}":
        tags.add("cl-variant")
    return [b"Content-Length: " + variant.format(declared).encode()], body, tags


@st.composite
def requests(draw: st.DrawFn) -> Part:
    """One request: valid, or valid but for one `mutation`."""
    mutation = draw(st.sampled_from([""] * len(MUTATIONS) + MUTATIONS))
    tags: set[str] = {mutation} if mutation else set()
    method = draw(st.sampled_from(_METHODS))
    if mutation == "method-case":
        method = method.lower()
    elif mutation == "method-unknown":
        method = draw(st.sampled_from([b"M-SEARCH", b"FOO", b"PROPFIND"]))
    elif mutation == "method-invalid":
        method = draw(st.sampled_from([b"G(T", b"GE T", b"G\x00T"]))
    if method in (b"CONNECT", b"TRACE"):
        tags.add(method.decode().lower())
    if mutation in _TARGET_MUTATIONS:
        target = draw(st.sampled_from(_TARGET_MUTATIONS[mutation]))
    else:
        target = draw(st.sampled_from(_PATHS))
        if draw(st.booleans()):
            target += draw(st.sampled_from([b"?a=1", b"?a=1&b=%20", b"?x", b"?q=a+b", b"?", b"?a?b"]))
        if b"fast" in target and not mutation.startswith("method") and draw(st.integers(0, 3)):
            method = b"POST"
    version = draw(st.sampled_from([b"HTTP/1.1"] * 5 + [b"HTTP/1.0"]))
    if mutation == "version-odd":
        version = draw(st.sampled_from([b"HTTP/1.2", b"HTTP/2.0", b"HTTP/0.9", b"HTTP/1.10", b"HTTP/1"]))
    elif mutation == "version-case":
        version = b"http/1.1"
    if version == b"HTTP/1.0":
        tags.add("http10")
    lines: list[bytes] = []
    if mutation == "host-dup":
        lines += [b"Host: a", b"Host: b"]
    elif mutation != "no-host":
        lines.append(draw(st.sampled_from([b"Host: example.com", b"Host: example.com:80", b"Host:"])))
    frame_lines, body, frame_tags = draw(framed_body(mutation))
    extra, extra_tags = draw(header_lines(mutation))
    tags |= frame_tags | extra_tags
    lines += frame_lines + extra
    for name, value, tag in draw(
        st.lists(
            st.sampled_from(
                [
                    (b"Connection", b"close", "connection-close"),
                    (b"Connection", b"keep-alive", None),
                    (b"Connection", b"Upgrade", "upgrade"),
                    (b"Upgrade", b"websocket", "upgrade"),
                    (b"Upgrade", b"h2c", "upgrade"),
                    (b"Expect", b"100-continue", "expect"),
                    (b"Expect", b"something-else", "expect-odd"),
                ]
            ),
            max_size=2,
        )
    ):
        lines.append(name + b": " + value)
        if tag:
            tags.add(tag)
    lines = draw(st.permutations(lines))
    eol = b"\n" if mutation == "bare-lf" else b"\r\n"
    head = method + b" " + target + b" " + version + eol + b"".join(line + eol for line in lines) + eol
    if mutation == "leading-crlf":
        head = b"\r\n" + head
    if (b"Upgrade" in head or method == b"CONNECT") and body:
        tags.add("upgrade-body")
    return Part(head + body, mutation or None, frozenset(tags))


@st.composite
def request_streams(draw: st.DrawFn) -> tuple[list[Part], list[bytes]]:
    """1-4 pipelined requests, maybe garbage after them, cut into the pieces `data_received` gets."""
    parts = draw(st.lists(requests(), min_size=1, max_size=4))
    if draw(st.integers(0, 8)) == 0:
        garbage = draw(st.sampled_from([b"\x00\x01garbage\r\n\r\n", b"\r\n", b"HTTP/1.1 200 OK\r\n\r\n"]))
        parts.append(Part(garbage, "garbage", frozenset({"garbage"})))
    data = b"".join(p.data for p in parts)
    cuts = draw(st.lists(st.integers(0, len(data)), max_size=6))
    return parts, split(data, cuts)


# -- what a request looks like to each side ----------------------------------------------------


@dataclass
class Seen:
    """One request as the app (or the fast handler) or h11 saw it."""

    method: bytes
    path: bytes  # the raw path, percent-escapes kept
    query: bytes | None  # None: unknown (the fast handler is not told)
    headers: list[tuple[bytes, bytes]]
    body: bytes = b""
    complete: bool = False
    via: str = "app"
    written_before: int = 0  # bytes the server had written when this request reached the app
    closed_before: bool = False

    def view(self, *, fast: bool = False) -> tuple[Any, ...]:
        path = unquote_to_bytes(self.path) if fast else self.path
        # h11 lower-cases Transfer-Encoding's value (the coding names are case-insensitive)
        headers = [(n, v.lower() if n == b"transfer-encoding" else v) for n, v in self.headers]
        return (self.method, path, None if fast else self.query, headers, self.body)


def split_target(target: bytes) -> tuple[bytes, bytes]:
    """(path, query) of a request target, as a server hands them to an app: fragment dropped."""
    if b"://" in target and not target.startswith(b"/"):
        rest = target.split(b"://", 1)[1]
        slash = min((i for i in (rest.find(b"/"), rest.find(b"?")) if i >= 0), default=len(rest))
        target = rest[slash:]
    target = target.split(b"#", 1)[0]
    path, _, query = target.partition(b"?")
    return path or b"/", query


@dataclass
class ServerOutcome:
    seen: list[Seen] = field(default_factory=list)
    refused: bool = False  # an error answer (>= 400) was written
    error: str = ""  # h11's error, or ours' crash
    boundaries: list[int] = field(default_factory=list)  # h11: where each request began
    end_offset: int = 0  # h11: where it stopped (error or need data)
    stopped_on_close: bool = False  # h11: a request said the connection closes after its answer
    written: bytes = b""
    closed: bool = False
    crash: str = ""


def h11_server(data: bytes) -> ServerOutcome:
    """What h11 makes of a request stream, answering each request as it completes."""
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=HEAD_LIMIT)
    conn.receive_data(data)
    out = ServerOutcome(boundaries=[0])
    current: Seen | None = None

    def offset() -> int:
        return len(data) - len(conn.trailing_data[0])

    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError as exc:
            out.error = str(exc)
            out.refused = True
            break
        if event is h11.NEED_DATA or event is h11.PAUSED:
            break
        if isinstance(event, h11.Request):
            path, query = split_target(bytes(event.target))
            current = Seen(bytes(event.method), path, query, [(bytes(n), bytes(v)) for n, v in event.headers])
            out.seen.append(current)
        elif isinstance(event, h11.Data):
            assert current is not None
            current.body += bytes(event.data)
        elif isinstance(event, h11.EndOfMessage):
            assert current is not None
            current.complete = True
            status = 405 if current.method == b"CONNECT" else 200  # a 2xx would switch protocols
            conn.send(h11.Response(status_code=status, headers=[(b"content-length", b"0")]))
            conn.send(h11.EndOfMessage())
            if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                out.stopped_on_close = True
                break
            conn.start_next_cycle()
            out.boundaries.append(offset())
        else:
            break
    out.end_offset = offset()
    return out


class FakeTransport(asyncio.Transport):
    """A transport that records what the server writes and how it drives the connection."""

    def __init__(self, protocol: HTTPConnection) -> None:
        super().__init__()
        self.protocol = protocol
        self.written = bytearray()
        self.paused = False
        self.closed = False
        self.eof = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += data

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 40000), "sockname": ("127.0.0.1", 8080)}.get(name, default)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            asyncio.get_running_loop().call_soon(self.protocol.connection_lost, None)

    def abort(self) -> None:
        self.close()

    def write_eof(self) -> None:
        self.eof = True

    def can_write_eof(self) -> bool:
        return True

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def is_reading(self) -> bool:
        return not self.paused

    def get_write_buffer_size(self) -> int:
        return 0


class _Recorder:
    """The app and fast handler behind the server: they record what they see."""

    def __init__(self) -> None:
        self.seen: list[Seen] = []
        self.transport: FakeTransport | None = None

    def _note(self, seen: Seen) -> Seen:
        assert self.transport is not None
        seen.written_before = len(self.transport.written)
        seen.closed_before = self.transport.closed
        self.seen.append(seen)
        return seen

    async def app(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        seen = self._note(Seen(scope["method"].encode(), scope["raw_path"], scope["query_string"], []))
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left, or the server refused the rest
            seen.body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        seen.headers = list(scope["headers"])  # at the end: trailers must not have joined them
        seen.complete = True
        # No body: the answers to HEAD and GET look alike, so the output parses without knowing which.
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})

    def fast(self, path: str, headers: Headers, body: bytes, extensions: dict[str, Any]) -> Answer | None:
        if path != "/fast":
            return None
        raw = path.encode("latin-1")
        self._note(Seen(b"POST", raw, None, list(headers), body, complete=True, via="fast"))
        return Answer(200, [], b"")


class _ServerErrors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


async def _settle() -> None:
    for _ in range(40):  # enough turns for an app task to read its body and answer
        await asyncio.sleep(0)


async def _run_server(pieces: list[bytes]) -> ServerOutcome:
    recorder = _Recorder()
    server = HTTPServer(recorder.app, port=0, fast=recorder.fast, fast_paths=FAST_PATHS)
    conn = HTTPConnection(server)
    transport = recorder.transport = FakeTransport(conn)
    conn.connection_made(transport)
    out = ServerOutcome()
    for piece in pieces:
        await _settle()
        if transport.closed or transport.paused:
            break  # a real transport would not deliver more
        try:
            conn.data_received(piece)
        except Exception as exc:
            out.crash = f"{type(exc).__name__}: {exc}"
            break
    await _settle()
    for task in list(server.tasks):
        task.cancel()
    await _settle()
    out.seen = recorder.seen
    out.written = bytes(transport.written)
    out.closed = transport.closed
    return out


def run_server(pieces: list[bytes]) -> ServerOutcome:
    """Feed `pieces` to one server connection over a fake transport; what its app and handler saw."""
    errors = _ServerErrors()
    logger = logging.getLogger("app.http")
    logger.addHandler(errors)
    try:
        out = asyncio.run(_run_server(pieces))
    finally:
        logger.removeHandler(errors)
    if errors.messages and not out.crash:
        out.crash = "logged: " + "; ".join(errors.messages)
    return out


_STATUS = re.compile(rb"HTTP/1\.[01] (\d{3})")


def parse_answers(written: bytes) -> tuple[list[tuple[int, bool]], bytes]:
    """The server's answers: (status, says connection: close) each, and any bytes not an answer."""
    answers: list[tuple[int, bool]] = []
    rest = written
    while rest:
        head, sep, after = rest.partition(b"\r\n\r\n")
        match = _STATUS.match(head)
        if not sep or not match:
            return answers, rest
        lines = head.lower().split(b"\r\n")
        length = next((int(line.split(b":", 1)[1]) for line in lines if line.startswith(b"content-length:")), 0)
        answers.append((int(match.group(1)), b"connection: close" in lines))
        rest = after[length:]
    return answers, b""


def compare_server(parts: list[Part], ours: ServerOutcome, ref: ServerOutcome) -> list[Finding]:
    """Where the server and h11 part ways on one request stream."""
    findings: list[Finding] = []

    data = b"".join(p.data for p in parts)

    def at(index: int) -> Part:
        offset = ref.boundaries[max(0, index)] if index < len(ref.boundaries) else ref.end_offset
        part = part_at(parts, offset)
        starts = set(itertools.accumulate((len(p.data) for p in parts), initial=0))
        if offset in starts or offset >= len(data):
            return part
        # h11's request began inside a generated one (a body swallowed the next request's
        # start): what is left is garbage to both parsers, whatever it was generated as.
        return Part(data[offset:], "misaligned", part.tags - {part.mutation} | {"misaligned"})

    if ours.crash:
        findings.append(Finding("crash", at(len(ours.seen)), ours.crash))
    answers, junk = parse_answers(ours.written)
    real = [a for a in answers if a[0] != 100]
    if junk:
        findings.append(Finding("framing", at(0), f"unparseable output {junk[:80]!r}"))
    for i, (_, close) in enumerate(real):
        if close and i + 1 < len(real):
            findings.append(Finding("framing", at(i + 1), f"answers after one with connection: close: {real}"))
            break
    refusal = next((i for i, a in enumerate(real) if a[0] >= 400), None)
    ours.refused = refusal is not None
    refusal_at = ours.written.find(b"HTTP/1.1 4") if ours.refused else -1
    for i, seen in enumerate(ours.seen):
        if seen.closed_before or (refusal_at >= 0 and seen.written_before > refusal_at):
            why = "closed" if seen.closed_before else "refused"
            findings.append(Finding("forwarded", at(i), f"request {i} reached the {seen.via} after it {why}"))
    complete = [s for s in ours.seen if s.complete]
    if len(real) < len(complete) and not ours.crash:
        findings.append(Finding("framing", at(len(real)), f"{len(complete)} requests, {len(real)} answers"))
    theirs = [s for s in ref.seen if s.complete]
    for i, (mine, them) in enumerate(zip(complete, theirs, strict=False)):
        fast = mine.via == "fast"
        if mine.view(fast=fast) != them.view(fast=fast):
            findings.append(Finding("differs", at(i), f"request {i}: ours {mine.view()} h11 {them.view()}"))
            return findings
    n = min(len(complete), len(theirs))
    if len(complete) > len(theirs):
        extra = complete[n].view()
        if ref.refused:
            findings.append(Finding("lenient", at(n), f"h11: {ref.error}; ours took request {n}: {extra}"))
        elif ref.stopped_on_close:
            findings.append(Finding("keep-alive", at(n - 1), f"request {n} came after h11 closed: {extra}"))
        else:
            findings.append(Finding("differs", at(n), f"ours ended request {n} where h11 waits for more: {extra}"))
    elif len(complete) < len(theirs):
        if ours.refused:
            findings.append(Finding("strict", at(n), f"ours refused request {n} h11 took: {theirs[n].view()}"))
        elif ours.closed and not ours.crash and not ref.stopped_on_close:
            findings.append(Finding("closed", at(n - 1), f"ours closed before request {n}: {theirs[n].view()}"))
        elif not ours.crash and not ref.stopped_on_close:
            findings.append(Finding("differs", at(n), f"h11 took request {n}, ours never did: {theirs[n].view()}"))
    elif ref.refused and not ours.refused and len(ours.seen) > n and len(ref.seen) <= n:
        findings.append(Finding("lenient", at(n), f"h11: {ref.error}; ours began request {n}: {ours.seen[n].view()}"))
    return findings


# -- generated responses -----------------------------------------------------------------------


_STATUS_MUTATIONS: dict[str, list[bytes]] = {
    "status-invalid": [b"HTTP/2 200 OK", b"HTTP/1.1  200 OK", b"http/1.1 200 OK", b"HTTP/1.1 20 X", b"HTTP/1.1 2000 X"],
    "status-odd": [b"HTTP/1.1 600 Odd", b"HTTP/1.1 999 X", b"HTTP/1.1 099 X", b"HTTP/1.1 200 caf\xe9"],
    "status-101": [b"HTTP/1.1 101 Switching Protocols"],
}
RESPONSE_MUTATIONS = [*_STATUS_MUTATIONS, *_HEADER_MUTATIONS, *_CL_MUTATIONS, *_TE_MUTATIONS, *_CHUNK_MUTATIONS]


@st.composite
def responses(draw: st.DrawFn) -> Part:
    """One answer (interim answers, status line, headers, framing, trailers), odd in at most one part."""
    mutation = draw(st.sampled_from([None] * len(RESPONSE_MUTATIONS) + RESPONSE_MUTATIONS))
    tags: set[str] = {mutation} if mutation else set()
    out = b""
    for _ in range(draw(st.integers(0, 3)) // 2):
        interim = draw(st.sampled_from([b"100 Continue", b"103 Early Hints", b"102 Processing", b"199 Odd"]))
        tags.add("interim")
        out += b"HTTP/1.1 " + interim + b"\r\n" + draw(st.sampled_from([b"", b"Link: </a>\r\n"])) + b"\r\n"
    if mutation in _STATUS_MUTATIONS:
        status_line = draw(st.sampled_from(_STATUS_MUTATIONS[mutation]))
    else:
        status_line = draw(
            st.sampled_from(
                [b"HTTP/1.1 200 OK"] * 6
                + [b"HTTP/1.1 404 Not Found", b"HTTP/1.1 500 Oops", b"HTTP/1.1 201 Created", b"HTTP/1.0 200 OK"]
                + [b"HTTP/1.1 204 No Content", b"HTTP/1.1 304 Not Modified", b"HTTP/1.1 200 ", b"HTTP/1.1 200"]
            )
        )
    if status_line[9:12] in (b"204", b"304"):
        tags.add("status-no-body")
    if status_line.startswith(b"HTTP/1.0"):
        tags.add("http10")
    lines, extra_tags = draw(header_lines(mutation))
    frame_lines, framed, frame_tags = draw(framed_body(mutation))
    tags |= extra_tags | frame_tags
    if not frame_lines:
        tags.add("close-delimited")
        framed = draw(st.sampled_from([b"", b"hello", b'{"id":"x","choices":[]}']))
    lines = draw(st.permutations([*lines, *frame_lines, b"Content-Type: text/plain"]))
    out += status_line + b"\r\n" + b"".join(line + b"\r\n" for line in lines) + b"\r\n" + framed
    return Part(out, mutation, frozenset(tags))


@st.composite
def response_streams(draw: st.DrawFn) -> tuple[bytes, list[Part], list[bytes]]:
    """A request method, one answer (maybe cut short, maybe with bytes after it), in pieces."""
    method = draw(st.sampled_from([b"GET", b"GET", b"POST", b"HEAD"]))
    part = draw(responses())
    if method == b"HEAD":
        part = Part(part.data, part.mutation, part.tags | {"head"})
    parts = [part]
    data = part.data
    if draw(st.integers(0, 5)) == 0:
        cut = draw(st.integers(0, max(0, len(data) - 1)))
        data = data[:cut]
        parts = [Part(data, part.mutation or "truncated", part.tags | {"truncated"})]
    elif draw(st.integers(0, 5)) == 0:
        extra = draw(st.sampled_from([b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nX", b"junk", b"\r\n"]))
        parts.append(Part(extra, "extra", frozenset({"extra"})))
        data += extra
    cuts = draw(st.lists(st.integers(0, len(data)), max_size=5))
    return method, parts, split(data, cuts)


@dataclass(frozen=True)
class ClientOutcome:
    status: int = 0
    headers: tuple[tuple[bytes, bytes], ...] = ()
    body: bytes = b""
    error: str = ""  # the exception, or h11's complaint

    def view(self) -> tuple[int, tuple[tuple[bytes, bytes], ...], bytes]:
        headers = tuple((n, v.lower() if n == b"transfer-encoding" else v) for n, v in self.headers)
        return self.status, headers, self.body


def h11_client(method: bytes, data: bytes) -> ClientOutcome:
    """What h11 makes of `data` as the answer to `method /`, the server closing after it."""
    conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=HEAD_LIMIT)
    conn.send(h11.Request(method=method, target=b"/", headers=[(b"host", b"a"), (b"content-length", b"0")]))
    conn.send(h11.EndOfMessage())
    conn.receive_data(data)
    conn.receive_data(b"")
    status, headers, body = 0, (), b""
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError as exc:
            return ClientOutcome(status, headers, body, error=str(exc) or type(exc).__name__)
        if isinstance(event, h11.Response):
            status, headers = event.status_code, tuple((bytes(n), bytes(v)) for n, v in event.headers)
        elif isinstance(event, h11.Data):
            body += bytes(event.data)
        elif isinstance(event, h11.EndOfMessage):
            return ClientOutcome(status, headers, body)
        elif isinstance(event, h11.ConnectionClosed) or event is h11.NEED_DATA or event is h11.PAUSED:
            return ClientOutcome(status, headers, body, error=f"ended with {event!r}")


async def fetch(client: HTTPClient, method: str, url: str) -> ClientOutcome:
    """The one place that speaks the client's API: status, headers and the whole body of one answer."""
    async with client.request(method, url) as response:
        body = await response.read()
    return ClientOutcome(response.status, tuple(response.headers), body)


async def _run_client(method: bytes, pieces: list[bytes], read_timeout: float) -> ClientOutcome:
    handlers: set[asyncio.Task[Any]] = set()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        handlers.add(task)
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            await reader.readuntil(b"\r\n\r\n")
            for piece in pieces:
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(0)
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = HTTPClient(connect_timeout=5.0, read_timeout=read_timeout)
    try:
        return await fetch(client, method.decode(), f"http://127.0.0.1:{port}/")
    except HTTPClientError as exc:
        return ClientOutcome(error=f"{type(exc).__name__}: {exc}")
    except Exception as exc:  # not one of the client's errors: a crash
        return ClientOutcome(error=f"crash {type(exc).__name__}: {exc}")
    finally:
        await client.close()
        if handlers:  # done writing and closed, before the loop ends
            await asyncio.wait(handlers, timeout=5.0)
        server.close()
        await server.wait_closed()


def run_client(method: bytes, pieces: list[bytes], *, read_timeout: float = 5.0) -> ClientOutcome:
    """Serve `pieces` from a loopback server (then close) to `HTTPClient`; what it made of them."""
    return asyncio.run(_run_client(method, pieces, read_timeout))


def compare_client(parts: list[Part], ours: ClientOutcome, ref: ClientOutcome) -> list[Finding]:
    """Where the client and h11 part ways on one answer."""
    part = parts[0]
    if ours.error.startswith("crash") or "ReadTimeout" in ours.error:
        return [Finding("client-crash", part, f"ours: {ours.error}; h11: {ref.view() if not ref.error else ref.error}")]
    if not ref.error:
        if ours.error:
            return [Finding("client-strict", part, f"ours: {ours.error}; h11 took {ref.view()}")]
        if ours.view() != ref.view():
            return [Finding("client-differs", part, f"ours {ours.view()}; h11 {ref.view()}")]
        return []
    if ours.error:
        return []
    if "without sending complete message body" in ref.error or "ended with" in ref.error:
        return [Finding("short-body", part, f"ours returned {ours.view()} as complete; h11: {ref.error}")]
    return [Finding("client-lenient", part, f"ours took {ours.view()}; h11: {ref.error}")]
