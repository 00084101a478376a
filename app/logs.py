"""The proxy's log: set up once by `inferproxy serve`, one line per request.

A request's line is at INFO on the `inferproxy.access` logger: method, route, status, `X-Cache`,
rank, doc id, replica and duration. Cache hits get one line per `log_hits_every` (a replay storm
answers tens of thousands a second); every other request gets its own. Never `Authorization`, never
a body. With `log_format = "json"` every line, these and the rest, is one JSON object.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import orjson

ACCESS = logging.getLogger("inferproxy.access")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


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
        return orjson.dumps(line).decode()


def configure(level: str, log_format: str) -> None:
    # What no line here shows, not looked up per line (the logging HOWTO's "Optimization"): the caller's
    # frame costs ~2 µs of each request line, at a line per generation.
    logging._srcfile = None
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JSONFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


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
        for name, value in headers:
            if name == b"x-rank":
                rank = value.decode("latin-1")
            elif name == b"x-doc-id":
                doc_id = value.decode("latin-1")
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
            path,
            status,
            outcome or "-",
            rank if rank is not None else "-",
            _quoted(doc_id),
            replica or "-",
            seconds * 1000,
            extra={"request": fields},
        )


def _quoted(doc_id: str | None) -> str:
    """A doc id as written in a text line: quoted where it could be taken for more than one field."""
    if doc_id is None:
        return "-"
    return doc_id if doc_id.isprintable() and " " not in doc_id and doc_id else orjson.dumps(doc_id).decode()
