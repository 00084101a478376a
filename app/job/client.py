"""`ProxyJob`: the checkpoint routes of one rank, as a job speaks them.

It asks where to resume (`GET /resume`), gives the headers under which each
answer is cached, sends finished documents (`POST /documents`, batched per
chunk), looks cached answers up (`POST /lookup`, batched), and completes the
last chunk; every call is retried while the proxy restarts, while another proxy
still owns the rank, and while the proxy's output is away. `app.job.run.run_job`
is the inference loop on top of it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from app.checkpoints.documents import DocumentLike, json_default
from app.http.client import ConnectError, ConnectionLost, HTTPClient

logger = logging.getLogger(__name__)

#: How long `close()` waits for the answer to the documents on their way (datatrove's own cleanup waits as long).
CLOSE_GRACE_S = 30.0


class ProxyJobError(RuntimeError):
    """The checkpoint service refused a request; `status` and the service's message say why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


class RankOwnedElsewhere(ProxyJobError):
    """Another live proxy owns this rank (409 `rank_owned_error`); retried for `owned_wait_s`."""


class ProxyUnavailable(ProxyJobError):
    """503 (the output is away, the rank cannot be opened now): retried for `unavailable_wait_s`,
    after the `Retry-After` the proxy gives."""

    def __init__(self, status: int, message: str, retry_after_s: float | None) -> None:
        super().__init__(status, message)
        self.retry_after_s = retry_after_s


class _RetriedConflict(ProxyJobError):
    """A 409 to a request sent again after its first attempt's answer was lost."""


@dataclass
class _Sent:
    """What one checkpoint call learnt over its attempts: whether one's answer may have been lost (a connection
    that broke, or could not be made), so that a 409 to a later one may be that attempt's own doing."""

    answer_lost: bool = False


@dataclass(frozen=True)
class Resume:
    records_per_chunk: int
    last_chunk_index: int
    docs_to_skip: int
    processed_ids: frozenset[str]
    #: Where the proxy publishes chunks and how it names them (None from a proxy too old to say).
    output: str | None = None
    output_filename: str | None = None


