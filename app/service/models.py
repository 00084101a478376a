"""The control plane's request and answer bodies as pydantic models: what `/openapi.json` and `/docs` show.

The routes parse and validate their bodies themselves (`app.service.routes`), with the limits and
one-line messages of docs/contract.md, which a framework's generic validation errors would not
keep; these models describe the same shapes for the schema, and `tests/service/test_openapi.py`
checks real answers against them (`extra="forbid"`: a field added to an answer and not here fails it).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# -- errors ----------------------------------------------------------------------------


class ErrorDetail(Strict):
    message: str = Field(description="what went wrong and what to do about it, in one line")
    type: str = Field(description="`invalid_request_error`, `conflict_error`, `output_unavailable`, ...")
    param: str | None = Field(description="the header or field at fault, if one is")
    code: int | str = Field(description="the HTTP status")


class ErrorEnvelope(Strict):
    """Every error the proxy itself answers, in OpenAI's envelope; the upstream's pass through verbatim."""

    error: ErrorDetail


# -- checkpoints -----------------------------------------------------------------------


class Document(Strict):
    id: str = Field(min_length=1, description="unique within the rank: a duplicate is counted, not written")
    text: str
    media: list[Any] = Field(default_factory=list)
    metadata: dict[str, Any] = Field(default_factory=dict)


class Documents(RootModel[Document | list[Document]]):
    """One document, or a non-empty JSON array of them."""


class DocumentsWritten(Strict):
    rank: int
    chunk_index: int
    written: int = Field(description="documents new to the chunk, durable before this answer")
    duplicates: int = Field(description="documents the rank had already: not written again")
    chunk_count: int = Field(description="documents the chunk holds now")
    chunk_complete: bool = Field(description="the chunk is full (records_per_chunk) and published or queued")
    last_chunk_index: int | None = Field(description="the last chunk published in order, null before the first")


class ChunkCompleted(Strict):
    rank: int
    last_chunk_index: int | None
    pending: list[int] = Field(description="complete chunks waiting for an earlier one before they publish")


class ResumePoint(Strict):
    rank: int
    records_per_chunk: int
    last_chunk_index: int | None
    docs_to_skip: int = Field(description="the input documents a restarted job skips: its published chunks")
    processed_ids: list[str] = Field(description="documents checkpointed in chunks not yet published, sorted")
    output: str = Field(description="where the proxy publishes: a folder (absolute) or a URL without credentials")
    output_filename: str


# -- lookups ---------------------------------------------------------------------------


class LookupKey(Strict):
    doc_id: str = Field(min_length=1, description="as `X-Doc-Id`: 1-1024 bytes")
    rollout_idx: int = Field(0, ge=0, description="as `X-Rollout-Idx`")
    body: dict[str, Any] = Field(description="the request body the generation was, or will be, asked with")
    datatrove_payload_hash: str | None = Field(
        None,
        pattern="^[0-9a-f]{32}$",
        description="as `X-Datatrove-Payload-Hash`: the key's payload hash instead of the body's",
    )
    path: Literal["/v1/chat/completions", "/v1/completions"] | None = Field(
        None, description="the route the request goes to: only an answer stored for it is found (absent: any)"
    )


class Lookups(RootModel[list[LookupKey]]):
    """At most 4096 lookups."""


class StoredAnswer(Strict):
    status: int
    content_type: str
    body: Any = Field(None, description="a JSON answer, as JSON")
    text: str | None = Field(None, description="any other answer (a stored stream), as text")


class LookedUp(RootModel[list[StoredAnswer | None]]):
    """One item per lookup, in order: the answer a HIT would replay, or null (send the request itself)."""


# -- files (OpenAI's Files API) ----------------------------------------------------------


class FileObject(Strict):
    """OpenAI's `FileObject`: a file uploaded for batches, or one a batch wrote."""

    id: str = Field(description="`file-` and 24 hex digits")
    object: Literal["file"]
    bytes: int = Field(description="its size, as stored")
    created_at: int = Field(description="when its upload began, in seconds since the epoch")
    filename: str = Field(description="the name the upload gave it")
    purpose: str = Field(description="`batch` for an upload")
    status: Literal["processed"] = Field(description="always `processed`: a file exists once it is whole on disk")
    status_details: None = Field(description="always null")
    expires_at: int | None = Field(
        description="when it expires (`created_at` + the upload's `expires_after[seconds]`), in seconds since the "
        "epoch; null: kept until deleted"
    )


