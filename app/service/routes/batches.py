"""`/v1/batches`: OpenAI's Batch API on the proxy's own engine (`app.service.batches.engine`, contract §12).

Every answer is an OpenAI `Batch` object, or a list of them; a bad request is a one-line 400 that names the
field and says what to put there, and creates nothing."""

from __future__ import annotations

import logging
from typing import Any

from app.service.asgi import Receive, Scope, json_kind, json_object, read_body, shown_value
from app.service.batches.answers import ENDPOINTS
from app.service.batches.engine import BatchEngine, BatchNotFound, window_seconds
from app.service.errors import BadRequest, InsufficientStorage, NotFound, ServiceUnavailable
from app.service.services import UNWRITABLE_ERRNOS, Services, checkpoints_unwritable
from app.store.batches import BatchRecord, is_batch_id
from app.store.durable import UnsafeFileError, is_disk_full, refusal_reason

logger = logging.getLogger(__name__)

MAX_METADATA = 16
#: OpenAI's usage details, which the upstream's answers do not break down for a batch
NO_TOKEN_DETAILS = {"input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}
LIST_LIMIT = 100


def engine_of(services: Services) -> BatchEngine:
    assert services.batches is not None, "the lifespan starts the batch engine"
    return services.batches


def batch_object(record: BatchRecord) -> dict[str, Any]:
    """`record` as OpenAI's `Batch`."""
    return {
        "id": record.id,
        "object": "batch",
        "endpoint": record.endpoint,
        "errors": {"object": "list", "data": record.errors} if record.errors else None,
        "input_file_id": record.input_file_id,
        "completion_window": record.completion_window,
        "status": record.status,
        "output_file_id": record.output_file_id if record.status not in ("finalizing", "cancelling") else None,
        "error_file_id": record.error_file_id if record.status not in ("finalizing", "cancelling") else None,
        "created_at": record.created_at,
        "in_progress_at": record.in_progress_at,
        "expires_at": record.expires_at,
        "finalizing_at": record.finalizing_at,
        "completed_at": record.completed_at,
        "failed_at": record.failed_at,
        "expired_at": record.expired_at,
        "cancelling_at": record.cancelling_at,
        "cancelled_at": record.cancelled_at,
        "request_counts": {"total": record.total, "completed": record.completed, "failed": record.failed},
        "metadata": record.metadata,
        "usage": {
            **record.usage,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0},
        },
    }


async def create(services: Services, scope: Scope, receive: Receive) -> dict[str, Any]:
    body = await read_body(scope, receive, services.settings.max_body_bytes)
    asked = json_object(body)
    input_file_id = asked.get("input_file_id")
    if input_file_id is None or input_file_id == "":
        raise BadRequest("`input_file_id` is required: the id of a file uploaded to /v1/files", param="input_file_id")
    if not isinstance(input_file_id, str):
        raise BadRequest(
            f"`input_file_id` must be a string, the id of a file uploaded to /v1/files, got {json_kind(input_file_id)}",
            param="input_file_id",
        )
    stored = services.files.get(input_file_id)
    if stored is None:
        raise BadRequest(
            f"no file {shown_value(input_file_id)}: upload the input with POST /v1/files (purpose=batch) first",
            param="input_file_id",
        )
    if stored.purpose != "batch":
        raise BadRequest(
            f"file {input_file_id!r} has purpose {stored.purpose!r}: a batch's input is uploaded with purpose=batch",
            param="input_file_id",
        )
    endpoint = asked.get("endpoint")
    if endpoint not in ENDPOINTS:
        raise BadRequest(
            f"`endpoint` must be one of {', '.join(ENDPOINTS)}, got {shown_value(endpoint)}", param="endpoint"
        )
    window = asked.get("completion_window", "24h")
    if not isinstance(window, str) or window_seconds(window) is None:
        raise BadRequest(
            f"`completion_window` must be from 24h to 999999h, in hours ('24h', '72h'), got {shown_value(window)}",
            param="completion_window",
        )
    metadata = check_metadata(asked.get("metadata"))
    try:
        record = await engine_of(services).create(input_file_id, endpoint, window, metadata)
    except OSError as exc:
        if is_disk_full(exc):
            logger.warning("a batch could not be created: the checkpoints disk is full (%s)", exc)
        raise refused(
            exc, services, "the batch cannot be created", "nothing of it was kept", "create it again"
        ) from exc
    return batch_object(record)


