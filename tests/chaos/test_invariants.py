"""The chaos suite's checker itself: a checker that missed a fault would let every scenario pass."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos.invariants import (
    Answer,
    Ledger,
    Observation,
    check_at_rest,
    check_last_chunk_never_moves_back,
    check_replays,
    why_not_whole,
)

STREAM = b'data: {"choices": []}\n\ndata: [DONE]\n\n'


def answer(state: str, data: bytes | None, sent_at: float, received_at: float, status: int = 200) -> Answer:
    return Answer(0, "doc", 0, "/v1/completions", b"{}", False, state, status, data, sent_at, received_at)


def ledger(**options: object) -> Ledger:
    return Ledger({0: ["a", "b", "c"]}, 2, replay_window_s=1.0, **options)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("status", "streamed", "data", "why"),
    [
        (200, True, STREAM, None),
        (200, True, STREAM[: len(STREAM) // 2], "a stream without its final data: [DONE]"),
        (200, True, b'data: {"error": {"message": "engine died"}}\n\n' + STREAM, "a stream with an error event"),
        (200, False, b'{"error": {"message": "x"}}', "an error envelope in a 2xx"),
        (200, False, b'{"object": "error"}', "an error envelope in a 2xx"),
        (200, False, b'{"choices": [', "a body that is not JSON: b'{\"choices\": ['"),
        (400, False, b'{"error": {"message": "too long"}}', None),
        (503, False, b'{"error": {"message": "busy"}}', "status 503"),
    ],
)
def test_what_may_be_stored_and_replayed(status: int, streamed: bool, data: bytes, why: str | None) -> None:
    assert why_not_whole(status, streamed, data) == why


def test_last_chunk_index_may_not_move_back_once_a_higher_one_was_answered() -> None:
    seen = [Observation(0, 3, 1.0, 2.0, "/resume"), Observation(0, 2, 1.5, 2.5, "/resume")]
    assert check_last_chunk_never_moves_back(seen) == []  # asked before the higher one was answered
    moved_back = [*seen, Observation(0, 2, 3.0, 3.1, "the last_chunk file")]
    assert check_last_chunk_never_moves_back(moved_back) == [
        "rank 0: last_chunk_index went back from 3 (/resume) to 2 (the last_chunk file, asked 1.000 s later)"
    ]


def test_an_answer_generated_again_is_lost_unless_the_proxy_died_within_its_window() -> None:
    lost = ledger()
    lost.answers += [answer("MISS", b"{}", 1.0, 1.1), answer("MISS", b"{}", 5.0, 5.1)]
    assert "it was lost" in check_replays(lost)[0]
    excused = ledger(deaths=[1.5])
    excused.answers += lost.answers
    assert check_replays(excused) == []
    too_old = ledger(deaths=[3.0])  # the answer was 1.9 s old at the death: it had to be durable
    too_old.answers += lost.answers
    assert "it was lost" in check_replays(too_old)[0]


def test_a_replay_must_be_whole_and_the_stored_bytes() -> None:
    changed = ledger()
    changed.answers += [answer("MISS", b'{"a": 1}', 1.0, 1.1), answer("HIT", b'{"a": 2}', 2.0, 2.1)]
    assert check_replays(changed) == ["rank 0 'doc' rollout 0: replayed bytes differ from the answer it stored"]
    error = ledger()
    error.answers += [answer("MISS", None, 1.0, 1.1), answer("HIT", b'{"error": {}}', 2.0, 2.1)]
    assert check_replays(error) == ["rank 0 'doc' rollout 0: replayed an answer that is an error envelope in a 2xx"]


def test_on_disk_a_lost_document_a_partial_output_and_a_stray_file_are_found(tmp_path: Path) -> None:
    book = ledger()
    book.acknowledge(0, "a")
    book.acknowledge(0, "c")
    output = tmp_path / "output"
    output.mkdir()
    (output / "00000_chunk_0.jsonl").write_bytes(b'{"id": "a"}\n{"id": "b"}\n')
    (output / ".00000_chunk_1.jsonl.tmp").write_bytes(b'{"id": "c"')
    assert check_at_rest(book, tmp_path / "checkpoints", output) == [
        "rank 0: 1 acknowledged documents are neither published nor checkpointed in an open chunk "
        "(last_chunk_index -1), e.g. ['c']"
    ]
    (output / "00000_chunk_1.jsonl").write_bytes(b'{"id": "c"')
    found = check_at_rest(book, tmp_path / "checkpoints", output, finished=True)
    assert f'output: {output / "00000_chunk_1.jsonl"}: ends in a partial line b\'{{"id": "c"\'' in found
    assert "output: .00000_chunk_1.jsonl.tmp is not a published chunk (left by a crash?)" in found
