"""The Batch API's objects, shaped as OpenAI's (`openai.types.Batch`), for `/openapi.json`."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

Status = Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"]


class BatchCreate(BaseModel):
    input_file_id: str = Field(description="a file uploaded with `purpose=batch`")
    endpoint: Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]
    completion_window: str = Field("24h", description="`24h` or longer, in hours (`72h`): past it, `expired`")
    metadata: dict[str, str] | None = Field(None, description="up to 16 pairs; keys <= 64, values <= 512 chars")


class BatchErrorItem(BaseModel):
    code: str | None = None
    line: int | None = Field(None, description="the input file's line, 1-based")
    message: str | None = None
    param: str | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchErrorItem]


class RequestCounts(BaseModel):
    total: int
    completed: int = Field(description="lines answered 2xx (the output file)")
    failed: int = Field(description="lines answered otherwise, or never (the error file)")


class Usage(BaseModel):
    input_tokens: int
    output_tokens: int
    total_tokens: int


class Batch(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: Status
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts
    metadata: dict[str, str] | None = None
    usage: Usage | None = None


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Batch]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool
