"""datatrove pipelines through inferproxy (`pip install 'inferproxy[datatrove]'`).

`ProxyInferenceRunner` is datatrove's `InferenceRunner` (same constructor,
rollout functions `async (document, generate)`, output writer argument and
stats) pointed at a running `inferproxy serve`::

    from app.integrations.datatrove import ProxyInferenceRunner   # was: InferenceRunner

    ProxyInferenceRunner(
        rollout_fn=rollout,
        config=InferenceConfig(server_type="endpoint", endpoint_url="http://127.0.0.1:8080",
                               model_name_or_path="my-model", rollouts_per_document=2),
        output_writer=JsonlWriter(output_dir, output_filename="${rank}_chunk_${chunk_index}.jsonl"),
    )

- every generation goes to the proxy with `X-Doc-Id`, `X-Rollout-Idx`,
  `X-Chunk-Index`, `X-Rank` (and `Authorization` when `config.api_key` is
  set) over kept-alive connections, so the proxy caches it: the runner keeps
  no request cache of its own and writes no sqlite file;
- checkpoints are the proxy's (`ProxyCheckpointManager`: `GET /resume`,
  `POST /documents`, `POST /chunks/{i}/complete`), and so is `records_per_chunk`;
- exactly one party writes the output: the proxy publishes each complete
  chunk to its `--output` under its `--output-filename`. The runner writes
  nothing, and stops at start unless its `output_writer` names that folder
  and that template;
- 429/502/503/504, connection errors and timeouts are retried with
  exponential backoff (`Retry-After` honoured), then the task fails with
  datatrove's `ServerError`, so the executor runs it again; 400 (fresh or
  cached) is datatrove's `InferenceError` with "BadRequestError" in it, so
  `skip_bad_requests=True` works as before; 500 is a `ServerError`, as with
  datatrove's own servers;
- a document the proxy refuses is logged as an error and counted in
  `failed_documents`; the task then fails at its end with the last chunk left
  open, so that a rerun sends the document again once the cause is fixed.

`with_inferproxy_checkpointing(runner)` keeps datatrove's own runner
in-process and gives it inferproxy's `RequestCache` and `CheckpointManager`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
from collections.abc import Iterable, Iterator
from typing import Any
from urllib.parse import urlsplit

import orjson
from datatrove.data import Document as DatatroveDocument
from datatrove.pipeline.inference.run_inference import InferenceRunner
from datatrove.pipeline.inference.types import InferenceError, ServerError
from datatrove.pipeline.writers.jsonl import JsonlWriter

# datatrove's own logger: these messages land in the task logs a datatrove user reads.
from datatrove.utils.logging import logger

from app.checkpointing import CheckpointManager, RequestCache
from app.client import ProxyJob, ProxyJobError, Resume
from app.httpclient import ConnectError, ConnectionLost, HTTPClient, ReadTimeout
from app.publish import is_remote

__all__ = [
    "DocumentRefused",
    "ProxyCheckpointManager",
    "ProxyInferenceRunner",
    "check_output_writer",
    "with_inferproxy_checkpointing",
]

#: Answers worth waiting for: the upstream is busy, restarting or briefly gone.
RETRY_STATUSES = frozenset({429, 502, 503, 504})
#: datatrove's `request_timeout=None` means no timeout; the client needs a number.
NO_TIMEOUT_S = 7 * 24 * 3600.0
_UNREACHABLE = (ConnectError, ConnectionLost, ReadTimeout)


class DocumentRefused(RuntimeError):
    """The proxy would not checkpoint a document: it is not in the output."""

    def __init__(self, doc_id: str, chunk_index: int, reason: str) -> None:
        super().__init__(f"document {doc_id!r} (chunk {chunk_index}): {reason}")
        self.doc_id = doc_id
        self.chunk_index = chunk_index
        self.reason = reason


def proxy_root(endpoint_url: str) -> str:
    """The proxy's root from `endpoint_url`, given with or without `/v1`."""
    parts = urlsplit(endpoint_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            f"endpoint_url must be the proxy's http(s) URL, e.g. http://127.0.0.1:8080, got {endpoint_url!r}"
        )
    return endpoint_url.rstrip("/").removesuffix("/v1")


