"""The upstream pool: one HTTP client to one or more replicas of the same model.

- choice: the healthy replica with the fewest requests in flight (ties rotate);
  a replica that fails a connection is skipped until a `GET /v1/models`
  probe passes again; with none healthy, every replica is still tried;
- retries: connection errors and 429/502/503/504 answers are retried up to
  `retries` times with exponential backoff and jitter, the `Retry-After`
  of a 429 or 503 honoured; a read timeout is not retried (the GPU may still
  be working on it). After the last try the caller gets `UpstreamUnreachable`
  (502) or `UpstreamTimeout` (504), or the upstream's own last answer;
- timeouts: explicit connect and read (silence) timeouts, no total timeout,
  since generations can take many minutes.

The client is `app.http.client`, chosen by measurement (bench/README.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import logging
import random
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

from app.errors import UpstreamTimeout, UpstreamUnreachable
from app.http.client import (
    ConnectError,
    ConnectionLost,
    ConnectTimeout,
    HTTPClient,
    HTTPClientError,
    ReadTimeout,
    Response,
)

logger = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({429, 502, 503, 504})
MAX_RETRY_AFTER_S = 60.0
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"trailers",
        b"transfer-encoding",
        b"upgrade",
        b"content-length",
        b"host",
    }
)
# The client's credentials never go upstream; inferproxy's own headers mean nothing there;
# accept-encoding is set to identity so that stored bodies are the bytes the client reads.
_NOT_FORWARDED = frozenset(
    {
        b"authorization",
        b"x-doc-id",
        b"x-rollout-idx",
        b"x-chunk-index",
        b"x-rank",
        b"cache-control",
        b"accept-encoding",
        b"expect",  # the proxy's own server answered it already; upstream it would only add a 100 Continue
    }
)
_SERVER_SET = frozenset({b"date", b"server"})


@dataclass
class Replica:
    url: str
    in_flight: int = 0
    healthy: bool = True
    failed_at: float = 0.0


class UpstreamResponse:
    """An upstream answer whose body is read or streamed by the caller inside `UpstreamPool.request`."""

    def __init__(self, raw: Response, replica: Replica) -> None:
        self.raw = raw
        self.replica = replica
        self.status = raw.status
        self.headers = raw.headers

    @property
    def content_type(self) -> str:
        value = self.raw.header(b"content-type")
        return value.decode("latin-1") if value else "application/json"

    async def read(self) -> bytes:
        """The whole body; `UpstreamUnreachable` / `UpstreamTimeout` if it breaks off."""
        try:
            return await self.raw.read()
        except ReadTimeout as exc:
            raise UpstreamTimeout(f"the upstream {self.replica.url} went silent mid-answer: {exc}") from exc
        except ConnectionLost as exc:
            raise UpstreamUnreachable(f"the upstream {self.replica.url} broke off its answer: {exc}") from exc

    def iter_chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives; raises `app.http.client` errors if it breaks off."""
        return self.raw.iter_chunks()

    def abort(self) -> None:
        """Drop the connection: the upstream stops generating for a client that is gone."""
        self.raw.abort()