class ProxyJob:
    """One rank of a job, as the checkpoint service sees it.

    `client` shares an `HTTPClient` (and its kept-alive connections) with the
    caller, who then closes it; by default the job has its own.
    `total_documents`, the rank's input size if known, is declared to the proxy
    (`X-Total-Documents` on `GET /resume` and `POST /documents`) for its
    progress and ETA. `total_ranks`, the job's number of ranks (datatrove's
    world_size) if known, is declared on `GET /resume` and
    `POST /chunks/{i}/complete` (`X-Total-Ranks`): the proxy then says when
    the whole job is finished, every rank's last chunk published.
    """

    def __init__(
        self,
        base_url: str,
        rank: int = 0,
        api_key: str | None = None,
        *,
        retries: int = 5,
        client: HTTPClient | None = None,
        owned_wait_s: float = 180.0,
        unavailable_wait_s: float = 3600.0,
        unreachable_wait_s: float = 30.0,
        total_documents: int | None = None,
        total_ranks: int | None = None,
    ) -> None:
        if total_ranks is not None and not 0 <= rank < total_ranks:
            raise ValueError(f"rank {rank} is not one of the job's ranks 0..{total_ranks - 1} (total_ranks)")
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.rank = rank
        self.retries = retries
        self.owned_wait_s = owned_wait_s
        self.unavailable_wait_s = unavailable_wait_s
        self.unreachable_wait_s = unreachable_wait_s
        self._reached = False  # whether the proxy has answered this job yet
        self._auth = [(b"authorization", f"Bearer {api_key}".encode())] if api_key else []
        self._total = [(b"x-total-documents", str(total_documents).encode())] if total_documents is not None else []
        self._ranks = [(b"x-total-ranks", str(total_ranks).encode())] if total_ranks is not None else []
        self._owns_client = client is None
        self._client = client or HTTPClient(read_timeout=600.0)
        # write_document's batches: documents waiting per chunk, and the task sending them
        self._pending: dict[int, list[tuple[bytes, asyncio.Future[None]]]] = {}
        self._senders: dict[int, asyncio.Task[None]] = {}
        # lookup's batches: keys waiting, the task sending them, and whether the proxy has the route
        self._lookups: list[tuple[bytes, asyncio.Future[dict[str, Any] | None]]] = []
        self._lookup_sender: asyncio.Task[None] | None = None
        self._lookup_route = True
        self._closing = False

    def declare_total(self, total_documents: int) -> None:
        """The rank's input size, learnt after the job began: declared with its next request (the next
        `POST /documents`, or the last chunk's completion)."""
        self._total = [(b"x-total-documents", str(total_documents).encode())]

    def headers(self, doc_id: str, rollout_idx: int = 0, chunk_index: int | None = None) -> dict[str, str]:
        """The headers for an OpenAI client's `extra_headers`: the answer is cached under this key."""
        headers = {"X-Doc-Id": doc_id, "X-Rollout-Idx": str(rollout_idx), "X-Rank": str(self.rank)}
        if chunk_index is not None:
            headers["X-Chunk-Index"] = str(chunk_index)
        return headers

    async def resume(self) -> Resume:
        answer = await self._call("GET", "/resume", extra=[*self._total, *self._ranks])
        return Resume(
            records_per_chunk=answer["records_per_chunk"],
            last_chunk_index=answer["last_chunk_index"],
            docs_to_skip=answer["docs_to_skip"],
            processed_ids=frozenset(answer["processed_ids"]),
            output=answer.get("output"),
            output_filename=answer.get("output_filename"),
        )

    async def write_documents(self, documents: Sequence[DocumentLike | dict[str, Any]], chunk_index: int) -> Any:
        """Send finished documents of one chunk; returns once they are durable. Safe to retry."""
        body = orjson.dumps([_as_dict(d) for d in documents], default=json_default)
        return await self._post_documents(body, len(documents), chunk_index)

    async def write_document(self, document: DocumentLike | dict[str, Any], chunk_index: int) -> None:
        """Send one finished document; returns once it is durable.

        Documents of a chunk written while an earlier batch is on its way go
        together in the next one: one request and one fsync for all of them,
        as the proxy's own group commit does. A batch the proxy refuses (a
        bad document in it: it takes all or nothing) is sent again one
        document at a time, so that each caller learns its own fate; a
        refusal no document can cause (the rank owned by another proxy,
        401, 5xx, 507) is every caller's at once.
        Raises `TypeError` (before anything is sent) for a document JSON
        cannot hold, `ProxyJobError` for a document the proxy refuses.
        """
        encoded = orjson.dumps(_as_dict(document), default=json_default)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.setdefault(chunk_index, []).append((encoded, done))
        if chunk_index not in self._senders:
            self._senders[chunk_index] = asyncio.create_task(self._send_batches(chunk_index))
        await done

    async def _send_batches(self, chunk_index: int) -> None:
        try:
            while pending := self._pending.pop(chunk_index, None):
                for batch in _batches(pending):
                    if self._closing:  # close() awaits only the batch on its way
                        _settle(batch, asyncio.CancelledError())
                        continue
                    await self._send_batch(batch, chunk_index)
        finally:
            del self._senders[chunk_index]

    async def _send_batch(self, batch: list[tuple[bytes, asyncio.Future[None]]], chunk_index: int) -> None:
        try:
            await self._post_documents(b"[" + b",".join(line for line, _ in batch) + b"]", len(batch), chunk_index)
        except ProxyJobError as exc:
            if len(batch) == 1 or not maybe_one_documents_fault(exc):
                _settle(batch, exc)
                return
            for one in batch:  # all or nothing: find out which document it was
                await self._send_batch([one], chunk_index)
        except BaseException as exc:  # unreachable, cancelled: every document of the batch shares the fate
            _settle(batch, exc)
            if not isinstance(exc, Exception):
                raise
        else:
            _settle(batch, None)

    async def _post_documents(self, body: bytes, count: int, chunk_index: int) -> Any:
        extra = [(b"x-chunk-index", str(chunk_index).encode()), *self._total]
        try:
            return await self._call("POST", "/documents", body, extra)
        except _RetriedConflict:
            # The first attempt's answer was lost (the proxy died after writing) and the retry
            # found the chunk complete: if it has been published, that attempt completed it.
            state = await self.resume()
            if chunk_index <= state.last_chunk_index:
                return {"rank": self.rank, "chunk_index": chunk_index, "written": 0, "duplicates": count}
            raise

    async def lookup(
        self,
        doc_id: str,
        rollout_idx: int,
        body: dict[str, Any],
        *,
        datatrove_hash: str | None = None,
        path: str | None = None,
    ) -> dict[str, Any] | None:
        """The answer the proxy has cached for this request, or None (send the request itself).
        `datatrove_hash`: the request's `X-Datatrove-Payload-Hash`, which keys it instead of `body`; `path`:
        the route it goes to (`/v1/chat/completions` or `/v1/completions`), whose answers only are found.

        `{"status", "content_type", "body"}` (`"text"` instead of `"body"` for
        an answer that is not JSON), as `POST /lookup` gives it. Lookups made
        while one is on its way go together in the next request: a restarted
        job replaying its generations pays one round trip for many. Any
        trouble (an older proxy without the route, an error, an answer of the
        wrong shape, a body JSON cannot hold) answers None: the request itself
        then says what is wrong.
        """
        if not self._lookup_route:
            return None
        try:
            # Encoded now: one payload JSON cannot hold must not spoil the batch it would go in.
            item = {"doc_id": doc_id, "rollout_idx": rollout_idx, "body": body}
            if datatrove_hash is not None:
                item["datatrove_payload_hash"] = datatrove_hash
            if path is not None:
                item["path"] = path
            key = orjson.dumps(item)
        except TypeError:
            return None
        found: asyncio.Future[dict[str, Any] | None] = asyncio.get_running_loop().create_future()
        self._lookups.append((key, found))
        if self._lookup_sender is None:
            self._lookup_sender = asyncio.create_task(self._send_lookups())
        return await found

    async def _send_lookups(self) -> None:
        batch: list[tuple[bytes, asyncio.Future[dict[str, Any] | None]]] = []
        try:
            while self._lookups:
                batch, self._lookups = self._lookups[:LOOKUP_BATCH], self._lookups[LOOKUP_BATCH:]
                answers = await self._post_lookups([key for key, _ in batch])
                for (_, found), answer in zip(batch, answers, strict=True):
                    if not found.done():
                        found.set_result(answer)
        except BaseException:  # cancelled (close()): no lookup still waiting will be answered
            for _, found in [*batch, *self._lookups]:
                found.cancel()
            self._lookups = []
            raise
        finally:
            self._lookup_sender = None

    async def _post_lookups(self, keys: list[bytes]) -> list[dict[str, Any] | None]:
        """The answers to `keys`, None for each whatever goes wrong (the requests themselves then go)."""
        answers: Any = None
        if self._lookup_route:
            try:
                answers = await self._call_once("POST", "/lookup", b"[" + b",".join(keys) + b"]", ())
            except ProxyJobError as exc:
                if exc.status in (404, 405):
                    self._lookup_route = False  # an inferproxy from before the route
            except Exception:  # unreachable, not JSON: no answer
                pass
        if not isinstance(answers, list) or len(answers) != len(keys):
            return [None] * len(keys)
        return [answer if _is_lookup_answer(answer) else None for answer in answers]

    async def complete_chunk(self, chunk_index: int, total_documents: int | None = None) -> Any:
        """Declare the job's last (possibly partial) chunk complete: once it is published, the proxy shows
        the rank as finished. `total_documents`: the rank's input length, known at its end (else the
        one this job was given)."""
        total = [(b"x-total-documents", str(total_documents).encode())] if total_documents is not None else self._total
        return await self._call("POST", f"/chunks/{chunk_index}/complete", extra=[*total, *self._ranks])

    async def close(self, *, grace_s: float = CLOSE_GRACE_S) -> None:
        """Stop sending; the documents already on their way get their answer first (for up to `grace_s`).

        Cancelling their request would not unsend it: the proxy, which has it, would write them all the
        same, later, unseen by this job, perhaps after the `GET /resume` of the rank's next run, which
        would then take them for documents still to do. Documents not yet sent are not sent (their
        callers' futures are cancelled), lookups waiting are cancelled.
        """
        self._closing = True
        try:
            if self._senders:
                await asyncio.wait(list(self._senders.values()), timeout=grace_s)
        finally:
            for sender in [*self._senders.values(), *([self._lookup_sender] if self._lookup_sender else [])]:
                sender.cancel()
            if self._owns_client:
                await self._client.close()

    async def _call(self, method: str, path: str, body: bytes = b"", extra: Sequence[tuple[bytes, bytes]] = ()) -> Any:
        """One checkpoint call, retried while the proxy restarts; while another proxy still owns the rank
        (it gives the rank up when it dies or leaves it idle), for up to `owned_wait_s`; while the proxy
        answers 503 (its output away: nothing of the request was taken, or what was is kept), for up to
        `unavailable_wait_s`, as its `Retry-After` says."""
        started = time.monotonic()
        delay = 0.5
        warned: set[type] = set()
        sent = _Sent()  # across the retries after a 503: an answer lost before it is lost still
        while True:
            try:
                return await self._call_once(method, path, body, extra, sent)
            except (RankOwnedElsewhere, ProxyUnavailable) as exc:
                unavailable = isinstance(exc, ProxyUnavailable)
                wait_s = self.unavailable_wait_s if unavailable else self.owned_wait_s
                pause = max(delay, exc.retry_after_s or 0.0) if isinstance(exc, ProxyUnavailable) else delay
                if time.monotonic() + pause > started + wait_s:
                    raise
                if type(exc) not in warned:
                    warned.add(type(exc))
                    then = "retrying" if unavailable else "waiting for it to be released"
                    logger.warning("%s; %s for up to %g s", exc.message, then, wait_s)
                await asyncio.sleep(pause)
                delay = min(delay * 2, 10.0)

    async def _call_once(
        self, method: str, path: str, body: bytes, extra: Sequence[tuple[bytes, bytes]], sent: _Sent | None = None
    ) -> Any:
        """The call, retried while the proxy cannot be reached (it restarts: every call here is safe to repeat),
        `retries` times, and once the proxy has answered this job before (then it is restarting, where one
        never reached is more likely a wrong URL) for at least `unreachable_wait_s`; its answer, or its
        refusal raised."""
        sent = sent or _Sent()
        headers = [(b"x-rank", str(self.rank).encode()), (b"content-type", b"application/json"), *self._auth, *extra]
        started = time.monotonic()
        attempt = 0
        while True:
            try:
                async with self._client.request(method, self.base_url + path, headers=headers, body=body) as answer:
                    data = await answer.read()
                self._reached = True
            except (ConnectError, ConnectionLost):
                # It may have been taken, its answer lost: a refused connection too, for the HTTP client sends a
                # request again by itself, on a new connection, when a kept-alive one closed before any answer
                # (taken for a server that had closed it idle; a proxy killed mid-request looks the same).
                sent.answer_lost = True
                waited = time.monotonic() - started
                if attempt >= self.retries and (not self._reached or waited >= self.unreachable_wait_s):
                    raise
                await asyncio.sleep(min(0.2 * 2**attempt, 5.0))
                attempt += 1
                continue
            if answer.status != 200:
                try:
                    error = orjson.loads(data)["error"]
                    message, kind = str(error["message"]), error.get("type")
                except (ValueError, KeyError, TypeError):
                    message, kind = data.decode("utf-8", "replace"), None
                if answer.status == 409 and kind == "rank_owned_error":
                    raise RankOwnedElsewhere(answer.status, message)
                if answer.status == 503:
                    raise ProxyUnavailable(answer.status, message, _retry_after_s(answer.header(b"retry-after")))
                if answer.status == 409 and sent.answer_lost:
                    raise _RetriedConflict(answer.status, message)
                raise ProxyJobError(answer.status, message)
            return orjson.loads(data)