class ProxyCheckpointManager:
    """datatrove's `CheckpointManager`, kept by the proxy's checkpoint service.

    `records_per_chunk` is the proxy's: given here, it must equal it (a clear
    error otherwise); left out, the proxy's is taken by
    `parse_existing_checkpoints`, which must come first, as in datatrove.
    The output writer given to the methods is checked, never written to.
    """

    def __init__(
        self,
        endpoint_url: str,
        records_per_chunk: int | None = None,
        *,
        api_key: str | None = None,
        retries: int = 5,
    ) -> None:
        if records_per_chunk is not None and records_per_chunk <= 0:
            raise ValueError(
                f"records_per_chunk must be positive (or left out to take the proxy's), got {records_per_chunk}"
            )
        self.proxy_url = proxy_root(endpoint_url)
        self.requested_records_per_chunk = records_per_chunk
        self.records_per_chunk = records_per_chunk
        self.api_key = api_key
        self.retries = retries
        # datatrove's attributes: the checkpoints and the request cache are the proxy's.
        self.checkpoints_local_dir = None
        self.request_cache = None
        self.last_chunk_index = -1
        self.refused: list[DocumentRefused] = []
        self._client: HTTPClient | None = None
        self._job: ProxyJob | None = None
        self._docs_to_skip = 0
        self._position = -1
        self._written = 0
        self._completed = False

    def use_client(self, client: HTTPClient | None) -> None:
        """Send through the caller's client (None: each rank's job opens its own)."""
        self._client = client
        self._job = None

    async def close(self) -> None:
        if self._job is not None:
            await self._job.close()
            self._job = None

    def _job_for(self, rank: int) -> ProxyJob:
        if self._job is None or self._job.rank != rank:
            self._job = ProxyJob(self.proxy_url, rank, self.api_key, retries=self.retries, client=self._client)
        return self._job

    async def parse_existing_checkpoints(self, rank: int, output_writer_context: Any) -> tuple[int, set[str]]:
        """Where this rank resumes, as the proxy says; checks `records_per_chunk` and the output writer."""
        self.last_chunk_index, self.refused = -1, []
        self._position, self._written, self._completed = -1, 0, False
        try:
            state = await self._job_for(rank).resume()
        except _UNREACHABLE as exc:
            raise ServerError(
                f"the proxy at {self.proxy_url} did not answer GET /resume ({exc}): is `inferproxy serve` running "
                f"there, and is endpoint_url its address?"
            ) from exc
        except ProxyJobError as exc:
            hint = " (set InferenceConfig(api_key=...) to the proxy's --api-key)" if exc.status == 401 else ""
            raise ServerError(f"the proxy at {self.proxy_url} refused GET /resume: {exc}{hint}") from exc
        requested = self.requested_records_per_chunk
        if requested is not None and requested != state.records_per_chunk:
            raise ValueError(
                f"records_per_chunk={requested} was given, but the proxy at {self.proxy_url} groups rank {rank} into "
                f"chunks of {state.records_per_chunk} documents: leave records_per_chunk out to use the proxy's, "
                f"or start inferproxy serve with --records-per-chunk {requested} and a fresh --checkpoints-dir "
                f"for a new job"
            )
        if output_writer_context is not None:
            check_output_writer(output_writer_context, state, self.proxy_url)
        self.records_per_chunk = state.records_per_chunk
        self.last_chunk_index = state.last_chunk_index
        self._docs_to_skip = state.docs_to_skip
        return state.docs_to_skip, set(state.processed_ids)

    def chunk_index_gen(self) -> Iterator[int]:
        """The chunk of each input document, in input order (remembering the last one handed out)."""
        if self.records_per_chunk is None:
            raise RuntimeError("call parse_existing_checkpoints() first: records_per_chunk comes from the proxy")
        records_per_chunk = self.records_per_chunk
        while True:
            self._position += 1
            yield self._position // records_per_chunk

    async def write_document(self, document: Any, rank: int, chunk_index: int, output_writer_context: Any) -> None:
        """Checkpoint one finished document at the proxy; returns once it is durable there.

        `DocumentRefused` if the proxy will not take it (remembered: the last
        chunk is then never completed); datatrove's `ServerError` if the proxy
        stays unreachable.
        """
        doc_id = str(document.id)
        try:
            await self._job_for(rank).write_documents([as_checkpoint_dict(document)], chunk_index)
        except ProxyJobError as exc:
            self._refuse(doc_id, chunk_index, str(exc))
        except TypeError as exc:  # orjson: a value in the document that JSON cannot hold
            self._refuse(doc_id, chunk_index, f"it cannot be sent as JSON ({exc}): keep metadata JSON-serialisable")
        except _UNREACHABLE as exc:
            raise ServerError(
                f"the proxy at {self.proxy_url} could not be reached to checkpoint document {doc_id!r} ({exc}): "
                f"the task fails so that the executor runs it again"
            ) from exc
        self._written += 1

    def _refuse(self, doc_id: str, chunk_index: int, reason: str) -> None:
        refused = DocumentRefused(doc_id, chunk_index, reason)
        self.refused.append(refused)
        raise refused

    async def cleanup_last_chunk(self, rank: int, chunk_index: int) -> None:
        """Declare `chunk_index` the rank's last chunk: the proxy publishes it and forgets the rank's working files."""
        self._raise_if_refused(rank)
        try:
            answer = await self._job_for(rank).complete_chunk(chunk_index)
        except _UNREACHABLE as exc:
            raise ServerError(
                f"the proxy at {self.proxy_url} could not be reached to complete chunk {chunk_index}"
            ) from exc
        self._completed = True
        self.last_chunk_index = answer["last_chunk_index"]
        if self.last_chunk_index < chunk_index:
            raise RuntimeError(
                f"rank {rank}: chunk {chunk_index} is complete, but chunk {self.last_chunk_index + 1} has fewer than "
                f"{self.records_per_chunk} distinct documents, so the proxy publishes nothing after chunk "
                f"{self.last_chunk_index}: did this rank's input change between runs, or repeat a document id "
                f"in a chunk?"
            )

    async def finish(self, rank: int) -> None:
        """After datatrove's loop: complete the last chunk if it did not.

        datatrove completes it only when the run processed a document; a rerun
        that finds every document done (killed just before the end) must still
        complete it, or the proxy never publishes it.
        """
        self._raise_if_refused(rank)
        if self._position < 0 or self._completed:
            return
        if self._written == 0 and self._docs_to_skip > self._position:
            logger.warning(
                f"rank {rank}: the proxy at {self.proxy_url} says its first {self._docs_to_skip} documents are done, "
                f"as many as this input has ({self._position + 1}) or more: nothing was processed. If this is a new "
                f"job, start the proxy with a fresh --checkpoints-dir"
            )
        last = self._position // self.records_per_chunk if self.records_per_chunk else 0
        if last > self.last_chunk_index:
            await self.cleanup_last_chunk(rank, last)

    def _raise_if_refused(self, rank: int) -> None:
        if self.refused:
            raise RuntimeError(
                f"rank {rank}: the proxy refused {len(self.refused)} document(s), which are not in the output "
                f"(first: {self.refused[0]}). The last chunk is left open: fix the cause and run this task again; "
                f"its finished documents are skipped and their generations come from the proxy's cache"
            )


