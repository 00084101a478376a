"""The proxy's log: set up once by `inferproxy serve`, one line per request.

A request's line is at INFO on the `inferproxy.access` logger: method, route, status, `X-Cache`,
rank, doc id, replica and duration. Cache hits get one line per `log_hits_every` (a replay storm
answers tens of thousands a second); every other request gets its own. Never `Authorization`, never
a body. With `log_format = "json"` every line, these and the rest, is one JSON object.

What a client sends (a path, a doc id) may hold anything: control characters, ANSI escapes, U+2028
or U+0085 (which `str.splitlines()` and some log shippers split on). No line is ever cut or forged
by them: text lines show them as escapes (`\x0a`), JSON lines as JSON escapes.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import orjson

ACCESS = logging.getLogger("inferproxy.access")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

_LINE_BREAKERS = [*range(0x7F, 0xA0), 0x2028, 0x2029]  # C1 controls, line and paragraph separators
#: In a JSON line: what orjson leaves as it is (it escapes only what JSON requires, below 0x20).
_JSON_ESCAPES = {c: f"\\u{c:04x}" for c in _LINE_BREAKERS}
#: In a text line: every control character and separator.
_TEXT_ESCAPES = {c: f"\\x{c:02x}" for c in range(0x20)} | {c: f"\\u{c:04x}" for c in _LINE_BREAKERS}


class TextFormatter(logging.Formatter):
    """The text line, with what could break or forge it escaped (a traceback after it keeps its lines)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return super().formatMessage(record).translate(_TEXT_ESCAPES)


class JSONFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, the request's fields, the traceback."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        request = getattr(record, "request", None)
        if request is not None:
            line.update(request)
        if record.exc_info:
            line["traceback"] = self.formatException(record.exc_info)
        return orjson.dumps(line).decode().translate(_JSON_ESCAPES)


def configure(level: str, log_format: str) -> None:
    # What no line here shows, not looked up per line (the logging HOWTO's "Optimization"): the caller's
    # frame costs ~2 µs of each request line, at a line per generation.
    logging._srcfile = None
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JSONFormatter() if log_format == "json" else TextFormatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    if level != "debug":  # botocore says at INFO where it found its endpoint and keys, on every client it makes
        for chatty in ("botocore", "aiobotocore"):
            logging.getLogger(chatty).setLevel(logging.WARNING)


class RequestLog:
    """Writes the request lines; `hit_due()` says whether the next hit gets one (every `hits_every`-th)."""

    def __init__(self, hits_every: int) -> None:
        self.hits_every = hits_every
        # Counted down per hit: the hit that brings it to 0 is logged. With hits_every = 0 it starts
        # below zero and never reaches it.
        self._countdown = hits_every if hits_every > 0 else -1

    def hit_due(self) -> bool:
        """Whether the next hit is to be logged (without counting it)."""
        return self._countdown == 1 and ACCESS.isEnabledFor(logging.INFO)

    def hit(self) -> bool:
        """Count a hit; True if it is to be logged."""
        self._countdown -= 1
        if self._countdown != 0:
            return False
        self._countdown = self.hits_every
        return ACCESS.isEnabledFor(logging.INFO)

    @staticmethod
    def enabled() -> bool:
        return ACCESS.isEnabledFor(logging.INFO)

    @staticmethod
    def write(
        method: str,
        path: str,
        status: int,
        outcome: str,
        headers: list[tuple[bytes, bytes]],
        replica: str | None,
        seconds: float,
    ) -> None:
        """The line of one request (`status` 499: the client left before an answer was started)."""
        rank = doc_id = None
        for name, value in headers:  # UTF-8 as the cache keys them; anything else shown as escapes
            if name == b"x-rank":
                rank = value.decode("utf-8", "backslashreplace")
            elif name == b"x-doc-id":
                doc_id = value.decode("utf-8", "backslashreplace")
        fields = {
            "method": method,
            "path": path,
            "status": status,
            "cache": outcome or None,
            "rank": rank,
            "doc_id": doc_id,
            "replica": replica,
            "duration_ms": round(seconds * 1000, 2),
        }
        ACCESS.info(
            "%s %s %d %s rank=%s doc=%s replica=%s %.1f ms",
            method,
            _quoted(path),
            status,
            outcome or "-",
            rank if rank is not None else "-",
            _quoted(doc_id),
            replica or "-",
            seconds * 1000,
            extra={"request": fields},
        )


def _quoted(value: str | None) -> str:
    """A path or doc id as written in a text line: quoted where it could be taken for more than one field."""
    if value is None:
        return "-"
    return value if value.isprintable() and " " not in value and value else orjson.dumps(value).decode()
