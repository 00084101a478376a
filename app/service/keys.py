"""A request's cache key and the answer stored under it (contract §3): its headers -> a frozen
`RequestKey`, its body -> the payload hash, and `lookup`, the one look into the rank's cache of both
paths: `app.service.app.InferProxy.answer_fast` (a hit answered in the server's protocol callback) and
`app.service.routes.proxy.cacheable` (the ASGI path, which forwards a miss).

Every bad value raises `BadRequest` naming the header in `param` and saying
what a good value looks like; the request is then neither forwarded nor
stored. Only the integer rank and chunk index ever reach a file path.
"""

from __future__ import annotations

import re
from collections.abc import Callable, MutableMapping
from typing import Any, NamedTuple

from app.http.asgi import Answer
from app.service.asgi import Headers, json_object
from app.service.errors import BadRequest
from app.store.cache import RequestCache, StoredResponse
from app.store.hashing import is_payload_hash, payload_hash

#: The routes whose answers are keyed, stored and replayed (the others under /v1 are forwarded as they are).
CACHEABLE_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
MAX_DOC_ID_BYTES = 1024
MAX_RANK = 99_999
MAX_INT64 = 2**63 - 1


#: C0, DEL and C1: every character of Unicode's category Cc.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


class RequestKey(NamedTuple):
    """Who a request works for. `doc_id=None`: not cacheable (X-Cache: BYPASS).

    A NamedTuple rather than a frozen dataclass: as immutable, and built in a
    third of the time on the hit path, where every microsecond shows.
    """

    doc_id: str | None
    rollout_idx: int = 0
    chunk_index: int | None = None
    rank: int = 0
    no_cache: bool = False
    no_store: bool = False
    #: `X-Datatrove-Payload-Hash`: the key's payload hash instead of the body's, and datatrove's form stored
    datatrove_hash: str | None = None


def parse_request_key(headers: list[tuple[bytes, bytes]]) -> RequestKey:
    """Parse raw ASGI headers (lower-case names) into a `RequestKey`; a key header given twice is refused."""
    doc_id: str | None = None
    rollout_idx: int | None = None
    chunk_index: int | None = None
    rank: int | None = None
    datatrove_hash: str | None = None
    no_cache = no_store = False
    for name, value in headers:
        if not name.startswith((b"x-", b"cache-control")):
            continue
        if name == b"x-doc-id":
            if doc_id is not None:
                raise twice("X-Doc-Id")
            doc_id = parse_doc_id(value)
        elif name == b"x-rollout-idx":
            if rollout_idx is not None:
                raise twice("X-Rollout-Idx")
            rollout_idx = parse_int(value, "X-Rollout-Idx")
        elif name == b"x-chunk-index":
            if chunk_index is not None:
                raise twice("X-Chunk-Index")
            chunk_index = parse_int(value, "X-Chunk-Index")
        elif name == b"x-rank":
            if rank is not None:
                raise twice("X-Rank")
            rank = parse_rank(value)
        elif name == b"x-datatrove-payload-hash":
            if datatrove_hash is not None:
                raise twice("X-Datatrove-Payload-Hash")
            datatrove_hash = parse_datatrove_hash(value)
        elif name == b"cache-control":
            directives = {d.strip().lower() for d in value.decode("latin-1").split(",")}
            no_cache = no_cache or "no-cache" in directives
            no_store = no_store or "no-store" in directives
    return RequestKey(doc_id, rollout_idx or 0, chunk_index, rank or 0, no_cache, no_store, datatrove_hash)


def single_header(headers: list[tuple[bytes, bytes]], name: bytes, param: str) -> bytes | None:
    """The value of a header that may be given once (None if absent); `BadRequest` if given twice."""
    found: bytes | None = None
    for key, value in headers:
        if key == name:
            if found is not None:
                raise twice(param)
            found = value
    return found


def twice(header: str) -> BadRequest:
    # Which of two values would win differs between proxies and servers: neither is taken.
    return BadRequest(f"{header} is given more than once: send it once", param=header)


def parse_doc_id(value: bytes) -> str:
    if not value:
        raise BadRequest("X-Doc-Id must not be empty; omit the header to bypass the cache", param="X-Doc-Id")
    if len(value) > MAX_DOC_ID_BYTES:
        raise BadRequest(f"X-Doc-Id must be at most {MAX_DOC_ID_BYTES} bytes, got {len(value)}", param="X-Doc-Id")
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError:
        raise BadRequest("X-Doc-Id must be UTF-8 text", param="X-Doc-Id") from None
    if _CONTROL.search(text):
        raise BadRequest(f"X-Doc-Id must not contain control characters, got {text!r}", param="X-Doc-Id")
    return text


