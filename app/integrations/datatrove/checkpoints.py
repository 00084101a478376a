"""`ProxyCheckpointManager`: datatrove's `CheckpointManager`, kept by the proxy's checkpoint service,
and the check that a datatrove output writer names what the proxy publishes."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import urlsplit

from datatrove.pipeline.inference.types import ServerError
from datatrove.pipeline.writers.jsonl import JsonlWriter

# datatrove's own logger: these messages land in the task logs a datatrove user reads.
from datatrove.utils.logging import logger

from app.checkpoints.output import is_remote
from app.checkpoints.publish import check_output_filename
from app.http.client import ConnectError, ConnectionLost, HTTPClient, ReadTimeout
from app.job.client import ProxyJob, ProxyJobError, Resume, maybe_one_documents_fault
from app.job.run import NEW_JOB_ADVICE

UNREACHABLE = (ConnectError, ConnectionLost, ReadTimeout)


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
    `total_documents`, the documents in each rank's input if known (one
    number for every rank, or one per rank), is declared to the proxy for its
    progress and ETA; else the runner's `declare_input_length` (an input
    counted while it runs); the input's length is declared anyway as the last
    chunk is completed. `total_ranks` (the runner sets it to datatrove's world_size)
    is declared too, so that the proxy says when every rank is finished.
    """

    def __init__(
        self,
        endpoint_url: str,
        records_per_chunk: int | None = None,
        *,
        api_key: str | None = None,
        retries: int = 5,
        total_documents: int | Mapping[int, int] | None = None,
        total_ranks: int | None = None,
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
        self.total_documents = total_documents
        self.total_ranks = total_ranks
        #: the run's input length when it has one (a list), or once its reader's files are counted:
        #: declared when `total_documents` says nothing
        self.input_length: int | None = None
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

    def given_total(self, rank: int) -> int | None:
        """The rank's documents as `total_documents` gives them, if it does."""
        total = self.total_documents
        return total.get(rank) if isinstance(total, Mapping) else total

    def declare_input_length(self, rank: int, documents: int) -> None:
        """The rank's input length, learnt while it runs: declared with the rank's next checkpoint call,
        unless `total_documents` gives it."""
        if self.given_total(rank) is not None:
            return
        self.input_length = documents
        if self._job is not None and self._job.rank == rank:
            self._job.declare_total(documents)

    def _job_for(self, rank: int) -> ProxyJob:
        if self._job is None or self._job.rank != rank:
            known = self.given_total(rank)
            self._job = ProxyJob(
                self.proxy_url,
                rank,
                self.api_key,
                retries=self.retries,
                client=self._client,
                total_documents=known if known is not None else self.input_length,
                total_ranks=self.total_ranks if self.total_ranks is not None and rank < self.total_ranks else None,
            )
        return self._job

    async def parse_existing_checkpoints(self, rank: int, output_writer_context: Any) -> tuple[int, set[str]]:
        """Where this rank resumes, as the proxy says; checks `records_per_chunk` and the output writer."""
        self.last_chunk_index, self.refused = -1, []
        self._position, self._written, self._completed = -1, 0, False
        try:
            state = await self._job_for(rank).resume()
        except UNREACHABLE as exc:
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
            await self._job_for(rank).write_document(as_checkpoint_dict(document), chunk_index)
        except ProxyJobError as exc:
            if not maybe_one_documents_fault(exc):
                # Not this document's fault (the rank owned elsewhere, its checkpoints refusing every write, the
                # output away past unavailable_wait_s, a wrong key): every later one would meet it again, after
                # its generation was paid for. The task fails now, for the executor to run it again.
                raise ServerError(
                    f"the proxy at {self.proxy_url} cannot checkpoint rank {rank}: {exc.message}; the task fails "
                    f"so that the executor runs it again"
                ) from exc
            self._refuse(doc_id, chunk_index, str(exc))
        except TypeError as exc:  # orjson: a value in the document that JSON cannot hold
            self._refuse(doc_id, chunk_index, f"it cannot be sent as JSON ({exc}): keep metadata JSON-serialisable")
        except UNREACHABLE as exc:
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
            # Every input document has gone through chunk_index_gen by now: its count is the rank's total.
            documents = self._position + 1
            if self.input_length is not None and self.input_length != documents:
                logger.warning(
                    f"rank {rank}: its input had {documents} documents, not the {self.input_length} declared to the "
                    f"proxy before: the proxy is told {documents} now"
                )
            answer = await self._job_for(rank).complete_chunk(chunk_index, total_documents=documents)
        except UNREACHABLE as exc:
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
        last = self._position // self.records_per_chunk if self.records_per_chunk else 0
        documents = self._position + 1
        if self.last_chunk_index > last:  # more chunks published than this input has: another job's
            logger.warning(
                f"rank {rank}: the proxy at {self.proxy_url} says its first {self._docs_to_skip} documents are done, "
                f"more than this input has ({documents}): nothing was processed. If this is a new "
                f"job, start the proxy with a fresh --checkpoints-dir"
            )
        elif self._written == 0 and self._docs_to_skip > self._position:
            # Its last chunk published (docs_to_skip counts whole chunks: past the input's end): as run_job says it
            # loguru's logger (datatrove's): it formats no %-args
            logger.info(f"rank {rank}: all {documents} documents were already done: nothing to do ({NEW_JOB_ADVICE})")
        if last >= self.last_chunk_index:  # published already (a rerun of a finished rank): finished again
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
        try:
            check_output_filename(template)
            serve = f"start inferproxy serve with --output-filename '{template}', or "
        except ValueError:  # a name serve refuses (without ${chunk_index}, say): only the writer can change
            serve = "the proxy publishes each chunk as a file of its own, named with ${rank} and ${chunk_index}: "
        raise ValueError(
            f"output_writer names its files {template!r}{gzip_note}, but the proxy at {proxy_url} names them "
            f"{state.output_filename!r}: {serve}use {wanted}"
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
