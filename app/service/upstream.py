"""The upstream pool: one HTTP client to one or more replicas of the same model.

- choice (`routing`): under "affinity", a request with a key (its document, else its prompt's
  leading bytes: `app.service.affinity`) goes to the key's first healthy replica in a rendezvous
  ranking unless that one is over the load bound, then to the key's next; a request without a key,
  and every request under "least-inflight", to the healthy replica with the fewest requests in
  flight (ties rotate). With one replica there is no choice to make, and nothing is hashed;
- failover: a replica that fails a connection, or answers 502 or 503 (while another is healthy), is
  left out until a `GET /v1/models` probe passes again; its request is retried at once on the next replica
  (the key's next under "affinity"); with none healthy, every replica is still tried;
- retries: connection errors and 429/502/503/504 answers are retried up to
  `retries` times with exponential backoff and jitter, the `Retry-After`
  of a 429 or 503 honoured; a read timeout is not retried (the GPU may still
  be working on it). After the last try the caller gets `UpstreamUnreachable`
  (502) or `UpstreamTimeout` (504), or the upstream's own last answer;
- backpressure: at most `max_inflight` requests in flight per replica (on
  average over the replicas; 0: no limit); up to `max_queued` more wait for a
  slot in arrival order; past that, `UpstreamBusy` (429 with `Retry-After`) at
  once, so that a flood costs neither memory nor the upstream's time;
- timeouts: explicit connect and read (silence) timeouts, no total timeout,
  since generations can take many minutes;
- answers that are not HTTP as the client takes it (a `101`, a status outside
  100-599, a head over its limits) are 502 at once, not retried; `read()`
  refuses a body over `max_response_bytes` with a 502;
- `async with pool.request(...) as answer:` releases the connection when the
  block exits: kept if the body was read to its end, closed otherwise;
- headers: hop-by-hop ones, and those a `Connection` header names (RFC 9110
  §7.6.1), are dropped both ways; credentials in a replica's URL
  (`http://user:pass@host`) are sent as Basic auth unless an `api_key` is
  set, and shown as `***` wherever the URL is (errors, logs, `Replica.url`).

The client is `app.http.client`, chosen by measurement (bench/README.md).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import email.utils
import logging
import math
import random
import time
from collections.abc import AsyncIterator, Collection, Iterable
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit, urlunsplit

from app.checkpoints.output import redact_url
from app.http.client import (
    MAX_RESPONSE_BYTES,
    ConnectError,
    ConnectionLost,
    ConnectTimeout,
    HTTPClient,
    HTTPClientError,
    InvalidResponse,
    ReadTimeout,
    Response,
    ResponseTooLarge,
)
from app.ops.metrics import LATENCY_BUCKETS, Histogram
from app.service.affinity import MIN_BOUND, choose, replica_seed
from app.service.errors import UpstreamBusy, UpstreamTimeout, UpstreamUnreachable
from app.tasks import cancel_and_wait

logger = logging.getLogger(__name__)

#: The User-Agent of the proxy's own `GET /v1/models` health probes: an upstream's logs (and the fake
#: upstream's counts) can tell them from the clients' requests.
PROBE_USER_AGENT = b"inferproxy-health-probe"
RETRY_STATUSES = frozenset({429, 502, 503, 504})
#: Answers that take a replica out until its probe passes (when there are others to go to): a gateway with
#: nothing behind it, a server that is not serving. A 429 or 504 says "later", not "elsewhere".
FAILED_STATUSES = frozenset({502, 503})
ROUTINGS = ("affinity", "least-inflight")
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
        b"x-total-documents",
        b"cache-control",
        b"accept-encoding",
        b"expect",  # the proxy's own server answered it already; upstream it would only add a 100 Continue
    }
)
_SERVER_SET = frozenset({b"date", b"server"})
_PLAIN_CONNECTION = frozenset({b"keep-alive", b"close"})  # what nearly every Connection header says: no names


@dataclass
class Replica:
    """One upstream server. `url` is its root as shown (credentials as `***`); requests go to
    `base`, the root without credentials, with `auth`."""

    url: str
    base: str = ""
    auth: list[tuple[bytes, bytes]] = field(default_factory=list)
    in_flight: int = 0
    healthy: bool = True
    failed_at: float = 0.0
    #: its place in every affinity ranking (`app.service.affinity.replica_seed` of `base`)
    seed: int = 0
    #: attempts sent, attempts that failed (no answer, or a 5xx), attempts retried; time to each answer's head
    requests: int = 0
    errors: int = 0
    retries: int = 0
    #: requests whose key ranks this replica first, sent to the key's next replica: this one was over the bound
    spilled: int = 0
    latency: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))

    @classmethod
    def at(cls, root: str, api_auth: list[tuple[bytes, bytes]]) -> Replica:
        """The replica at `root`; credentials in it become Basic auth unless `api_auth` is given."""
        parts = urlsplit(root)
        if "@" not in parts.netloc:
            return cls(root, root, api_auth, seed=replica_seed(root))
        base = urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))
        auth = api_auth
        if not auth:
            user, password = unquote(parts.username or ""), unquote(parts.password or "")
            auth = [(b"authorization", b"Basic " + base64.b64encode(f"{user}:{password}".encode()))]
        return cls(redact_url(root), base, auth, seed=replica_seed(base))


class UpstreamResponse:
    """An upstream answer whose body is read or streamed by the caller inside `UpstreamPool.request`."""

    def __init__(self, raw: Response, replica: Replica, max_bytes: int) -> None:
        self.raw = raw
        self.replica = replica
        self.max_bytes = max_bytes
        self.status = raw.status
        self.headers = raw.headers
        #: The body ends where the connection does: a cut one cannot be told from a whole one.
        self.framed_by_close = raw.framed_by_close

    @property
    def content_type(self) -> str:
        value = self.raw.header(b"content-type")
        return value.decode("latin-1") if value else "application/json"

    async def read(self) -> bytes:
        """The whole body; `UpstreamUnreachable` / `UpstreamTimeout` if it breaks off."""
        try:
            return await self.raw.read(self.max_bytes)
        except ResponseTooLarge as exc:
            raise UpstreamUnreachable(
                f"the upstream {self.replica.url} answered with a body over max_response_bytes "
                f"({self.max_bytes} bytes); it was not passed on nor stored: raise --max-response-bytes "
                f"if such answers are expected",
                replica=self.replica.url,
            ) from exc
        except InvalidResponse as exc:
            raise UpstreamUnreachable(
                f"the upstream {self.replica.url} sent an invalid answer: {exc}", replica=self.replica.url
            ) from exc
        except ReadTimeout as exc:
            raise UpstreamTimeout(
                f"the upstream {self.replica.url} went silent mid-answer: {exc}", replica=self.replica.url
            ) from exc
        except ConnectionLost as exc:
            raise UpstreamUnreachable(
                f"the upstream {self.replica.url} broke off its answer: {exc}", replica=self.replica.url
            ) from exc

    def iter_chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives; raises `app.http.client` errors if it breaks off."""
        return self.raw.iter_chunks()

    def abort(self) -> None:
        """Drop the connection: the upstream stops generating for a client that is gone."""
        self.raw.abort()


