"""What answer from the upstream is stored in the cache, and what is only passed on (contract §3-4).

Stored: a whole answer (a stream that reached `data: [DONE]`, a body not ended by the connection's
close) to a request with `X-Doc-Id`, not `no-store`, whose status is 2xx or one of
`cache_error_statuses`, and that is no error in disguise (a 2xx stream with an error event, a 2xx
body that is an error envelope). Everything else is passed on and generated again when asked again.

A request keyed by datatrove's payload hash (`X-Datatrove-Payload-Hash`) has its answer stored as
datatrove's own runner stores one, so that either runner replays what the other cached from the one file
(`datatrove_form`).
"""

from __future__ import annotations

import logging

import orjson

from app.service.keys import RequestKey
from app.store.cache import RequestCache, StoredResponse

logger = logging.getLogger(__name__)

NO_CHUNK = -1  # the chunk_index stored for requests without X-Chunk-Index: never dropped by a chunk


def is_whole(answer: StoredResponse, *, framed_by_close: bool) -> bool:
    """Whether `answer` is all the upstream meant to send. An answer that ends where the connection does
    may have been cut: passed on, never kept (nor shared with a flight's followers)."""
    if framed_by_close:
        return False
    return not answer.streamed or answer.body.rstrip().endswith(b"data: [DONE]")


def store_if_kept(
    cache: RequestCache | None,
    key: RequestKey,
    digest: str,
    answer: StoredResponse,
    *,
    whole: bool,
    error_statuses: list[int],
    path: str,
) -> bool:
    """Store `answer` in `cache` if the policy keeps it, for the request's `path` (`/v1/chat/completions` or
    `/v1/completions`: it is served to that route only); say so when a 2xx is an error in disguise. Whether
    it was stored."""
    disguised = error_in_disguise(answer) if whole and 200 <= answer.status < 300 else None
    if disguised is not None:
        logger.warning(
            "the upstream answered %s for doc %r (rank %d): passed on, not stored, so that it is generated "
            "again when asked again",
            disguised,
            key.doc_id,
            key.rank,
        )
    if (
        cache is not None
        and key.doc_id is not None
        and whole
        and disguised is None
        and not key.no_store
        and cacheable_status(answer.status, error_statuses)
    ):
        chunk_index = NO_CHUNK if key.chunk_index is None else key.chunk_index
        if key.datatrove_hash is None:
            cache.store_response(chunk_index, key.doc_id, key.rollout_idx, digest, answer, endpoint=path)
            return True
        stored = datatrove_form(answer, chat=path == "/v1/chat/completions")
        if stored is not None:
            form, error_message = stored
            cache.store_response(
                chunk_index, key.doc_id, key.rollout_idx, digest, form, error_message=error_message, endpoint=path
            )
            return True
    return False


def datatrove_form(answer: StoredResponse, *, chat: bool) -> tuple[StoredResponse, str | None] | None:
    """`answer` as datatrove's `InferenceRunner` stores one in its `RequestCache`, with its error message; None
    for an answer it does not store (it could not read it back).

    A 200 completion becomes datatrove's result, `{"text", "finish_reason", "usage", "reasoning"}`, taken
    from the body as its runner takes it; a 400 stays as it is, with the message datatrove gives a bad
    request ("BadRequestError" in it is what its runner replays as one). The proxy replays either as stored.
    """
    if answer.status == 400 and not answer.streamed:
        return answer, "Got BadRequestError from server: " + answer.body.decode("utf-8", "replace")
    if answer.status != 200 or answer.streamed:
        return None
    try:
        body = orjson.loads(answer.body)
        choice = body["choices"][0]
        if chat:
            message = choice["message"]
            text = message.get("content") or ""
            reasoning = message.get("reasoning") or message.get("reasoning_content") or ""
        else:
            text, reasoning = choice["text"] or "", ""
        result = {
            "text": text,
            "finish_reason": choice["finish_reason"],
            "usage": body.get("usage", {}),
            "reasoning": reasoning,
        }
        # orjson reads 1024 levels of nesting but writes only 254 (JSONEncodeError, a TypeError): a result
        # nested deeper is one datatrove's runner could not store either
        form = orjson.dumps(result)
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError, AttributeError):
        return None  # not a completion datatrove's runner could parse, or store, either
    return StoredResponse(200, form, "application/json"), None


def error_in_disguise(answer: StoredResponse) -> str | None:
    """What makes a 2xx answer an error all the same, or None: a stream with an error event (vLLM ends a
    stream so when its engine fails mid-generation, then sends `[DONE]`), or a body that is an error
    envelope (`{"error": ...}`, or vLLM's older `{"object": "error", ...}`). Such answers are never stored."""
    body = answer.body
    if b'"error"' not in body:  # the common case: one scan, no parse
        return None
    if answer.streamed:
        for line in body.split(b"\n"):
            if line.startswith(b"data:") and b'"error"' in line and _is_error(line[5:]):
                return "a stream with an error event"
        return None
    return "a 2xx whose body is an error" if _is_error(body) else None


def _is_error(data: bytes) -> bool:
    try:
        payload = orjson.loads(data)
    except orjson.JSONDecodeError:
        return False
    return isinstance(payload, dict) and ("error" in payload or payload.get("object") == "error")


def cacheable_status(status: int, error_statuses: list[int]) -> bool:
    return 200 <= status < 300 or status in error_statuses