async def forget_output(services: Services, file_id: str) -> None:
    """Before a file is deleted: a batch output's answers are forgotten first, so that a crash in between
    leaves a file whose answers are gone (generated again if asked again), never a deleted output whose
    answers are still served."""
    assert services.batches is not None
    try:
        await services.batches.forget_output(file_id)
    except UnsafeFileError as exc:  # planted where the deleted outputs are recorded: never written through
        raise ServiceUnavailable(f"file {file_id} is not deleted: {exc}") from exc
    except OSError as exc:
        raise refused(
            exc, services, f"file {file_id} is not deleted", "its batch's answers are kept", "delete it again"
        ) from exc


def refused(exc: OSError, services: Services, what: str, kept: str, again: str) -> Exception:
    """What to answer for a write of the batches' that the checkpoints dir refused: 507 for a full disk, 503 for
    one that takes no write (read-only, its permissions gone), else `exc` itself (a 500)."""
    where = services.settings.checkpoints_dir
    if is_disk_full(exc):
        return InsufficientStorage(
            f"{what}: the checkpoints disk is full ({refusal_reason(exc)}), and {kept}; free space under {where}, "
            f"then {again}"
        )
    if exc.errno in UNWRITABLE_ERRNOS:
        return checkpoints_unwritable(exc, where, f"{what}: ")
    return exc


def check_metadata(metadata: Any) -> dict[str, str] | None:
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        raise BadRequest("`metadata` must be an object of strings, or null", param="metadata")
    if len(metadata) > MAX_METADATA:
        raise BadRequest(f"`metadata` holds at most {MAX_METADATA} pairs, got {len(metadata)}", param="metadata")
    for key, value in metadata.items():
        if not isinstance(value, str) or len(key) > 64 or len(value) > 512:
            raise BadRequest(
                f"`metadata` keys are strings of up to 64 characters and values strings of up to 512: "
                f"{shown_value(key)}",
                param="metadata",
            )
    return metadata


def get(services: Services, batch_id: str) -> dict[str, Any]:
    try:
        return batch_object(engine_of(services).get(batch_id))
    except BatchNotFound:
        raise NotFound(f"No batch found with id {batch_id!r}", param="batch_id") from None


def listing(services: Services, after: str | None, asked_limit: str) -> dict[str, Any]:
    """`GET /v1/batches`: in a thread (it reads a page of batch.json files)."""
    limit = int(asked_limit) if asked_limit.isascii() and asked_limit.isdigit() else 0
    if not 1 <= limit <= LIST_LIMIT:
        raise BadRequest(f"`limit` must be an integer from 1 to {LIST_LIMIT}, got {asked_limit[:40]!r}", param="limit")
    if after is not None and not is_batch_id(after):
        raise BadRequest(f"`after` must be a batch id (batch_...), got {shown_value(after)}", param="after")
    # newest first: those made before `after`, even if it is gone
    page, more = engine_of(services).page(after, limit)
    return {
        "object": "list",
        "data": [batch_object(r) for r in page],
        "first_id": page[0].id if page else None,
        "last_id": page[-1].id if page else None,
        "has_more": more,
    }


async def cancel(services: Services, batch_id: str) -> dict[str, Any]:
    try:
        return batch_object(await engine_of(services).cancel(batch_id))
    except BatchNotFound:
        raise NotFound(f"No batch found with id {batch_id!r}", param="batch_id") from None
    except OSError as exc:
        raise refused(exc, services, "the cancel cannot be kept", "the batch runs on", "cancel it again") from exc