class Slots:
    """At most `capacity` holders at once (0: no limit); up to `queue` more wait, first come first served;
    past that, `acquire` refuses at once. A released slot passes straight to the first waiter.

    Background holders (a batch's lines) wait in a queue of their own, never counted against `queue` and
    never refused: a slot goes to one of them only when no live request waits, so a batch never makes a
    live client wait in a queue it filled, nor refuses it a place there."""

    def __init__(self, capacity: int, queue: int) -> None:
        self.capacity = capacity
        self.queue = queue
        self.held = 0
        self.waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self.background: collections.deque[asyncio.Future[None]] = collections.deque()

    async def acquire(self, *, background: bool = False) -> None:
        if self.capacity == 0:
            return
        if self.held < self.capacity and not self.waiters and not (background and self.background):
            self.held += 1
            return
        if background:
            await self._wait(self.background)
            return
        if len(self.waiters) >= self.queue:
            raise UpstreamBusy(
                f"the upstream is busy: {self.held} requests in flight (max_inflight_per_upstream) and "
                f"{len(self.waiters)} waiting (max_queued_requests); retry after the Retry-After seconds",
                headers=[(b"retry-after", b"1")],
            )
        await self._wait(self.waiters)

    async def _wait(self, queue: collections.deque[asyncio.Future[None]]) -> None:
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # handed over just as the waiter was cancelled: pass it on
            else:
                # `release` may have dropped it already, as a waiter that was done (cancelled)
                with contextlib.suppress(ValueError):
                    queue.remove(waiter)
            raise

    def release(self) -> None:
        if self.capacity == 0:
            return
        for queue in (self.waiters, self.background):  # live requests first
            while queue:
                waiter = queue.popleft()
                if not waiter.done():
                    waiter.set_result(None)  # the slot changes hands: `held` stays
                    return
        self.held -= 1


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
        max_response_bytes: int = MAX_RESPONSE_BYTES,
        max_inflight: int = 0,
        max_queued: int = 0,
        routing: str = "affinity",
        load_bound: float = 0.5,
        client: HTTPClient | None = None,
    ) -> None:
        if routing not in ROUTINGS:
            raise ValueError(f"routing is one of {', '.join(ROUTINGS)}, got {routing!r}")
        self._auth = [(b"authorization", f"Bearer {api_key}".encode())] if api_key else []
        self.replicas = [Replica.at(root, self._auth) for root in roots]
        self.slots = Slots(max_inflight * len(self.replicas), max_queued)
        self.retries = retries
        self.backoff_s = backoff_s
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.health_interval_s = health_interval_s
        self.max_response_bytes = max_response_bytes
        self.routing = routing
        self.load_bound = load_bound
        #: The bound's floor: never more than a replica's share of the slots, or a replica holding them all
        #: (hung, say) would be under it for good, and every request would queue for it.
        self.min_bound = min(MIN_BOUND, max_inflight) if max_inflight else MIN_BOUND
        #: Whether requests are keyed for affinity: the caller computes a key only then.
        self.affine = routing == "affinity" and len(self.replicas) > 1
        self._client = client or HTTPClient(
            connect_timeout=connect_timeout_s, read_timeout=read_timeout_s, max_response_bytes=max_response_bytes
        )
        self._rotation = 0
        self._prober: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._prober = asyncio.create_task(self._probe_unhealthy_forever(), name="upstream-health-probe")

    async def close(self) -> None:
        if self._prober is not None:
            await cancel_and_wait(self._prober)
            self._prober = None
        await self._client.close()

    def pick(self, key: bytes | None = None, avoid: Collection[str] = ()) -> Replica:
        """The replica for one attempt: by `key` if given (and routing is "affinity"), else the least busy;
        among the healthy ones not in `avoid` (URLs: those that failed this request before), if any."""
        if len(self.replicas) == 1:
            return self.replicas[0]  # the common case, on every request: no choice to make
        healthy = [r for r in self.replicas if r.healthy] or sorted(self.replicas, key=lambda r: r.failed_at)[:1]
        if avoid:
            healthy = [r for r in healthy if r.url not in avoid] or healthy
        if len(healthy) == 1:
            return healthy[0]
        if key is not None and self.affine:
            chosen, first = choose(key, healthy, self.load_bound, self.min_bound)
            if chosen is not first:
                first.spilled += 1
            return chosen
        self._rotation += 1
        start = self._rotation % len(healthy)
        rotated = healthy[start:] + healthy[:start]
        return min(rotated, key=lambda r: r.in_flight)

    def upstream_headers(self, client_headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        """The client's headers minus hop-by-hop ones, its credentials and inferproxy's own
        (the replica's credentials are added per attempt, by `request`)."""
        hop_by_hop = hop_by_hop_in(client_headers)
        out = [(n, v) for n, v in client_headers if n not in hop_by_hop and n not in _NOT_FORWARDED]
        out.append((b"accept-encoding", b"identity"))
        return out

    @contextlib.asynccontextmanager
    async def request(
        self,
        method: str,
        path: str,
        *,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        key: bytes | None = None,
        background: bool = False,
        avoid: Collection[str] = (),
    ) -> AsyncIterator[UpstreamResponse]:
        """Send with retries; yield the final answer; leaving the block releases its connection
        (kept if the body was read to its end, closed otherwise) and its slot. `key` chooses the replica
        under affinity routing (`app.service.affinity.request_key`); `background`: a batch's line, which
        waits for a slot behind every live request (`Slots`); `avoid`: replicas (URLs) that failed this
        request before, passed over while another is healthy."""
        # `UpstreamBusy` (429) when the queue for a slot is full (never for a background request)
        await self.slots.acquire(background=background)
        try:
            attempt = 0
            while True:
                replica = self.pick(key, avoid)
                replica.in_flight += 1
                replica.requests += 1
                raw: Response | None = None
                sent = [*headers, *replica.auth] if replica.auth else headers
                sent_at = time.monotonic()
                try:
                    async with self._client.request(method, replica.base + path, headers=sent, body=body) as raw:
                        replica.latency.observe(time.monotonic() - sent_at)
                        if raw.status >= 500:
                            replica.errors += 1
                        if raw.status in FAILED_STATUSES and self._others_healthy(replica):
                            self._mark_failed(replica, f"it answered {raw.status}")
                        if raw.status not in RETRY_STATUSES or attempt >= self.retries:
                            yield UpstreamResponse(raw, replica, self.max_response_bytes)
                            return
                        retry_in = self._retry_in(replica, self._retry_after(raw) or self._backoff(attempt))
                        logger.info("upstream %s answered %d; retrying in %.2f s", replica.url, raw.status, retry_in)
                    # the retried answer is left unread: its connection is closed
                except ReadTimeout as exc:
                    if raw is not None:
                        raise  # the caller's, from its block
                    replica.errors += 1
                    raise UpstreamTimeout(
                        f"the upstream {replica.url} sent nothing for {self.read_timeout_s:g} s (read_timeout_s)",
                        replica=replica.url,
                    ) from exc
                except (ConnectError, ConnectionLost) as exc:
                    if raw is not None:
                        raise
                    replica.errors += 1
                    self._mark_failed(replica, str(exc) or type(exc).__name__)
                    if attempt >= self.retries:
                        tries = "after 1 try" if attempt == 0 else f"after {attempt + 1} tries"
                        if isinstance(exc, ConnectTimeout):
                            raise UpstreamTimeout(
                                f"the upstream {replica.url} is not answering {tries}: {exc}", replica=replica.url
                            ) from exc
                        raise UpstreamUnreachable(
                            f"the upstream {replica.url} is unreachable {tries}: {exc}", replica=replica.url
                        ) from exc
                    retry_in = self._retry_in(replica, self._backoff(attempt))
                except InvalidResponse as exc:
                    if raw is not None:
                        raise
                    replica.errors += 1
                    # Not HTTP as the client takes it (a 101, a status outside 100-599, a head over the limits):
                    # the same request would only get the same answer.
                    raise UpstreamUnreachable(
                        f"the upstream {replica.url} sent an invalid answer: {exc}", replica=replica.url
                    ) from exc
                finally:
                    replica.in_flight -= 1  # however the attempt ends: answer done, error, retry, cancellation
                replica.retries += 1
                await asyncio.sleep(retry_in)
                attempt += 1
        finally:
            self.slots.release()

    async def probe(self, replica: Replica, timeout_s: float = 5.0) -> bool:
        """`GET /v1/models` on one replica; updates its health."""
        ok = await self.why_not_answering(replica, timeout_s) is None
        if ok:
            self._mark_healthy(replica)
        else:
            replica.healthy = False
            replica.failed_at = time.monotonic()
        return ok

    async def why_not_answering(self, replica: Replica, timeout_s: float = 5.0) -> str | None:
        """None if `GET /v1/models` on `replica` answers 200 now, else why not; its health is left as it is."""
        try:
            async with (
                asyncio.timeout(timeout_s),
                self._client.request(
                    "GET", replica.base + "/v1/models", headers=[*replica.auth, (b"user-agent", PROBE_USER_AGENT)]
                ) as answer,
            ):
                await answer.read()
                status = answer.status
        except TimeoutError:
            return f"no answer within {timeout_s:g} s"
        except (HTTPClientError, OSError) as exc:
            return str(exc) or type(exc).__name__
        return None if status == 200 else f"it answered {status}"

    async def warn_about_silent_replicas(self, timeout_s: float = 10.0) -> None:
        """One WARNING per replica that does not answer `GET /v1/models` now (a dead or mistyped upstream)."""
        reasons = await asyncio.gather(*(self.why_not_answering(r, timeout_s) for r in self.replicas))
        for replica, reason in zip(self.replicas, reasons, strict=True):
            if reason is not None:
                logger.warning(
                    "upstream %s does not answer GET /v1/models (%s): requests sent to it will fail until it "
                    "does; check --upstream, --upstream-api-key and that the server is up",
                    replica.url,
                    reason,
                )

    async def probe_all(self) -> list[bool]:
        """Whether each replica answers `GET /v1/models` now (for `/readyz`). One that does is routed to again;
        one that does not is left in the routing: only a request's failure takes a replica out, not a
        listing of models slow on a busy server."""
        reasons = await asyncio.gather(*(self.why_not_answering(r, timeout_s=2.0) for r in self.replicas))
        for replica, reason in zip(self.replicas, reasons, strict=True):
            if reason is None:
                self._mark_healthy(replica)
        return [reason is None for reason in reasons]

    async def _probe_unhealthy_forever(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            await asyncio.gather(*(self.probe(r) for r in self.replicas if not r.healthy))

    def _mark_healthy(self, replica: Replica) -> None:
        if not replica.healthy:
            logger.info("upstream %s is healthy again", replica.url)
        replica.healthy = True

    def _mark_failed(self, replica: Replica, why: str) -> None:
        if replica.healthy:
            logger.warning("upstream %s failed (%s); skipping it until it answers GET /v1/models", replica.url, why)
        replica.healthy = False
        replica.failed_at = time.monotonic()

    def _others_healthy(self, replica: Replica) -> bool:
        """Whether a replica other than `replica` is healthy: somewhere else to send its requests."""
        return any(other.healthy and other is not replica for other in self.replicas)

    def _retry_in(self, replica: Replica, wait: float) -> float:
        """How long to wait before the next attempt: nothing when it goes to another replica (this one is
        out, another is not), `wait` when it may come back here."""
        return 0.0 if not replica.healthy and self._others_healthy(replica) else wait

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
    if math.isnan(seconds):  # float() takes "nan": slept on, it stalls asyncio for good, and uvloop raises
        return None
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_S)


def response_headers(raw_headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """Upstream response headers safe to pass on (hop-by-hop, `Connection`-named and framing removed)."""
    hop_by_hop = hop_by_hop_in(raw_headers)
    return [(name, value) for name, value in raw_headers if name not in hop_by_hop and name not in _SERVER_SET]


def hop_by_hop_in(headers: list[tuple[bytes, bytes]]) -> frozenset[bytes]:
    """`HOP_BY_HOP` plus the fields the `Connection` headers name: they are meant for this hop only
    (RFC 9110 §7.6.1). Names are lowercase, as the server and the client give them."""
    named: set[bytes] = set()
    for name, value in headers:
        if name == b"connection" and value.lower() not in _PLAIN_CONNECTION:
            named.update(token.strip().lower() for token in value.split(b","))
    return HOP_BY_HOP | named if named else HOP_BY_HOP