def _retry_after_s(value: bytes | None) -> float | None:
    """`Retry-After` in seconds (at most 60), None if absent or not a number of seconds."""
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None
    if seconds is None or not 0 <= seconds < float("inf"):
        return None
    return min(seconds, 60.0)


#: Keys per POST /lookup (the proxy takes up to 4096).
LOOKUP_BATCH = 1024
#: A batch of documents stays well under the proxy's default max_body_bytes (32 MiB).
BATCH_BYTES = 4 << 20
BATCH_DOCUMENTS = 512


def _batches(
    pending: list[tuple[bytes, asyncio.Future[None]]],
) -> Iterable[list[tuple[bytes, asyncio.Future[None]]]]:
    batch: list[tuple[bytes, asyncio.Future[None]]] = []
    size = 0
    for entry in pending:
        if entry[1].done():  # its writer was cancelled: nobody waits for it
            continue
        if batch and (size + len(entry[0]) > BATCH_BYTES or len(batch) == BATCH_DOCUMENTS):
            yield batch
            batch, size = [], 0
        batch.append(entry)
        size += len(entry[0])
    if batch:
        yield batch


#: Refusals that may be one document's fault (malformed, for a complete chunk, too large): the others
#: (another proxy's rank, a wrong API key, disk full, a failure at the proxy) would only repeat per document.
_DOCUMENT_REFUSALS = frozenset({400, 409, 413})


def maybe_one_documents_fault(error: ProxyJobError) -> bool:
    """Whether a refusal may be one document's fault (malformed, for a complete chunk, too large), not the
    rank's or the proxy's (another proxy's rank, a wrong API key, a full disk, a failure at the proxy)."""
    return error.status in _DOCUMENT_REFUSALS and not isinstance(error, RankOwnedElsewhere)


def _settle(batch: list[tuple[bytes, asyncio.Future[None]]], error: BaseException | None) -> None:
    for _, done in batch:
        if done.done():
            continue
        if error is None:
            done.set_result(None)
        elif isinstance(error, asyncio.CancelledError):
            done.cancel()
        else:
            done.set_exception(error)


def _is_lookup_answer(answer: Any) -> bool:
    """`{"status": int, "content_type", "body" | "text": str}`, as `POST /lookup` gives a hit."""
    if not isinstance(answer, dict) or not isinstance(answer.get("status"), int):
        return False
    return "body" in answer or isinstance(answer.get("text"), str)


def _as_dict(document: DocumentLike | dict[str, Any]) -> dict[str, Any]:
    if isinstance(document, dict):
        return document
    return {"id": document.id, "text": document.text, "media": document.media, "metadata": document.metadata}
