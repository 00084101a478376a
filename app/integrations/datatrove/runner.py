"""`ProxyInferenceRunner`: datatrove's `InferenceRunner` through a running `inferproxy serve`, and
`with_inferproxy_checkpointing`: datatrove's own runner on inferproxy's checkpointing library."""

from __future__ import annotations

import asyncio
import itertools
import random
import threading
from collections.abc import AsyncIterator, Iterable, Mapping, Sized
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import orjson
from datatrove.data import Document as DatatroveDocument
from datatrove.pipeline.inference.run_inference import InferenceRunner
from datatrove.pipeline.inference.types import InferenceError, ServerError

# datatrove's own logger: these messages land in the task logs a datatrove user reads.
from datatrove.utils.logging import logger

from app.checkpoints.manager import CheckpointManager, RequestCache
from app.http.client import HTTPClient
from app.integrations.datatrove.checkpoints import UNREACHABLE, DocumentRefused, ProxyCheckpointManager
from app.integrations.datatrove.totals import Uncountable, count_documents, reader_shard
from app.job.client import ProxyJob
from app.service.errors import BadRequest
from app.service.keys import parse_doc_id
from app.store.cache import DATATROVE_RESULT
from app.store.hashing import payload_hash

#: Answers worth waiting for: the upstream is busy, restarting or briefly gone.
RETRY_STATUSES = frozenset({429, 502, 503, 504, 409})  # 409 on /v1: the rank is still another proxy's
#: The longest a `Retry-After` makes a retry wait (the proxy caps its own the same way).
MAX_RETRY_AFTER_S = 60.0
#: Documents taken from the reader per trip to its thread.
READ_AHEAD = 64
#: datatrove's `request_timeout=None` means no timeout; the client needs a number.
NO_TIMEOUT_S = 7 * 24 * 3600.0


def retry_after_s(value: bytes | None) -> float | None:
    """`Retry-After` in seconds, at most `MAX_RETRY_AFTER_S` (the HTTP-date form is not used by vLLM or
    the proxy); None for a value that is not a number of seconds."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    if seconds != seconds:  # NaN
        return None
    return min(max(0.0, seconds), MAX_RETRY_AFTER_S)


class _DocumentRequests:
    """What datatrove's `_send_request` calls `make_request` on: the proxy, for one rollout of one document."""

    def __init__(
        self,
        runner: ProxyInferenceRunner,
        key: tuple[str, int],
        headers: list[tuple[bytes, bytes]],
        datatrove_hash: str | None,
    ) -> None:
        self.runner = runner
        self.key = key
        self.headers = headers
        self.datatrove_hash = datatrove_hash

    async def make_request(self, payload: dict[str, Any]) -> dict[str, Any]:
        return await self.runner._generate(payload, self.key, self.headers, self.datatrove_hash)


class ProxyEndpoint:
    """What `InferenceRunner.run_async` uses as its server: the proxy, already running."""

    def __init__(self, runner: ProxyInferenceRunner, rank: int) -> None:
        self.runner = runner
        self.rank = rank
        self._common = [(b"x-rank", str(rank).encode()), (b"content-type", b"application/json")]
        if runner.config.api_key:
            self._common.append((b"authorization", f"Bearer {runner.config.api_key}".encode()))

    async def __aenter__(self) -> ProxyEndpoint:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        return None

    def for_rollout(
        self, doc_id: str, rollout_idx: int, chunk_index: int, datatrove_hash: str | None = None
    ) -> _DocumentRequests:
        try:
            # It goes into a header: a CR/LF in it would add headers of its own (another rank, another document).
            parse_doc_id(doc_id.encode())
        except BadRequest as exc:
            raise InferenceError(
                None, f"Got BadRequestError: document id {doc_id[:80]!r} cannot be a cache key: {exc.message}"
            ) from None
        headers = [
            *self._common,
            (b"x-doc-id", doc_id.encode()),
            (b"x-rollout-idx", str(rollout_idx).encode()),
            (b"x-chunk-index", str(chunk_index).encode()),
        ]
        if datatrove_hash is not None:
            headers.append((b"x-datatrove-payload-hash", datatrove_hash.encode()))
        return _DocumentRequests(self.runner, (doc_id, rollout_idx), headers, datatrove_hash)