class UpstreamPool:
    def __init__(
        self,
        roots: Iterable[str],
        *,
        retries: int = 3,
        backoff_s: float = 0.5,
        connect_timeout_s: float = 10.0,
        read_timeout_s: float = 900.0,
        api_key: str | None = None,
        health_interval_s: float = 5.0,
        client: HTTPClient | None = None,
    ) -> None:
        self.replicas = [Replica(root) for root in roots]
        self.retries = retries
        self.backoff_s = backoff_s
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.health_interval_s = health_interval_s
        self._auth = [(b"authorization", f"Bearer {api_key}".encode())] if api_key else []
        self._client = client or HTTPClient(connect_timeout=connect_timeout_s, read_timeout=read_timeout_s)
        self._rotation = 0
        self._prober: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._prober = asyncio.create_task(self._probe_unhealthy_forever(), name="upstream-health-probe")

    async def close(self) -> None:
        if self._prober is not None:
            self._prober.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._prober
            self._prober = None
        await self._client.close()

    def pick(self) -> Replica:
        if len(self.replicas) == 1:
            return self.replicas[0]  # the common case, on every request: no choice to make
        healthy = [r for r in self.replicas if r.healthy] or sorted(self.replicas, key=lambda r: r.failed_at)[:1]
        if len(healthy) == 1:
            return healthy[0]
        self._rotation += 1
        start = self._rotation % len(healthy)
        rotated = healthy[start:] + healthy[:start]
        return min(rotated, key=lambda r: r.in_flight)

    def upstream_headers(self, client_headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        """The client's headers minus hop-by-hop ones, its credentials and inferproxy's own."""
        out = [(n, v) for n, v in client_headers if n not in HOP_BY_HOP and n not in _NOT_FORWARDED]
        out.append((b"accept-encoding", b"identity"))
        out += self._auth
        return out

    @contextlib.asynccontextmanager
    async def request(
        self, method: str, path: str, *, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> AsyncIterator[UpstreamResponse]:
        """Send with retries; yield the final answer; leaving the block releases its connection
        (kept if the body was read to its end, closed otherwise)."""
        attempt = 0
        while True:
            replica = self.pick()
            replica.in_flight += 1
            raw: Response | None = None
            try:
                async with self._client.request(method, replica.url + path, headers=headers, body=body) as raw:
                    if raw.status not in RETRY_STATUSES or attempt >= self.retries:
                        yield UpstreamResponse(raw, replica)
                        return
                    retry_in = self._retry_after(raw) or self._backoff(attempt)
                    logger.info("upstream %s answered %d; retrying in %.2f s", replica.url, raw.status, retry_in)
                # the retried answer is left unread: its connection is closed
            except ReadTimeout as exc:
                if raw is not None:
                    raise  # the caller's, from its block
                raise UpstreamTimeout(
                    f"the upstream {replica.url} sent nothing for {self.read_timeout_s:g} s (read_timeout_s)"
                ) from exc
            except (ConnectError, ConnectionLost) as exc:
                if raw is not None:
                    raise
                self._mark_failed(replica, exc)
                if attempt >= self.retries:
                    tries = f"after {attempt + 1} tries"
                    if isinstance(exc, ConnectTimeout):
                        raise UpstreamTimeout(f"the upstream {replica.url} is not answering {tries}: {exc}") from exc
                    raise UpstreamUnreachable(f"the upstream {replica.url} is unreachable {tries}: {exc}") from exc
                retry_in = self._backoff(attempt)
            finally:
                replica.in_flight -= 1  # however the attempt ends: answer done, error, retry, cancellation
            await asyncio.sleep(retry_in)
            attempt += 1

    async def probe(self, replica: Replica, timeout_s: float = 5.0) -> bool:
        """`GET /v1/models` on one replica; updates its health."""
        try:
            async with (
                asyncio.timeout(timeout_s),
                self._client.request("GET", replica.url + "/v1/models", headers=self._auth) as answer,
            ):
                await answer.read()
                ok = answer.status == 200
        except (TimeoutError, HTTPClientError):
            ok = False
        if ok and not replica.healthy:
            logger.info("upstream %s is healthy again", replica.url)
        replica.healthy = ok
        if not ok:
            replica.failed_at = time.monotonic()
        return ok

    async def probe_all(self) -> bool:
        """True if at least one replica answers `GET /v1/models` now."""
        results = await asyncio.gather(*(self.probe(r, timeout_s=2.0) for r in self.replicas))
        return any(results)

    async def _probe_unhealthy_forever(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            await asyncio.gather(*(self.probe(r) for r in self.replicas if not r.healthy))

    def _mark_failed(self, replica: Replica, exc: BaseException) -> None:
        if replica.healthy:
            logger.warning("upstream %s failed a connection (%s); skipping it until it answers", replica.url, exc)
        replica.healthy = False
        replica.failed_at = time.monotonic()

    def _backoff(self, attempt: int) -> float:
        delay: float = min(self.backoff_s * 2.0**attempt, 30.0)
        return delay * random.uniform(0.5, 1.5)

    @staticmethod
    def _retry_after(raw: Response) -> float | None:
        if raw.status not in (429, 503):
            return None
        value = raw.header(b"retry-after")
        return parse_retry_after(value.decode("latin-1") if value else None)


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a `Retry-After` header (delta-seconds or HTTP date), capped; None if absent or bad."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        seconds = when.timestamp() - time.time()
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_S)


def response_headers(raw_headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """Upstream response headers safe to pass on (hop-by-hop and framing removed)."""
    return [(name, value) for name, value in raw_headers if name not in HOP_BY_HOP and name not in _SERVER_SET]
