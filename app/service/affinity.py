"""Which replica takes a request under `routing = "affinity"` (contract §4, "Routing across replicas").

- the key: the request's `X-Doc-Id`, else the leading `PROMPT_PREFIX_BYTES` of its prompt (the body from
  its `"messages"` or `"prompt"` on, as sent: nothing is parsed), so that a document's rollouts meet on
  one engine, and requests opening with one long system prompt meet too, where the engine's prefix
  cache serves them;
- the ranking: rendezvous (highest random weight) hashing, the replicas ordered by
  `xxh3_64(key, seed=xxh3_64(replica root))`, highest first, over the healthy ones. A replica that comes
  or goes moves only the keys it ranks first; the others' keys stay where they were;
- the bound (consistent hashing with bounded loads, Mirrokni, Thorup and Zadimoghaddam 2018): the first
  replica of the ranking whose requests in flight, this one counted, stay within
  `max(ceil((1 + load_bound) * mean), min_bound)` takes the request, the mean counting this request too
  (`min_bound`: `MIN_BOUND`, or the pool's `max_inflight_per_upstream` when lower). The first choice usually
  does; a hot document or a slow replica spills over to the key's next replica, always the same one, so
  that a spilled document still meets itself there. Some replica is always under the bound:
  their bounds add up to more than the requests in flight.

The rest is `app.service.upstream`'s: health (a failed replica is left out of the ranking until its
probe passes), retries (a retry ranks again, so it goes to the key's next healthy replica).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol, TypeVar

from xxhash import xxh3_64_intdigest

#: How much of a prompt keys a request without `X-Doc-Id`: ~250 tokens, two of vLLM's 128-token cache
#: blocks. Requests that agree that far most likely share a system prompt (or are one prompt sent again);
#: more would part requests that share a long system prompt and differ after it.
PROMPT_PREFIX_BYTES = 1024
#: Requests in flight a replica holds before the bound can pass any on: an engine batches many more at once
#: (vLLM's max_num_seqs is 256 by default), and with few in flight the bound would only part the rollouts
#: of the few documents being generated (one document's 4 rollouts sent at once, alone: 3 in flight, a
#: bound of ceil(1.5 x 4 / 2) = 3, and the 4th went to the other replica, every time). 16 keeps a group of
#: 16 rollouts (GRPO's usual size) together.
MIN_BOUND = 16
#: Where the prompt begins in a body, per route; a body without it is keyed by its own leading bytes.
_PROMPT_FIELD = {"/v1/chat/completions": b'"messages"', "/v1/completions": b'"prompt"'}


class Ranked(Protocol):
    """What the choice reads of a replica."""

    seed: int
    in_flight: int


R = TypeVar("R", bound=Ranked)


def replica_seed(root: str) -> int:
    """A replica's place in every ranking, from its root URL (credentials left out): the same in every
    proxy and every run, whatever the order of the `--upstream` flags."""
    return xxh3_64_intdigest(root.encode())


def request_key(doc_id: str | None, path: str, body: bytes) -> bytes:
    """What ranks the replicas for a request: its document id, else the leading bytes of its prompt."""
    if doc_id is not None:
        return doc_id.encode()
    field = _PROMPT_FIELD.get(path)
    start = body.find(field) if field is not None else -1
    if start < 0:
        start = 0
    return body[start : start + PROMPT_PREFIX_BYTES]


def ranking(key: bytes, replicas: Sequence[R]) -> list[R]:
    """`replicas` in the order `key` prefers them: the first takes its requests while under the bound."""
    return sorted(replicas, key=lambda replica: xxh3_64_intdigest(key, replica.seed), reverse=True)


def choose(key: bytes, replicas: Sequence[R], load_bound: float, min_bound: int = MIN_BOUND) -> tuple[R, R]:
    """The replica that takes a request keyed `key`, and the key's first choice (the same one unless it
    was over the bound, never below `min_bound`: a spill-over)."""
    scores = [xxh3_64_intdigest(key, replica.seed) for replica in replicas]
    first = replicas[scores.index(max(scores))]
    if len(replicas) == 1:
        return first, first
    total = sum(replica.in_flight for replica in replicas)
    # The tolerance: (1 + 0.1) * 10 is 11.000000000000002 in floats, whose ceiling is 12.
    capacity = max(math.ceil((1.0 + load_bound) * (total + 1) / len(replicas) - 1e-9), min_bound)
    if first.in_flight < capacity:
        return first, first  # nearly always: the whole ranking is sorted only for a spill-over
    for replica in ranking(key, replicas)[1:]:
        if replica.in_flight < capacity:
            return replica, first
    return first, first  # not reached: the capacities add up to more than `total`