def as_checkpoint_dict(document: Any) -> dict[str, Any]:
    """The document as the proxy stores it, without raw media bytes (as JsonlWriter writes it by default)."""
    media = []
    for item in document.media:
        is_media = dataclasses.is_dataclass(item) and not isinstance(item, type)
        entry = dataclasses.asdict(item) if is_media else dict(item)
        if entry.get("media_bytes") is not None:
            entry["media_bytes"] = None
        media.append(entry)
    return {"id": str(document.id), "text": document.text, "media": media, "metadata": document.metadata}


def check_output_writer(writer: Any, state: Resume, proxy_url: str) -> None:
    """Stop unless `writer` would write what the proxy publishes: same format, folder and file names."""
    if state.output is None or state.output_filename is None:
        raise ValueError(
            f"the proxy at {proxy_url} does not say where it publishes (no output in GET /resume): upgrade it"
        )
    wanted = f"JsonlWriter({state.output!r}, {_writer_arguments(state.output_filename)})"
    if not isinstance(writer, JsonlWriter):
        raise ValueError(
            f"output_writer is a {type(writer).__name__}, but the proxy publishes JSON lines: use {wanted}, "
            f"or convert the published output in a later pipeline"
        )
    custom = getattr(writer.adapter, "__func__", None) is not type(writer)._default_adapter
    if custom or writer.expand_metadata or writer.save_media_bytes:
        raise ValueError(
            "output_writer has a custom adapter, expand_metadata=True or save_media_bytes=True, but the proxy "
            "publishes each document as JsonlWriter's defaults do: drop those arguments and shape the document "
            "in the rollout function instead"
        )
    folder = writer.output_folder
    where = folder.path if folder.is_local() else folder.fs.unstrip_protocol(folder.path)
    if not _same_place(folder, state.output):
        raise ValueError(
            f"output_writer writes to {where}, but the proxy at {proxy_url} publishes to {state.output}, and only the "
            f"proxy writes the output: give the writer the proxy's folder, {wanted}, or start inferproxy serve "
            f"with --output {where}"
        )
    template = writer.output_filename.template
    if template != state.output_filename:
        gzip_note = " (JsonlWriter's default compression='gzip' adds .gz)" if template.endswith(".gz") else ""
        raise ValueError(
            f"output_writer names its files {template!r}{gzip_note}, but the proxy at {proxy_url} names them "
            f"{state.output_filename!r}: start inferproxy serve with --output-filename '{template}', or use {wanted}"
        )


