"""The proxy's own errors, each with its HTTP status, rendered as the OpenAI error envelope.

    ProxyError                  500 internal_error
    ├── BadRequest              400 invalid_request_error   (a header, the body, a document)
    ├── Unauthorized            401 authentication_error
    ├── NotFound                404 not_found_error
    ├── MethodNotAllowed        405 invalid_request_error    (with Allow)
    ├── MethodNotSupported      501 invalid_request_error    (TRACE, CONNECT: on no route)
    ├── ChunkConflict           409 conflict_error           (chunk already complete)
    ├── RankOwned               409 rank_owned_error         (another live proxy owns the rank: retry later)
    ├── PayloadTooLarge         413 invalid_request_error
    ├── UpstreamFailure                                      (an attempt at a replica, named: `replica`)
    │   ├── UpstreamUnreachable 502 upstream_error
    │   └── UpstreamTimeout     504 upstream_timeout
    ├── OutputLost              409 output_lost_error        (chunks recorded as published are gone from the output)
    ├── ServiceUnavailable      503 service_unavailable
    │   ├── TooManyRanks        503 too_many_ranks           (every open rank busy: retry, or raise max_open_ranks)
    │   └── OutputUnavailable   503 output_unavailable       (the output refuses or stalls: retry, with Retry-After)
    └── InsufficientStorage     507 insufficient_storage     (disk full: nothing was written)

Answers from the upstream pass through verbatim (but for its 404 to an OpenAI
route asked for without `/v1`, whose message then says so); only errors the proxy
itself produces use this envelope:
`{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import logging
import math

import orjson

logger = logging.getLogger(__name__)


class ProxyError(Exception):
    status = 500
    type = "internal_error"

    def __init__(
        self, message: str, *, param: str | None = None, headers: list[tuple[bytes, bytes]] | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = headers or []  # sent with the answer, e.g. Retry-After

    def body(self) -> bytes:
        return error_body(self.message, type_=self.type, param=self.param, code=self.status)


class BadRequest(ProxyError):
    status = 400
    type = "invalid_request_error"


class Unauthorized(ProxyError):
    status = 401
    type = "authentication_error"


class NotFound(ProxyError):
    status = 404
    type = "not_found_error"


class MethodNotAllowed(ProxyError):
    status = 405
    type = "invalid_request_error"


class MethodNotSupported(ProxyError):
    """A method served on no route at all (TRACE, CONNECT): 501, as the built-in server answers it."""

    status = 501
    type = "invalid_request_error"


class ChunkConflict(ProxyError):
    status = 409
    type = "conflict_error"


class FileInUse(ProxyError):
    """A file a batch still reads (its input, while it runs): not deleted. Not to be retried at once: the
    `openai` client retries a 409 (twice, over a second and a half) unless told not to."""

    status = 409
    type = "conflict_error"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers=[(b"x-should-retry", b"false")])


class RankOwned(ProxyError):
    """Another live proxy owns the rank; the message names it (host, pid). Worth retrying: the
    owner gives the rank up when it dies or leaves the rank idle."""

    status = 409
    type = "rank_owned_error"


class PayloadTooLarge(ProxyError):
    status = 413
    type = "invalid_request_error"


class UpstreamFailure(ProxyError):
    """An attempt at an upstream replica that gave no usable answer; `replica` names it (its URL), so that a
    retry can go to another."""

    def __init__(
        self,
        message: str,
        *,
        replica: str | None = None,
        param: str | None = None,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        super().__init__(message, param=param, headers=headers)
        self.replica = replica


class UpstreamUnreachable(UpstreamFailure):
    status = 502
    type = "upstream_error"


class UpstreamBusy(ProxyError):
    """Every upstream slot is taken and the queue for them is full (`max_inflight_per_upstream`)."""

    status = 429
    type = "rate_limit_error"


class ServiceUnavailable(ProxyError):
    status = 503
    type = "service_unavailable"


class TooManyRanks(ServiceUnavailable):
    type = "too_many_ranks"


class OutputUnavailable(ServiceUnavailable):
    """The output cannot take (or show) a rank's chunks now: full, refusing, stalled. Retried by clients
    after `Retry-After`; the message names the output and the error."""

    type = "output_unavailable"

    def __init__(self, message: str, *, retry_after_s: float) -> None:
        seconds = max(1, math.ceil(retry_after_s))
        super().__init__(message, headers=[(b"retry-after", str(seconds).encode())])


class OutputLost(ProxyError):
    """Chunks `last_chunk` records as published are not in the output: a job resuming would skip them for
    good. Not retried: a person decides (put the files back, or have them generated again)."""

    status = 409
    type = "output_lost_error"

    def __init__(self, rank: int, missing: list[int], last_chunk: int, output: str, last_chunk_file: str) -> None:
        shown = ", ".join(map(str, missing[:10])) + (f", ... ({len(missing)} in all)" if len(missing) > 10 else "")
        super().__init__(
            f"rank {rank}'s chunks [{shown}] are recorded as published (last_chunk {last_chunk}) but are not in "
            f"the output {output}: they were lost after publication (the output emptied, recreated or pruned?). "
            f"Put the files back; or, to have them generated again, write {missing[0] - 1} into {last_chunk_file} "
            f"and restart the job"
        )
        self.missing = missing


class UpstreamTimeout(UpstreamFailure):
    status = 504
    type = "upstream_timeout"


class InsufficientStorage(ProxyError):
    status = 507
    type = "insufficient_storage"


def error_body(message: str, *, type_: str, param: str | None = None, code: int | str) -> bytes:
    """The OpenAI error envelope, as bytes."""
    return orjson.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}})


def failure(exc: Exception, request: str) -> ProxyError:
    """What to answer for `exc`, raised while serving `request` ("POST /documents"): itself if it is the
    proxy's own error, else a 500 that names it (logged with its traceback: a bug, or a fault not foreseen)."""
    if isinstance(exc, ProxyError):
        return exc
    logger.exception("%s failed", request)
    return ProxyError(f"inferproxy failed on this request: {type(exc).__name__}: {exc}")
