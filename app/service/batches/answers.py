"""One batch line's answer: from the answers' cache, else an identical line in flight, else the upstream.

A line is sent upstream as a background request (`UpstreamPool.request(background=True)`: behind every
live request, never in the queue live clients are refused from); a 429, a 5xx, a timeout or a lost
connection is tried again with backoff, `batch_retries` times, and only then is the line failed; a 4xx
is the line's answer (it goes to the error file). An answer worth keeping is stored in the answers'
cache under the line's `custom_id`, its endpoint and its body's hash, and handed to the lines that
joined its flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json

import orjson
import xxhash

from app.ops.metrics import RankCounters, tokens_in
from app.service.affinity import request_key
from app.service.asgi import LONG_NUMBER
from app.service.batches.outputs import answer_result, failure_result
from app.service.batches.running import Running
from app.service.coalescing import Flights, Landing
from app.service.errors import ProxyError, UpstreamFailure
from app.service.settings import Settings
from app.service.storage_policy import cacheable_status, error_in_disguise
from app.service.upstream import UpstreamPool, response_headers
from app.store.batches import Result
from app.store.cache import RequestCache, StoredResponse
from app.store.hashing import payload_hash

#: The endpoints a batch may name; a line's answers are keyed by its endpoint's place here (as the rollout).
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
#: The rank under which batch lines fly in `Flights`: no rank of a job's (those are >= 0).
BATCH_RANK = -1
_RETRIED = frozenset({408, 409, 429, 500, 502, 503, 504})


def line_request(raw: bytes) -> tuple[str, bytes, str]:
    """A batch line's `custom_id`, the body to send and the body's hash (its answers' key).

    The body is sent as the line holds it: an integer past 64 bits (a `seed` of 30 digits) is kept exact, not
    sent as orjson's float of it; such a body (rarely: a run of 20 digits, or 19 negative, anywhere in the
    line) is read and written by the standard library, and hashed from its sorted JSON alike.
    """
    if LONG_NUMBER.search(raw) is None:
        line = orjson.loads(raw)
        return line["custom_id"], orjson.dumps(line["body"]), payload_hash(line["body"])
    exact = json.loads(raw)
    body = json.dumps(exact["body"], ensure_ascii=False, separators=(",", ":")).encode()
    canonical = json.dumps(exact["body"], ensure_ascii=False, separators=(",", ":"), sort_keys=True).encode()
    return exact["custom_id"], body, xxhash.xxh128_hexdigest(canonical)


class Answerer:
    """The answers of batch lines, shared by every batch of an engine: its answers' cache, the flights
    of its lines, the upstream pool."""

    def __init__(
        self, settings: Settings, pool: UpstreamPool, flights: Flights, answers: RequestCache, counts: RankCounters
    ) -> None:
        self.settings = settings
        self.pool = pool
        self.flights = flights
        self.answers = answers
        #: the lines answered from the cache (hits, tokens saved) and generated (misses), for the totals
        self.counts = counts

    async def answer(self, batch: Running, number: int, raw: bytes) -> Result | None:
        """Line `number` of the batch (`raw`, its input line) answered, or given up after every retry (a
        failure result); None if the batch stopped before an answer (the line runs again)."""
        record = batch.record
        custom_id, body, digest = line_request(raw)
        rollout = ENDPOINTS.index(record.endpoint)
        answer = self.answers.get_response(custom_id, rollout, digest, datatrove_results=False)
        result: Result | None
        if answer is not None:
            batch.hits += 1
            self.counts.hits += 1
            self.counts.tokens_saved += tokens_in(answer.body)
            # kept under this batch too: deleting the older batch's output does not forget it
            self.answers.store_response(record.serial, custom_id, rollout, digest, answer)
            result = answer_result(record.serial, number, custom_id, answer, {})
        else:
            result = await self._generated(batch, number, custom_id, rollout, digest, body)
        return result

    async def _generated(
        self, batch: Running, number: int, custom_id: str, rollout: int, digest: str, body: bytes
    ) -> Result | None:
        record = batch.record
        key = (BATCH_RANK, custom_id, rollout, digest, record.endpoint)
        while (flight := self.flights.get(key)) is not None:
            landed = await flight.answer()
            if landed is not None and isinstance(shared := landed.answer, StoredResponse):  # it lands no error
                self.counts.coalesced += 1
                self.counts.tokens_saved += tokens_in(shared.body)
                return answer_result(record.serial, number, custom_id, shared, {})
        with self.flights.lead(key, joinable=True) as flight:
            outcome = await self._send(record.endpoint, custom_id, body, batch)
            if outcome is None:
                return None
            if isinstance(outcome, str):
                return failure_result(record.serial, number, custom_id, "upstream_error", outcome)
            answer, headers = outcome
            self.counts.misses += 1
            result = answer_result(record.serial, number, custom_id, answer, headers)
            kept = cacheable_status(answer.status, self.settings.cache_error_statuses)
            # a 2xx whose body is an error, or no JSON at all, is none to keep (and goes to the error file);
            # a 400 (a kept error status) is its error body
            disguised = result.ok and error_in_disguise(answer) is not None
            if disguised:
                result = dataclasses.replace(result, ok=False)
            if kept and (answer.status >= 300 or (result.ok and not disguised)):
                self.answers.store_response(record.serial, custom_id, rollout, digest, answer)
                flight.land(Landing(answer))
            return result

    async def _send(
        self, endpoint: str, custom_id: str, body: bytes, batch: Running
    ) -> tuple[StoredResponse, dict[bytes, bytes]] | str | None:
        """The upstream's answer to one line; a string saying why there is none after every retry; None if
        the batch stopped meanwhile."""
        pool = self.pool
        headers = [(b"content-type", b"application/json"), (b"accept-encoding", b"identity")]
        route = request_key(custom_id, endpoint, body) if pool.affine else None
        why = ""
        # the replicas that failed this line: a retry goes to another while one is healthy (a replica that
        # hangs, its probe still answering, would otherwise get every retry of the lines keyed to it)
        failed: set[str] = set()
        for attempt in range(self.settings.batch_retries + 1):
            if attempt:
                delay = min(30.0, self.settings.retry_backoff_s * 2**attempt)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(batch.stopping.wait(), delay)
                if batch.stopping.is_set():
                    return None  # cancelled or stopping: not sent again now
            try:
                async with pool.request(
                    "POST", endpoint, headers=headers, body=body, key=route, background=True, avoid=failed
                ) as up:
                    data = await up.read()
                    status, content_type, replica = up.status, up.content_type, up.replica.url
                    got = dict(response_headers(up.headers))
            except ProxyError as exc:
                why = exc.message
                if isinstance(exc, UpstreamFailure) and exc.replica is not None:
                    failed.add(exc.replica)
                continue
            if status in _RETRIED:
                why = f"the upstream answered {status}: {data[:200].decode('utf-8', 'replace')}"
                failed.add(replica)
                continue
            return StoredResponse(status, data, content_type), got
        tries = self.settings.batch_retries + 1
        return why if tries == 1 else f"{why} (the line tried {tries} times)"