class FileList(Strict):
    object: Literal["list"]
    data: list[FileObject]
    first_id: str | None = Field(description="the first file of this page, null if it is empty")
    last_id: str | None = Field(description="the last file of this page: `after` for the next one")
    has_more: bool = Field(description="more files follow this page")


class FileDeleted(Strict):
    id: str
    object: Literal["file"]
    deleted: Literal[True]


# -- operations -------------------------------------------------------------------------


class Health(Strict):
    status: Literal["ok"]


class Ready(Strict):
    status: Literal["ready"]
    upstreams: dict[str, bool] = Field(description="each upstream's URL and whether it answered `GET /v1/models` now")


class UpstreamView(Strict):
    url: str
    healthy: bool
    in_flight: int
    requests: int
    errors: int
    retries: int
    spilled: int = Field(description="requests of its documents the load bound sent to their next replica")
    latency_p50_s: float | None
    latency_p99_s: float | None


class RankView(Strict):
    rank: int
    owned: bool
    finished: bool
    finished_at: float | None
    hits: int
    coalesced: int
    misses: int
    refreshed: int
    tokens_saved: int
    documents: int
    duplicates: int
    chunks_published: int
    last_chunk_index: int | None
    done_documents: int | None
    total_documents: int | None
    progress: float | None
    documents_per_s: float | None
    eta_s: float | None
    cache_entries: int | None
    cache_bytes: int
    chunks_waiting: int
    publication_error: str | None
    publication_failing_since: float | None
    publication_attempts: int
    publication_retry_in_s: float | None
    chunks_lost: list[int]


class Fsync(Strict):
    count: int
    p99_s: float | None


class Job(Strict):
    ranks_declared: int | None
    ranks_finished: int
    finished: bool


class BatchView(Strict):
    id: str
    status: str
    total: int
    completed: int
    failed: int
    in_flight: int
    usage: dict[str, int] = Field(description="`input_tokens`, `output_tokens`, `total_tokens` of its answers")
    hits: int = Field(description="lines answered from the answers' cache since it started here")
    lines_per_s: float = Field(description="lines done per second since it started here")
    eta_s: float | None = Field(description="at that rate, the seconds left")
    paused: str | None = Field(
        default=None,
        description="why it sends no new line now (its disk is full: what to free), null while it runs",
    )


class Stats(Strict):
    """Everything `/metrics`, the page and `inferproxy status` show (docs/contract.md, "Operations")."""

    version: str
    started_at: float
    now: float
    uptime_s: float
    requests: dict[str, int] = Field(description="requests by outcome (`hit`, `miss`, ...) and `error_<status>`")
    totals: dict[str, int | float | None] = Field(description="the counts since the start, and `hit_ratio`")
    rates: dict[str, float] = Field(description="the last minute's rates per second, and `window_s`")
    in_flight: int
    queued: int
    upstreams: list[UpstreamView]
    routing: Literal["affinity", "least-inflight"] = Field(description="how requests are spread over the upstreams")
    fsync: Fsync
    owned_ranks: list[int]
    job: Job
    ranks: list[RankView]
    forgotten: dict[str, int] = Field(description="the counts of ranks no longer shown one by one")
    history: list[dict[str, float]] = Field(description="the totals sampled every few seconds, `t` their time")
    batches: list[BatchView] = Field(description="the batches this proxy runs now (`/v1/batches` has them all)")
    batches_done: dict[str, int] = Field(
        description="how many batches ended `completed`, `failed`, `cancelled`, `expired` of those this proxy "
        "saw end or found ended in its dir since it started (`/v1/batches` has them)"
    )
