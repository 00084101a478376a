"""The Batch API's file store: a file is whole or absent whatever a crash interrupts, and a listing pages by
`(created_at, id)`, a deleted file's id included; an expired file is gone but for those told to keep."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest

from app.store.files import STALE_AFTER_S, FileStore, StoredFile, new_file_id


def test_a_writer_abandoned_by_a_crash_leaves_nothing_once_the_store_opens_again(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "files", fsync=False)
    store.open()
    whole = store.start("whole.jsonl", "batch")
    whole.write(b"{}\n")
    kept_file = store.commit(whole)
    cut = store.start("cut.jsonl", "batch")  # the process dies mid-upload: never committed nor abandoned
    cut.write(b"half")
    cut.finish(fsync=False)  # its descriptor closed, as the dead process's are
    renamed = store.start("renamed.jsonl", "batch")  # ... or between the bytes' rename and the metadata
    renamed.write(b"all")
    renamed.finish(fsync=False)
    os.replace(renamed.part, renamed.final)
    assert len(os.listdir(store.root)) == 4
    # just now, they may be another proxy's (a shared checkpoints dir) under way: left alone
    FileStore(tmp_path / "files").open()
    assert len(os.listdir(store.root)) == 4
    hour_ago = time.time() - STALE_AFTER_S - 1
    for name in os.listdir(store.root):
        os.utime(store.root / name, (hour_ago, hour_ago))
    again = FileStore(tmp_path / "files")
    again.open()
    assert sorted(os.listdir(store.root)) == sorted([kept_file.id, kept_file.id + ".json"])
    assert again.list() == [kept_file]


def test_a_store_no_other_process_writes_to_sweeps_what_a_crash_left_at_once(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "files", fsync=False)
    store.open()
    with store.writing("whole.jsonl", "batch") as whole:
        whole.write(b"{}\n")
    cut = store.start("cut.jsonl", "batch")  # the process dies mid-copy: never committed nor abandoned
    cut.write(b"half")
    cut.finish(fsync=False)
    FileStore(tmp_path / "files").open(stale_after_s=0)  # run-batch's, under its lock: just now is old enough
    assert sorted(os.listdir(store.root)) == sorted([whole.id, whole.id + ".json"])


def test_a_reserved_id_cut_short_by_a_crash_is_written_again_over_what_the_crash_left(tmp_path: Path) -> None:
    # A batch's output, its id reserved in batch.json: a kill mid-write left <id>.part, and every later attempt
    # (a restart, another proxy taking the batch over) failed on it, the batch stuck in finalizing.
    store = FileStore(tmp_path / "files", fsync=False)
    store.open()
    cut = store.start("output.jsonl", "batch_output", file_id=new_file_id(time.time()))
    cut.write(b"half of it")
    cut.finish(fsync=False)  # the process dies here
    with store.writing("output.jsonl", "batch_output", file_id=cut.id) as again:
        again.write(b"all of it\n")
    assert (store.root / cut.id).read_bytes() == b"all of it\n"
    assert sorted(os.listdir(store.root)) == sorted([cut.id, cut.id + ".json"])


def test_what_a_crash_left_is_swept_once_unwritten_long_enough_while_the_proxy_runs(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "files", fsync=False)
    store.open()
    cut = store.start("upload.jsonl", "batch")
    cut.write(b"half")
    cut.finish(fsync=False)
    assert store.sweep_half_written() == []  # just written: perhaps another proxy's upload under way
    old = time.time() - STALE_AFTER_S - 1
    os.utime(cut.part, (old, old))
    # an upload this process is still receiving, however long its next piece takes (uvicorn has no body
    # timeout): never its own sweep's
    assert store.sweep_half_written() == []
    cut.done()  # its process died: nobody writes it any more
    assert store.sweep_half_written() == [cut.part.name]
    assert os.listdir(store.root) == []


def test_ids_sort_as_their_files_were_begun_and_a_listing_resumes_after_a_deleted_one(tmp_path: Path) -> None:
    now = [0.0]
    store = FileStore(tmp_path / "files", fsync=False, clock=lambda: now[0])
    store.open()
    made = []
    for second, name in enumerate("abcde"):
        now[0] = 1_700_000_000.5 + second  # a second apart
        with store.writing(f"{name}.jsonl", "batch" if name != "c" else "batch_output") as writer:
            writer.write(name.encode())
        made.append(writer.id)
        assert store.get(writer.id) == StoredFile(writer.id, f"{name}.jsonl", writer.purpose, 1, 1_700_000_000 + second)
    assert [f.id for f in store.list()] == made[::-1]
    assert [f.id for f in store.list(newest_first=False, limit=2)] == made[:2]
    assert [f.id for f in store.list(purpose="batch", after=made[3])] == [made[1], made[0]]
    store.delete(made[2])
    assert [f.id for f in store.list(after=made[2], newest_first=False)] == made[3:]


def test_a_store_sweep_removes_the_expired_files_but_those_it_is_told_to_keep(tmp_path: Path) -> None:
    now = [1_700_000_000.0]
    store = FileStore(tmp_path / "files", fsync=False, clock=lambda: now[0])
    store.open()
    ids = []
    for expires_after in (3600, 3600, 7200, None):
        with store.writing("a.jsonl", "batch") as writer:  # the seconds after its start at which it expires
            writer.expires_after = expires_after
            writer.write(b"{}\n")
        ids.append(writer.id)
        now[0] += 1
    now[0] += 3600
    assert [f.id for f in store.list(newest_first=False)] == ids[2:]
    assert store.get(ids[0]) is None
    assert store.get(ids[0], expired_too=True) is not None  # for the batch reading it
    assert store.remove_expired(keep={ids[1]}) == [ids[0]]
    assert sorted(p.name for p in store.root.iterdir()) == sorted(
        name for file_id in ids[1:] for name in (file_id, file_id + ".json")
    )
    now[0] += 3600
    assert sorted(store.remove_expired()) == sorted(ids[1:3])
    assert [f.id for f in store.list()] == [ids[3]]


def test_a_damaged_or_linked_metadata_file_is_no_file_said_once_and_the_others_are_still_listed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = FileStore(tmp_path / "files", fsync=False)
    store.open()
    kept = [store.commit(writer) for writer in (store.start(f"{i}.jsonl", "batch") for i in range(2))]
    outside = tmp_path / "elsewhere.json"
    outside.write_bytes((store.root / f"{kept[0].id}.json").read_bytes())
    damaged = {
        new_file_id(time.time()): b"[1]",  # JSON, but no file's metadata
        new_file_id(time.time()): b'{"id": "x"}',  # fields missing
        new_file_id(time.time()): b'{"id": "x", "torn',
    }
    for file_id, data in damaged.items():
        (store.root / f"{file_id}.json").write_bytes(data)
    linked = new_file_id(time.time())
    (store.root / f"{linked}.json").symlink_to(outside)  # never read through
    with caplog.at_level(logging.WARNING, logger="app.store.files"):
        for _ in range(3):
            assert sorted(store.list(), key=lambda f: f.id) == sorted(kept, key=lambda f: f.id)
        assert all(store.get(file_id) is None for file_id in [*damaged, linked])
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 4, warned  # one line for each, however often it is met
    assert all("is damaged, so no such file is served" in line for line in warned)