class ProxyInferenceRunner(InferenceRunner):  # type: ignore[misc]  # datatrove is untyped
    """datatrove's `InferenceRunner` through a running `inferproxy serve`; see the module docstring.

    Arguments are datatrove's, except: `config` must be `server_type="endpoint"`
    with `endpoint_url` the proxy's root; `checkpoints_local_dir` is refused
    (the proxy keeps the checkpoints); `records_per_chunk` defaults to the
    proxy's. `retries` and `retry_backoff_s` (first delay, doubling) bound
    the wait for a proxy or upstream in trouble before the task fails.
    `total_documents`: the documents in each rank's input, if known (one
    number, or one per rank), declared to the proxy for its progress and ETA.
    Without it, the runner declares a total only where it is exact: an input
    that is a list declares its length; an input straight from a `JsonlReader`
    (no step between them, its default adapter, local files, plain or
    compressed) is counted in a thread while the rank runs, as the reader
    reads it (blank lines, bad JSON and empty texts left out, `skip` and
    `limit` applied), and declared with the rank's next checkpoint call
    (`totals` has the rules). Anything else (a filter before the runner, a
    reader of another kind, files on object storage) declares nothing until
    the rank's end, when its input's length is declared with its last
    chunk; datatrove's `world_size` is declared with every rank's
    `GET /resume` and last chunk (`X-Total-Ranks`), so that the proxy shows
    each rank, then the job, finished.
    """

    name = "Inference 🔍"  # datatrove's: stats looked up by the step's name find it

    def __init__(
        self,
        rollout_fn: Any,
        config: Any,
        output_writer: Any,
        shared_context: Any = None,
        checkpoints_local_dir: str | None = None,
        records_per_chunk: int | None = None,
        metadata_key: str = "rollout_results",
        skip_bad_requests: bool = False,
        *,
        retries: int = 5,
        retry_backoff_s: float = 5.0,
        total_documents: int | Mapping[int, int] | None = None,
    ) -> None:
        if config.server_type != "endpoint" or not config.endpoint_url:
            raise ValueError(
                f"ProxyInferenceRunner sends to a running inferproxy serve: use InferenceConfig("
                f"server_type='endpoint', endpoint_url='http://127.0.0.1:8080') with the proxy's address, got "
                f"server_type={config.server_type!r} and endpoint_url={config.endpoint_url!r}"
            )
        if checkpoints_local_dir is not None:
            raise ValueError(
                f"checkpoints_local_dir={checkpoints_local_dir!r}: ProxyInferenceRunner checkpoints at the proxy "
                f"(its --checkpoints-dir), so remove the argument"
            )
        if retries < 0 or retry_backoff_s <= 0:
            raise ValueError(f"retries must be >= 0 and retry_backoff_s > 0, got {retries} and {retry_backoff_s}")
        manager = ProxyCheckpointManager(
            config.endpoint_url,
            records_per_chunk,
            api_key=config.api_key,
            retries=retries,
            total_documents=total_documents,
        )
        # datatrove's constructor, without checkpoints: its RequestCache(None) is disabled and writes no file.
        super().__init__(
            rollout_fn,
            config,
            output_writer,
            shared_context=shared_context,
            checkpoints_local_dir=None,
            records_per_chunk=records_per_chunk or 6000,
            metadata_key=metadata_key,
            skip_bad_requests=skip_bad_requests,
        )
        self.checkpoint_manager = manager
        self.proxy_url = manager.proxy_url
        self.retries = retries
        self.retry_backoff_s = retry_backoff_s
        self._client: HTTPClient | None = None
        self._lookups: ProxyJob | None = None
        self._path = "/v1/chat/completions" if config.use_chat else "/v1/completions"
        self._generate_url = self.proxy_url + self._path

    def run(self, data: Iterable[Any], rank: int = 0, world_size: int = 1) -> None:
        # datatrove's run() does not hand world_size on to run_async: the proxy learns the job's size here.
        self.checkpoint_manager.total_ranks = world_size
        super().run(data, rank, world_size)

    async def run_async(self, data_gen: Iterable[Any], rank: int = 0, world_size: int | None = None) -> None:
        """datatrove's `run_async`; `world_size`, if given, the job's number of ranks (as `run` sets it)."""
        if world_size is not None:
            self.checkpoint_manager.total_ranks = world_size
        manager = self.checkpoint_manager
        manager.input_length = len(data_gen) if isinstance(data_gen, Sized) else None
        stop_counting = threading.Event()
        counting = None
        if manager.input_length is None and manager.given_total(rank) is None:
            counting = self._count_input(data_gen, rank, stop_counting)
        # One client (one pool of kept-alive connections) per run: each task runs in its own event loop.
        client = HTTPClient(read_timeout=self.config.request_timeout or NO_TIMEOUT_S)
        self._client = client
        self._lookups = ProxyJob(self.proxy_url, rank, self.config.api_key, client=client)
        manager.use_client(client)
        try:
            await super().run_async(data_gen, rank)
            await manager.finish(rank)
        finally:
            stop_counting.set()
            if counting is not None:
                counting.cancel()  # its thread may outlive this loop: it must not call back into it
            # A failed run's documents on their way are answered before it ends: one the proxy wrote after
            # the next run's GET /resume would be done again, its answers no longer replayed (a document
            # written is complete to the proxy's cache).
            await manager.close()
            manager.use_client(None)
            await self._lookups.close()
            self._client = self._lookups = None
            await client.close()

    def _count_input(self, data_gen: Iterable[Any], rank: int, stop: threading.Event) -> asyncio.Future[int] | None:
        """Count the rank's documents in a thread of their own, where its reader can say it exactly
        (`totals`), and declare them to the proxy once counted; else leave the total to the rank's end."""
        try:
            shard = reader_shard(data_gen)
        except Uncountable as reason:
            logger.info(f"rank {rank}: its total is declared to the proxy at its end: {reason}")
            return None
        loop = asyncio.get_running_loop()
        counter = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"inferproxy-count-{rank}")
        counting = loop.run_in_executor(counter, count_documents, shard, stop)
        counter.shutdown(wait=False)  # the thread ends with the count, or at the next check of `stop`

        def declare(done: asyncio.Future[int]) -> None:
            if done.cancelled():
                return
            problem = done.exception()
            if problem is None:
                documents = done.result()
                logger.info(f"rank {rank}: its input has {documents} documents (its reader's files counted)")
                self.checkpoint_manager.declare_input_length(rank, documents)
            elif not stop.is_set():
                logger.info(f"rank {rank}: its total is declared to the proxy at its end: {problem}")

        counting.add_done_callback(declare)
        return counting

    def _init_server(self, rank: int) -> ProxyEndpoint:
        return ProxyEndpoint(self, rank)

    async def _async_data_gen(self, sync_gen: Iterable[Any]) -> AsyncIterator[Any]:
        """The reader's documents, as datatrove's runner takes them, read `READ_AHEAD` at a time.

        datatrove hands every document over from a reading thread on its own (a
        thread round trip per document); with cached answers replayed, that hop
        costs as much as the document's requests. The reading still happens off
        the event loop, in the same order.
        """
        iterator = iter(sync_gen)
        loop = asyncio.get_running_loop()
        reader = ThreadPoolExecutor(max_workers=1)
        try:
            while documents := await loop.run_in_executor(reader, list, itertools.islice(iterator, READ_AHEAD)):
                for document in documents:
                    yield document
        finally:
            reader.shutdown(wait=False, cancel_futures=True)  # as datatrove's: never block the loop here

    async def _cached_request(
        self,
        payload: dict[str, Any],
        semaphore: asyncio.Semaphore,
        server: ProxyEndpoint,
        doc_id: str,
        rollout_idx: int,
        chunk_index: int,
        request_counters: list[int] | None = None,
    ) -> Any:
        # No local cache: the proxy answers a request it has seen from its own, keyed as datatrove's
        # runner keys it (the payload before _send_request merges `model` and the default params in), so
        # that a job switched from that runner, or back to it, on the same checkpoints dir reuses its answers.
        if request_counters is not None:
            request_counters[rollout_idx] += 1
        requests = server.for_rollout(doc_id, rollout_idx, chunk_index, datatrove_payload_hash(payload))
        return await self._send_request(requests, payload, semaphore)

    async def _save_document(
        self, document: Any, output_writer_context: Any, rank: int, chunk_index: int, count_processed_stat: bool = True
    ) -> None:
        # datatrove's logs a warning and carries on whatever went wrong: here a refused document is an
        # error that fails the task at its end, and an unreachable proxy (ServerError) fails it now.
        if count_processed_stat:
            self.stat_update("documents_processed", value=1, unit="document")
        try:
            await self.checkpoint_manager.write_document(document, rank, chunk_index, output_writer_context)
        except DocumentRefused as exc:
            logger.error(f"rank {rank}: the proxy refused {exc}; it is NOT in the output and the task will fail")
            self.stat_update("failed_documents", value=1, unit="document")

    async def _generate(
        self,
        payload: dict[str, Any],
        key: tuple[str, int],
        headers: list[tuple[bytes, bytes]],
        datatrove_hash: str | None = None,
    ) -> dict[str, Any]:
        """One generation: the proxy's cached answer if it has one (looked up together with the other
        requests of the moment), else POSTed to the proxy, retrying what a busy or restarting server answers."""
        client, lookups = self._client, self._lookups
        if client is None or lookups is None:
            raise RuntimeError("ProxyInferenceRunner sends requests only inside run_async()")
        cached = await lookups.lookup(key[0], key[1], payload, datatrove_hash=datatrove_hash, path=self._path)
        if cached is not None:
            status = cached["status"]
            if status == 200 and isinstance(cached.get("body"), dict):
                self.stat_update("proxy_cache_hits", value=1, unit="request")
                replayed: dict[str, Any] = self._as_completion(cached["body"])
                return replayed
            # anything else cached (a 400, a stream): asked for again, the proxy replays it byte for byte
        body = orjson.dumps(payload)
        problem = ""
        for attempt in range(self.retries + 1):
            wait = None
            try:
                async with client.request("POST", self._generate_url, headers=headers, body=body) as answer:
                    data = await answer.read()
            except UNREACHABLE as exc:
                problem = f"{type(exc).__name__}: {exc}"
            else:
                text = data.decode("utf-8", "replace")
                if answer.status == 200:
                    if answer.header(b"x-cache") in (b"HIT", b"COALESCED"):
                        self.stat_update("proxy_cache_hits", value=1, unit="request")
                    result: dict[str, Any] = self._as_completion(orjson.loads(data))
                    return result
                if answer.status == 400:
                    raise InferenceError(None, f"Got BadRequestError from server: {text}", payload=payload)
                if answer.status == 500:
                    raise ServerError(f"Got InternalServerError from server: {text}")
                if answer.status == 401:
                    raise ServerError(
                        f"the proxy at {self.proxy_url} refused the API key: set InferenceConfig(api_key=...) "
                        f"to its --api-key ({text})"
                    )
                if answer.status not in RETRY_STATUSES:
                    raise InferenceError(None, f"Error http status {answer.status}: {text}", payload=payload)
                problem = f"status {answer.status}: {text[:300]}"
                wait = retry_after_s(answer.header(b"retry-after"))
            if attempt == self.retries:
                break
            delay = self.retry_backoff_s * 2**attempt * random.uniform(1.0, 1.25)
            delay = max(delay, wait) if wait is not None else delay
            logger.warning(
                f"the proxy at {self.proxy_url} answered {problem}; retry {attempt + 1}/{self.retries} in {delay:.1f} s"
            )
            await asyncio.sleep(delay)
        raise ServerError(
            f"the proxy at {self.proxy_url} still failed after {self.retries} retries ({problem}): the task fails so "
            f"that the executor runs it again; the answers it got so far are cached at the proxy"
        )

    def _as_completion(self, answer: Any) -> Any:
        """An answer as `_send_request` parses it: a completion as it is; a result in datatrove's form (what
        datatrove's runner cached, or the proxy stored for a request keyed by datatrove's hash) as the
        completion it was taken from, so that it parses back to the same `InferenceResult`."""
        if not isinstance(answer, dict) or "choices" in answer or not answer.keys() >= DATATROVE_RESULT:
            return answer
        text, finish_reason = answer["text"], answer["finish_reason"]
        if self.config.use_chat:
            choice = {"message": {"content": text, "reasoning": answer.get("reasoning") or ""}}
        else:
            choice = {"text": text}
        return {"choices": [{**choice, "finish_reason": finish_reason}], "usage": answer["usage"]}


