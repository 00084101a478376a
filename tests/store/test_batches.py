"""app/store/batches.py: a batch's folder as the proxies sharing a checkpoints dir read and write it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import app.store.batches
from app.store.batches import CANCEL, SHARED_RANK, BatchDir, BatchRecord, Result, host_answers, take_shared_answers


def running(root: Path) -> tuple[BatchDir, BatchRecord]:
    folder = BatchDir(root / "batch_0123456789abcdef01234567")
    record = BatchRecord(folder.id, "/v1/chat/completions", "file-x", "24h", 0, 86400, 1, status="in_progress")
    folder.create(record)
    return folder, record


def test_a_cancel_asked_through_another_proxy_survives_the_owners_next_save_of_its_counts(tmp_path: Path) -> None:
    # The owner saved its counts every 2 s from what it loaded before: a cancel another proxy wrote into
    # batch.json in between was saved over, and the batch ran to its end (a 200 "cancelling", then lost).
    folder, record = running(tmp_path)
    loaded = folder.load()  # the owner's look, before the cancel
    folder.ask_cancel(1_700_000_000)  # another proxy's cancel
    folder.save(dataclasses.replace(loaded, completed=12))  # the owner's save of its counts
    seen = folder.load()
    assert (seen.status, seen.cancelling_at, seen.ending, seen.completed) == (
        "cancelling",
        1_700_000_000,
        "cancelled",
        12,
    )
    assert record.status == "in_progress"


def test_a_cancel_asked_of_a_batch_that_ended_meanwhile_changes_nothing(tmp_path: Path) -> None:
    folder, record = running(tmp_path)
    folder.ask_cancel(1_700_000_000)
    folder.save(dataclasses.replace(record, status="completed", completed_at=1_700_000_001))
    assert folder.load().status == "completed"


def test_a_cancel_file_that_holds_no_time_still_asks_for_the_cancel(tmp_path: Path) -> None:
    folder, _ = running(tmp_path)
    (folder.root / CANCEL).write_bytes(b"")
    assert folder.load().status == "cancelling"


def test_a_line_of_nul_bytes_a_power_cut_left_in_the_results_is_skipped_by_every_reader(tmp_path: Path) -> None:
    """`results` (a restart's read) skipped it, and `outputs` (the output file's) raised on it: the batch then
    stayed `finalizing`, its files failing to be written every 10 s."""
    folder = BatchDir(tmp_path / "batch_x")
    folder.root.mkdir()
    folder.append([Result(1, True, (1, 1), b'{"a":1}')], fsync=False)
    with open(folder.root / "results.jsonl", "ab") as f:
        f.write(b"\0" * 30 + b"\n")
    folder.append([Result(2, True, (1, 1), b'{"a":2}')], fsync=False)
    assert [done.line for done in folder.results()] == [1, 2]
    assert [result.line for result in folder.results_in_order()] == [1, 2]
    assert list(folder.outputs()) == [(1, True, b'{"a":1}'), (2, True, b'{"a":2}')]


def test_each_host_keeps_its_answers_in_a_folder_of_its_own_named_by_its_hostname(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # SQLite's WAL shares a file's index through memory, which processes on two hosts cannot: a proxy per
    # node on a shared checkpoints dir wrote one answers' file from every node.
    monkeypatch.setattr(app.store.batches.socket, "gethostname", lambda: "gpu-node-7")
    assert host_answers(str(tmp_path)) == str(tmp_path / "host-gpu-node-7")  # the same after a reboot
    monkeypatch.setattr(app.store.batches.socket, "gethostname", lambda: "../a b/\u00e9")
    assert Path(host_answers(str(tmp_path))).name == "host-.._a_b__"  # never a path of its own


def test_the_one_answers_file_of_before_goes_to_the_first_host_and_no_other(tmp_path: Path) -> None:
    legacy = tmp_path / SHARED_RANK
    legacy.mkdir()
    (legacy / "replay.sqlite3").write_bytes(b"the answers")
    first, second = str(tmp_path / "host-a-1"), str(tmp_path / "host-b-2")
    take_shared_answers(str(tmp_path), first)
    take_shared_answers(str(tmp_path), second)
    assert (Path(first) / SHARED_RANK / "replay.sqlite3").read_bytes() == b"the answers"
    assert not legacy.exists()
    assert not Path(second).exists()  # made by its cache, empty
