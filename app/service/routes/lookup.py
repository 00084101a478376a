"""`POST /lookup`: many cache lookups in one request, for the replay storm of a restarted job.

A restarted job asks again for every generation it had before; each is a
cache hit, and each costs a loopback round trip, whose system calls (a
`send` that wakes the other process, on both sides) cost more than the
lookup itself. A job client that knows the cache keys of the requests it is
about to send asks for all of them at once:

    POST /lookup          X-Rank: 3
    [{"doc_id": "d1", "rollout_idx": 0, "body": {...the request body...}}, ...]

(`"datatrove_payload_hash"` in an item keys it as that header keys the request; `"path"`, the route the
request goes to, finds only an answer stored for that route.)

    200 [{"status": 200, "content_type": "application/json", "body": {...}} | null, ...]

Each answer is what `POST /v1/chat/completions` (or `/v1/completions`) with
that body and `X-Doc-Id`/`X-Rollout-Idx`/`X-Rank` would replay as a HIT, or
null where it would not (a miss: send the request itself), or past
`MAX_ANSWER_BYTES` of stored answers in this reply. JSON answers
come back as JSON values, others (a stored stream) as a string under
`"text"`. Nothing is forwarded or stored, no flight is joined.
"""

from __future__ import annotations

import orjson

from app.service.asgi import Receive, Scope, check_json_cost, read_body
from app.service.errors import BadRequest
from app.service.keys import CACHEABLE_PATHS, rank_of, request_digest
from app.service.services import Services
from app.store.cache import RequestCache, StoredResponse
from app.store.hashing import is_payload_hash

MAX_KEYS = 4096
#: A lookup: doc_id, rollout_idx, payload hash, whether that is datatrove's, and the route (None: any).
LookupKey = tuple[str, int, str, bool, str | None]
#: Stored body bytes one answer holds at most: past them, lookups answer null (and their requests hit).
MAX_ANSWER_BYTES = 16 << 20


async def lookups(services: Services, scope: Scope, receive: Receive) -> bytes:
    """The answers, as the JSON array of the module's docstring."""
    rank = rank_of(scope)
    keys = parse_keys(await read_body(scope, receive, services.settings.max_body_bytes))
    with services.activity.using(rank):
        cache = services.caches.opened(rank) or await services.caches.get(rank)
        answers = looked_up(cache, keys)
    for answer in answers:
        if answer is not None:
            services.metrics.replayed(rank, False, answer.body)
        else:
            services.metrics.lookup_misses += 1
    return b"[" + b",".join(rendered(answer) for answer in answers) + b"]"


def looked_up(cache: RequestCache, keys: list[LookupKey]) -> list[StoredResponse | None]:
    """The stored answers, up to `MAX_ANSWER_BYTES` of bodies in all: null for the rest, whose requests are
    sent (and hit). Without the bound, 4096 lookups of one big answer in a small request are gigabytes."""
    answers: list[StoredResponse | None] = []
    spent = 0
    for doc_id, rollout_idx, digest, datatrove_keyed, path in keys:
        found = spent <= MAX_ANSWER_BYTES
        answer = (
            cache.get_response(doc_id, rollout_idx, digest, datatrove_results=datatrove_keyed, endpoint=path)
            if found
            else None
        )
        if answer is not None:
            spent += len(answer.body)
            if spent > MAX_ANSWER_BYTES:
                answer = None
        answers.append(answer)
    return answers


def parse_keys(body: bytes) -> list[LookupKey]:
    """`(doc_id, rollout_idx, payload_hash, keyed by datatrove's hash, path)` of each item, validated as the
    request headers would be."""
    check_json_cost(body)
    try:
        items = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"the body must be a JSON array of lookups: {exc}") from None
    if not isinstance(items, list):
        raise BadRequest(
            f'the body must be a JSON array of {{"doc_id", "rollout_idx", "body"}}, got {type(items).__name__}'
        )
    if len(items) > MAX_KEYS:
        raise BadRequest(f"at most {MAX_KEYS} lookups per request, got {len(items)}: split them")
    keys = []
    for position, item in enumerate(items):
        if not isinstance(item, dict):
            raise BadRequest(f"lookup {position} must be a JSON object, got {type(item).__name__}")
        doc_id, rollout_idx, request = item.get("doc_id"), item.get("rollout_idx", 0), item.get("body")
        if not isinstance(doc_id, str) or not 0 < len(doc_id.encode()) <= 1024:
            raise BadRequest(f"lookup {position}: doc_id must be a string of 1-1024 bytes, got {doc_id!r}")
        if not isinstance(rollout_idx, int) or isinstance(rollout_idx, bool) or not 0 <= rollout_idx < 2**63:
            raise BadRequest(f"lookup {position}: rollout_idx must be an integer >= 0, got {rollout_idx!r}")
        if not isinstance(request, dict):
            raise BadRequest(f"lookup {position}: body must be the request's JSON object")
        path = item.get("path")
        if path is not None and (not isinstance(path, str) or path not in CACHEABLE_PATHS):
            raise BadRequest(
                f"lookup {position}: path must be {' or '.join(sorted(CACHEABLE_PATHS))} (the route the request goes "
                f"to), or absent, got {path!r:.80}"
            )
        given = item.get("datatrove_payload_hash")
        if given is not None:
            if not isinstance(given, str) or not is_payload_hash(given):
                raise BadRequest(
                    f"lookup {position}: datatrove_payload_hash must be 32 lowercase hex digits, as the "
                    f"X-Datatrove-Payload-Hash header, got {given!r:.60}"
                )
            keys.append((doc_id, rollout_idx, given, True, path))
            continue
        try:
            keys.append((doc_id, rollout_idx, request_digest(request), False, path))
        except BadRequest as exc:
            raise BadRequest(f"lookup {position}: {exc.message}") from None
    return keys


def rendered(answer: StoredResponse | None) -> bytes:
    """One answer's JSON, on its own: one stored body that cannot be passed on as JSON must not spoil the rest."""
    if answer is None:
        return b"null"
    if answer.content_type.startswith("application/json") and not answer.streamed:
        try:
            return orjson.dumps(
                {"status": answer.status, "content_type": answer.content_type, "body": orjson.loads(answer.body)}
            )
        except (orjson.JSONDecodeError, orjson.JSONEncodeError):  # not JSON, or nested deeper than orjson writes
            pass
    text = answer.body.decode("utf-8", "replace")
    return orjson.dumps({"status": answer.status, "content_type": answer.content_type, "text": text})