def datatrove_payload_hash(payload: dict[str, Any]) -> str | None:
    """datatrove's `RequestCache.prepare_payload`, or None for a payload it cannot hash (the request then
    fails as it would have)."""
    try:
        return payload_hash(payload)
    except TypeError:
        return None


def with_inferproxy_checkpointing(runner: Any) -> Any:
    """datatrove's own `InferenceRunner`, in-process, on inferproxy's checkpointing library.

    Replaces `runner.request_cache` and `runner.checkpoint_manager` with
    `app.checkpoints.manager`'s `RequestCache` and `CheckpointManager`, built from
    the same `checkpoints_local_dir` and `records_per_chunk` (same files on
    disk, durable and faster); returns the runner::

        runner = with_inferproxy_checkpointing(InferenceRunner(..., checkpoints_local_dir="checkpoints"))
    """
    if isinstance(runner, ProxyInferenceRunner):
        raise ValueError("a ProxyInferenceRunner checkpoints at the proxy already: use it as it is")
    if not isinstance(runner, InferenceRunner):
        raise TypeError(f"expected datatrove's InferenceRunner, got {type(runner).__name__}")
    directory = runner.checkpoint_manager.checkpoints_local_dir
    if directory is None:
        raise ValueError(
            "this runner has no checkpoints_local_dir, so nothing is checkpointed: build it with "
            "InferenceRunner(..., checkpoints_local_dir='<a local folder>') first"
        )
    cache = RequestCache(directory)
    runner.request_cache = cache
    runner.checkpoint_manager = CheckpointManager(
        directory, runner.checkpoint_manager.records_per_chunk, request_cache=cache, document_factory=datatrove_document
    )
    return runner


def datatrove_document(data: dict[str, Any]) -> Any:
    """A checkpoint line read back as datatrove's `Document`, for its output writer."""
    return DatatroveDocument(
        text=data.get("text", ""),
        id=data["id"],
        media=list(data.get("media") or []),
        metadata=dict(data.get("metadata") or {}),
    )
