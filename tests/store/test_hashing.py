from __future__ import annotations

import random
from typing import Any

import pytest
from datatrove.pipeline.inference.checkpointing import RequestCache as DatatroveRequestCache

from app.checkpoints.manager import RequestCache
from app.store.hashing import payload_hash


def random_value(rng: random.Random, depth: int = 0) -> Any:
    kinds = ["str", "int", "float", "bool", "none", "unicode"] + (["list", "dict"] if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "str":
        return "".join(rng.choice('abc xyz\n\t"\\') for _ in range(rng.randint(0, 12)))
    if kind == "unicode":
        return "".join(
            chr(rng.choice([0xE9, 0x4E2D, 0x1F600, 0x0416, 0x05D0, 0x200B])) for _ in range(rng.randint(1, 6))
        )
    if kind == "int":
        return rng.randint(-(2**53), 2**53)
    if kind == "float":
        return rng.choice([0.1, -0.0, 1e-300, 1.5e300, rng.random(), 3.0])
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "none":
        return None
    if kind == "list":
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {
        f"k{rng.randint(0, 99)}{rng.choice('éz中')}": random_value(rng, depth + 1) for _ in range(rng.randint(0, 5))
    }


def chat_payload(rng: random.Random) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": random_value(rng)}],
        "temperature": rng.random(),
        "extra": random_value(rng),
    }


def test_payload_hash_equals_datatrove_prepare_payload_on_many_payloads() -> None:
    rng = random.Random(1234)
    theirs = DatatroveRequestCache(None)
    payloads = [chat_payload(rng) for _ in range(500)]
    assert [payload_hash(p) for p in payloads] == [theirs.prepare_payload(p) for p in payloads]


def test_key_order_does_not_change_the_hash() -> None:
    a = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2}
    b = {"n": 2, "messages": [{"content": "hi", "role": "user"}], "model": "m"}
    assert payload_hash(a) == payload_hash(b)


def test_stream_flag_is_part_of_the_hash() -> None:
    body = {"model": "m", "prompt": "hi"}
    assert payload_hash(body) != payload_hash({**body, "stream": True})


def test_hash_is_32_lowercase_hex_characters() -> None:
    digest = payload_hash({"a": 1})
    assert len(digest) == 32
    assert set(digest) <= set("0123456789abcdef")


@pytest.mark.parametrize("payload", [{"a": "é中😀"}, {"nested": {"z": [1, 2.5, None, True]}}, {}])
def test_request_cache_prepare_payload_is_payload_hash(payload: dict[str, Any]) -> None:
    assert RequestCache(None).prepare_payload(payload) == payload_hash(payload)
