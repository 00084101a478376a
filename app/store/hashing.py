"""The payload hash that keys the request cache.

`payload_hash` is byte-for-byte the value datatrove's
`RequestCache.prepare_payload` returns: the xxHash-128 hex digest of the
payload serialised by orjson with sorted keys. Key order and whitespace of
the original JSON therefore never matter, and a cache written by datatrove
is found by inferproxy and the other way round.
"""

from __future__ import annotations

import re
from typing import Any

import orjson
import xxhash

_HEX_DIGEST = re.compile(r"[0-9a-f]{32}")


def canonical_json(payload: Any) -> bytes:
    """The canonical bytes that are hashed: orjson with `OPT_SORT_KEYS`."""
    return orjson.dumps(payload, option=orjson.OPT_SORT_KEYS)


def payload_hash(payload: Any) -> str:
    """xxh128 hex digest (32 lowercase hex characters) of `canonical_json(payload)`."""
    return xxhash.xxh128_hexdigest(canonical_json(payload))


def is_payload_hash(text: str) -> bool:
    """Whether `text` is what `payload_hash` gives: 32 lowercase hex digits."""
    return _HEX_DIGEST.fullmatch(text) is not None
