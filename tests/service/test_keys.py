from __future__ import annotations

import pytest

from app.service.errors import BadRequest
from app.service.keys import RequestKey, parse_request_key


def parse(**headers: str) -> RequestKey:
    return parse_request_key([(k.lower().replace("_", "-").encode(), v.encode("utf-8")) for k, v in headers.items()])


def test_defaults_without_headers() -> None:
    assert parse() == RequestKey(doc_id=None, rollout_idx=0, chunk_index=None, rank=0)


def test_all_headers_are_read() -> None:
    key = parse(
        x_doc_id="é/../../etc",
        x_rollout_idx="3",
        x_chunk_index="12",
        x_rank="99999",
        cache_control="no-cache, no-store",
    )
    assert key == RequestKey("é/../../etc", 3, 12, 99999, no_cache=True, no_store=True)
    assert parse(x_chunk_index=str(2**63 - 1)).chunk_index == 2**63 - 1


@pytest.mark.parametrize(
    ("headers", "param", "message"),
    [
        ({"x_rollout_idx": "abc"}, "X-Rollout-Idx", "X-Rollout-Idx must be an integer >= 0 and <= 2\\^63-1, got 'abc'"),
        ({"x_rollout_idx": "-1"}, "X-Rollout-Idx", "got '-1'"),
        ({"x_chunk_index": "1.5"}, "X-Chunk-Index", "X-Chunk-Index must be an integer >= 0"),
        ({"x_rank": "100000"}, "X-Rank", "X-Rank must be an integer >= 0 and <= 99999"),
        ({"x_rank": "٣"}, "X-Rank", "X-Rank must be an integer >= 0 and <= 99999, got '٣'"),  # as sent
        # past SQLite's (and orjson's) 64-bit integers, or past Python's 4300-digit int() limit: 400, not 500
        ({"x_chunk_index": str(2**63)}, "X-Chunk-Index", "X-Chunk-Index must be an integer >= 0 and <= 2\\^63-1"),
        ({"x_rollout_idx": str(2**63)}, "X-Rollout-Idx", "X-Rollout-Idx must be an integer >= 0 and <= 2\\^63-1"),
        ({"x_chunk_index": "9" * 5000}, "X-Chunk-Index", "X-Chunk-Index must be an integer"),
        ({"x_rank": "9" * 5000}, "X-Rank", "X-Rank must be an integer >= 0 and <= 99999"),
        ({"x_doc_id": ""}, "X-Doc-Id", "must not be empty"),
        ({"x_doc_id": "a" * 1025}, "X-Doc-Id", "at most 1024 bytes, got 1025"),
        ({"x_doc_id": "a\tb"}, "X-Doc-Id", "control characters"),
        # C1 controls are control characters too (NEL, CSI: a terminal's escape sequence in one character)
        ({"x_doc_id": "a\u0085b"}, "X-Doc-Id", "control characters"),
        ({"x_doc_id": "a\u009bb"}, "X-Doc-Id", "control characters"),
        ({"x_doc_id": "a\u0080b"}, "X-Doc-Id", "control characters"),
    ],
)
def test_bad_values_name_the_header_and_say_what_is_expected(headers: dict[str, str], param: str, message: str) -> None:
    with pytest.raises(BadRequest, match=message) as caught:
        parse(**headers)
    assert caught.value.param == param
    assert caught.value.status == 400


def test_a_doc_id_that_is_not_utf8_is_refused() -> None:
    with pytest.raises(BadRequest, match="UTF-8"):
        parse_request_key([(b"x-doc-id", b"\xff\xfe")])


def test_datatroves_payload_hash_is_read_as_given() -> None:
    digest = "0123456789abcdef" * 2
    assert parse(x_doc_id="d", x_datatrove_payload_hash=digest).datatrove_hash == digest
    assert parse(x_doc_id="d").datatrove_hash is None
    with pytest.raises(BadRequest, match="32 lowercase hex digits") as caught:
        parse(x_datatrove_payload_hash=digest.upper())
    assert caught.value.param == "X-Datatrove-Payload-Hash"