def _writer_arguments(output_filename: str) -> str:
    """The JsonlWriter arguments whose effective template is `output_filename`."""
    if output_filename.endswith(".gz"):
        return f"output_filename={output_filename!r}"
    if output_filename.endswith(".zst"):
        return f"output_filename={output_filename!r}, compression='zstd'"
    return f"output_filename={output_filename!r}, compression=None"


def _same_place(folder: Any, output: str) -> bool:
    if folder.is_local():
        return not is_remote(output) and os.path.realpath(folder.path) == os.path.realpath(output)
    if not is_remote(output):
        return False
    parts = urlsplit(output)
    protocols = folder.fs.protocol
    protocols = (protocols,) if isinstance(protocols, str) else tuple(protocols)
    return parts.scheme in protocols and str(folder.path).strip("/") == (parts.netloc + parts.path).strip("/")


def retry_after_s(value: bytes | None) -> float | None:
    """`Retry-After` in seconds (the HTTP-date form is not used by vLLM or the proxy)."""
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


class _DocumentRequests:
    """What datatrove's `_send_request` calls `make_request` on: the proxy, for one rollout of one document."""

    def __init__(self, runner: ProxyInferenceRunner, headers: list[tuple[bytes, bytes]]) -> None:
        self.runner = runner
        self.headers = headers

    async def make_request(self, payload: dict[str, Any]) -> dict[str, Any]:
        return await self.runner._generate(payload, self.headers)


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

    def for_rollout(self, doc_id: str, rollout_idx: int, chunk_index: int) -> _DocumentRequests:
        return _DocumentRequests(
            self.runner,
            [
                *self._common,
                (b"x-doc-id", doc_id.encode()),
                (b"x-rollout-idx", str(rollout_idx).encode()),
                (b"x-chunk-index", str(chunk_index).encode()),
            ],
        )


class ProxyInferenceRunner(InferenceRunner):  # type: ignore[misc]  # datatrove is untyped
    """datatrove's `InferenceRunner` through a running `inferproxy serve`; see the module docstring.

    Arguments are datatrove's, except: `config` must be `server_type="endpoint"`
    with `endpoint_url` the proxy's root; `checkpoints_local_dir` is refused
    (the proxy keeps the checkpoints); `records_per_chunk` defaults to the
    proxy's. `retries` and `retry_backoff_s` (first delay, doubling) bound
    the wait for a proxy or upstream in trouble before the task fails.
    """

    name = "Inference through inferproxy 🔍"

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
            config.endpoint_url, records_per_chunk, api_key=config.api_key, retries=retries
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
        path = "/v1/chat/completions" if config.use_chat else "/v1/completions"
        self._generate_url = self.proxy_url + path

    async def run_async(self, data_gen: Iterable[Any], rank: int = 0) -> None:
        # One client (one pool of kept-alive connections) per run: each task runs in its own event loop.
        client = HTTPClient(read_timeout=self.config.request_timeout or NO_TIMEOUT_S)
        self._client = client
        self.checkpoint_manager.use_client(client)
        try:
            await super().run_async(data_gen, rank)
            await self.checkpoint_manager.finish(rank)
        finally:
            self.checkpoint_manager.use_client(None)
            self._client = None
            await client.close()

    def _init_server(self, rank: int) -> ProxyEndpoint:
        return ProxyEndpoint(self, rank)

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
        # No local cache: the proxy answers a request it has seen from its own.
        if request_counters is not None:
            request_counters[rollout_idx] += 1
        return await self._send_request(server.for_rollout(doc_id, rollout_idx, chunk_index), payload, semaphore)

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

    async def _generate(self, payload: dict[str, Any], headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
        """POST one generation to the proxy, retrying what a busy or restarting server answers."""
        client = self._client
        if client is None:
            raise RuntimeError("ProxyInferenceRunner sends requests only inside run_async()")
        body = orjson.dumps(payload)
        problem = ""
        for attempt in range(self.retries + 1):
            wait = None
            try:
                answer = await client.request("POST", self._generate_url, headers=headers, body=body)
                try:
                    data = await answer.read()
                finally:
                    answer.release()
            except _UNREACHABLE as exc:
                problem = f"{type(exc).__name__}: {exc}"
            else:
                text = data.decode("utf-8", "replace")
                if answer.status == 200:
                    if answer.header(b"x-cache") in (b"HIT", b"COALESCED"):
                        self.stat_update("proxy_cache_hits", value=1, unit="request")
                    result: dict[str, Any] = orjson.loads(data)
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


def with_inferproxy_checkpointing(runner: Any) -> Any:
    """datatrove's own `InferenceRunner`, in-process, on inferproxy's checkpointing library.

    Replaces `runner.request_cache` and `runner.checkpoint_manager` with
    `app.checkpointing`'s `RequestCache` and `CheckpointManager`, built from
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