def parse_datatrove_hash(value: bytes) -> str:
    text = value.decode("utf-8", "replace").strip()  # shown as sent in an error
    if not is_payload_hash(text):
        raise BadRequest(
            f"X-Datatrove-Payload-Hash must be 32 lowercase hex digits (datatrove's RequestCache.prepare_payload "
            f"of the rollout's payload), got {text[:40]!r}",
            param="X-Datatrove-Payload-Hash",
        )
    return text


def parse_int(value: bytes, header: str, *, maximum: int = MAX_INT64) -> int:
    """A non-negative integer up to `maximum` (by default what SQLite and orjson store: 64 bits)."""
    text = value.decode("utf-8", "replace").strip()
    limit = "2^63-1" if maximum == MAX_INT64 else str(maximum)
    # the length first: int() of more than 4300 digits raises ValueError
    if not text.isascii() or not text.isdigit() or len(text) > len(str(maximum)) or int(text) > maximum:
        raise BadRequest(f"{header} must be an integer >= 0 and <= {limit}, got {text[:40]!r}", param=header)
    return int(text)


def parse_rank(value: bytes) -> int:
    return parse_int(value, "X-Rank", maximum=MAX_RANK)


def rank_of(scope: MutableMapping[str, Any]) -> int:
    """The request's `X-Rank`, 0 if it has none."""
    value = single_header(scope["headers"], b"x-rank", "X-Rank")
    return 0 if value is None else parse_rank(value)


class Lookup(NamedTuple):
    """A cacheable request parsed, hashed and looked up: what `lookup` found, for whichever path answers.

    `looked` is False when the rank's cache was not open (the fast path opens nothing): `hit` is then
    None for want of a look, and the ASGI path opens the cache and looks again.
    """

    key: RequestKey
    body: bytes
    digest: str
    hit: StoredResponse | None
    looked: bool
    #: the cache looked in and its `stores` then: no answer stored in it since means the look still holds
    cache: RequestCache | None = None
    stores: int = -1


#: The scope extension under which the fast path leaves its `Lookup` for the ASGI path (and says that the
#: request is authenticated: the fast path looks up nothing for a request that is not).
LOOKUP = "inferproxy.lookup"


def lookup(opened: Callable[[int], RequestCache | None], path: str, headers: Headers, body: bytes) -> Lookup:
    """Parse the cache key from `headers`, hash `body`, find the stored answer for `path` (one of
    `CACHEABLE_PATHS`) in the rank's open cache (`opened(rank)`: the service's caches' `opened`, None for a
    rank whose cache is not open).

    The one lookup of both paths: `answer_fast` (synchronously, in the server's protocol callback)
    and `cacheable` (the ASGI path). `BadRequest` for a bad header or body.
    """
    key = parse_request_key(headers)
    digest = payload_digest(body, key.datatrove_hash)
    if key.doc_id is None or key.no_cache:
        return Lookup(key, body, digest, None, True)
    cache = opened(key.rank)
    if cache is None:
        return Lookup(key, body, digest, None, False)  # not looked: the cache is not open
    hit = cache.get_response(
        key.doc_id, key.rollout_idx, digest, datatrove_results=key.datatrove_hash is not None, endpoint=path
    )
    return Lookup(key, body, digest, hit, True, cache, cache.stores)


def stored_answer(answer: StoredResponse, state: bytes, digest: str) -> Answer:
    """A stored answer as it is replayed (a hit, or a flight's shared answer)."""
    headers = [
        (b"content-type", answer.content_type.encode("latin-1")),
        (b"x-cache", state),
        (b"x-payload-hash", digest.encode()),
    ]
    return Answer(answer.status, headers, answer.body)


def payload_digest(body: bytes, given: str | None = None) -> str:
    """The key's payload hash: the body's, or `given` (datatrove's, from `X-Datatrove-Payload-Hash`) for a
    body that is a JSON object all the same."""
    payload = json_object(body)
    if given is None:
        return request_digest(payload)
    if payload.get("stream"):
        raise BadRequest(
            "X-Datatrove-Payload-Hash keys a non-streamed answer, as datatrove's runner asks for: send the request "
            "without `stream`, or without the header",
            param="X-Datatrove-Payload-Hash",
        )
    return given


def request_digest(payload: dict[str, Any]) -> str:
    """`payload_hash` of a parsed body; orjson parses 1024 levels of nesting but serializes only 254."""
    try:
        return payload_hash(payload)
    except TypeError as exc:
        raise BadRequest(f"the request body is nested too deep to be keyed: {exc}") from None
