"""`inferproxy inspect`: a checkpoints dir read without writing, and /resume predicted as a restore computes it."""

from __future__ import annotations

import errno
import os
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from app.checkpoints.manager import META_FILENAME
from app.cli import main
from app.store.batches import BatchDir, BatchRecord, new_batch_id
from app.store.files import FileStore
from app.store.layout import CheckpointsLayout
from app.store.ownership import RankOwnedError, RankOwnership
from app.tools.inspect import inspect_dir, render, to_json
from tests.factories import (
    RecordingWriter,
    chunk_path,
    dir_snapshot,
    last_chunk_path,
    manager,
    open_cache,
    write_chunk_file,
)
from tests.servers import run_cli

RPC = 3
TORN = b'{"text":"text of z","id":"z'


def checkpoints(root: Path, last_chunk: str | None = None, chunks: dict[int, list[str]] | None = None) -> Path:
    """A checkpoints dir of rank 0 recorded with records_per_chunk=3."""
    root.mkdir(exist_ok=True)
    (root / META_FILENAME).write_bytes(orjson.dumps({"records_per_chunk": RPC}))
    if last_chunk is not None:
        Path(last_chunk_path(root)).parent.mkdir(exist_ok=True)
        Path(last_chunk_path(root)).write_text(last_chunk)
    for chunk_index, ids in (chunks or {}).items():
        write_chunk_file(root, chunk_index, ids)
    return root


def torn(root: Path, chunk_index: int) -> None:
    with open(chunk_path(root, chunk_index), "ab") as f:
        f.write(TORN)


def torn_line(root: Path) -> None:
    checkpoints(root, chunks={0: ["a", "b"]})
    torn(root, 0)


def full_chunk_not_yet_published(root: Path) -> None:
    checkpoints(root, "0", {1: ["d", "e", "f"], 2: ["g"]})


def full_chunk_past_a_gap(root: Path) -> None:
    checkpoints(root, chunks={0: ["a", "b"], 1: ["d", "e", "f"]})


def published_chunk_left_by_a_crash(root: Path) -> None:
    checkpoints(root, "1", {1: ["d", "e", "f"], 2: ["g", "h"]})
    torn(root, 2)


def a_document_written_twice(root: Path) -> None:
    checkpoints(root, chunks={0: ["a", "a", "b"]})


def an_empty_last_chunk_file(root: Path) -> None:
    checkpoints(root, "", {0: ["a"]})


def only_a_last_chunk_file(root: Path) -> None:
    checkpoints(root, "4")


def a_last_chunk_file_beyond_any_chunk_index(root: Path) -> None:
    checkpoints(root, "9" * 29, {0: ["a"]})


@pytest.mark.parametrize(
    "make",
    [
        torn_line,
        full_chunk_not_yet_published,
        full_chunk_past_a_gap,
        published_chunk_left_by_a_crash,
        a_document_written_twice,
        an_empty_last_chunk_file,
        only_a_last_chunk_file,
        a_last_chunk_file_beyond_any_chunk_index,
    ],
)
async def test_inspect_writes_nothing_and_predicts_what_a_restore_resumes_from(
    tmp_path: Path, make: Callable[[Path], None]
) -> None:
    root = tmp_path / "checkpoints"
    make(root)
    before = dir_snapshot(root)
    report = inspect_dir(str(root))
    render(report)
    assert dir_snapshot(root) == before
    (rank,) = report.ranks
    assert rank.resume is not None

    restored = manager(root, RPC)
    await restored.parse_existing_checkpoints(0, RecordingWriter())
    skip, processed = restored.resume_state()
    assert (rank.resume.last_chunk_index, rank.resume.docs_to_skip, rank.resume.processed_ids) == (
        restored.last_chunk_index,
        skip,
        frozenset(processed),
    )
    for chunk in rank.chunks:
        path = chunk_path(root, chunk.chunk_index)
        if chunk.chunk_index <= rank.resume.last_chunk_index:  # published: its file is deleted
            assert not os.path.exists(path)
        else:  # a torn line is cut off where inspect said
            assert os.path.getsize(path) == (chunk.bytes if chunk.torn_at is None else chunk.torn_at)
    await restored.close()


def test_a_torn_line_is_reported_with_the_offset_a_restart_cuts_back_to(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    torn_line(root)
    whole = os.path.getsize(chunk_path(root, 0)) - len(TORN)
    report = inspect_dir(str(root))
    (rank,) = to_json(report)["ranks"]
    assert rank["chunks"] == [
        {
            "chunk_index": 0,
            "documents": 2,
            "bytes": whole + len(TORN),
            "state": "open",
            "torn": {"offset": whole, "bytes": len(TORN)},
        }
    ]
    assert rank["torn_lines"] == 1
    assert rank["resume"] == {
        "last_chunk_index": -1,
        "docs_to_skip": 0,
        "processed_id_count": 2,
        "source": "checkpoints",
    }
    assert (
        f"rank 0: chunk 0 ends in a torn line ({len(TORN)} bytes): a restart cuts the file back to {whole} bytes"
        in render(report)
    )


def test_full_and_published_chunk_files_are_told_apart_from_open_ones(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    checkpoints(root, "1", {1: ["a", "b", "c"], 2: ["d", "e", "f"], 3: ["g"]})
    report = inspect_dir(str(root))
    (rank,) = report.ranks
    assert [(c.chunk_index, c.documents, c.state) for c in rank.chunks] == [
        (1, 3, "published"),
        (2, 3, "full"),
        (3, 1, "open"),
    ]
    assert rank.resume is not None
    assert (rank.resume.last_chunk_index, rank.resume.docs_to_skip) == (2, 9)
    text = render(report)
    assert "rank 0: chunk 2 is full: a restart publishes it" in text
    assert "rank 0: chunk 1 is published already (left by a crash): a restart deletes its file" in text
    assert "1: 3 (published), 2: 3 (full), 3: 1" in text


def test_an_empty_last_chunk_file_is_a_problem_and_resume_starts_from_nothing(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    an_empty_last_chunk_file(root)
    report = inspect_dir(str(root))
    (rank,) = report.ranks
    assert rank.last_chunk_index == -1
    assert rank.resume is not None
    assert rank.resume.last_chunk_index == -1
    assert len(rank.problems) == 1
    assert "last_chunk/00000.txt is empty or unreadable ('')" in rank.problems[0]
    assert "problem: rank 0: " in render(report)


def test_a_dir_without_records_per_chunk_says_so_and_takes_it_from_the_flag(tmp_path: Path) -> None:
    root = checkpoints(tmp_path / "checkpoints", "0", {1: ["a", "b"]})
    (root / META_FILENAME).unlink()  # as datatrove writes it
    report = inspect_dir(str(root))
    assert report.records_per_chunk is None
    (problem,) = report.problems
    assert "checkpoint_meta.json is missing, so records_per_chunk is unknown" in problem
    assert "pass --records-per-chunk N" in problem
    assert report.ranks[0].resume is None
    assert "records_per_chunk not recorded" in render(report)

    given = inspect_dir(str(root), records_per_chunk=2)
    assert "the numbers below use --records-per-chunk 2" in given.problems[0]
    resume = given.ranks[0].resume
    assert resume is not None
    assert (resume.last_chunk_index, resume.docs_to_skip) == (1, 4)


async def test_a_proxys_dir_with_caches_only_is_a_note_not_a_problem_and_resumes_at_the_start(
    tmp_path: Path,
) -> None:
    # The README's first use of the proxy: requests cached, no document sent yet, so nothing recorded. It
    # ended with "problem: ...checkpoint_meta.json is missing" and a RESUME of "?": nothing is wrong.
    root = tmp_path / "checkpoints"
    cache = await open_cache(root)
    await cache.close()
    report = inspect_dir(str(root))
    assert report.problems == []
    assert report.notes == [
        "checkpoint_meta.json is not written yet: no document checkpointed yet, the ranks hold request caches only "
        "(a proxy records records_per_chunk with the first one)"
    ]
    (rank,) = report.ranks
    assert rank.resume is not None
    assert (rank.resume.last_chunk_index, rank.resume.docs_to_skip, rank.resume.processed_ids) == (-1, 0, frozenset())
    text = render(report)
    assert "problem:" not in text
    assert "records_per_chunk" not in text.splitlines()[0]
    assert "last_chunk_index -1, docs_to_skip 0, 0 processed_ids" in text
    assert to_json(report)["notes"] == report.notes


def test_the_parent_of_a_checkpoints_dir_is_named_with_the_dir_it_holds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # `inspect inferproxy-data`, the parent of the default checkpoints dir, said only "is not a checkpoints dir".
    data = tmp_path / "inferproxy-data"
    data.mkdir()
    checkpoints(data / "checkpoints")
    (data / "output").mkdir()
    os.symlink(data / "checkpoints", data / "linked")  # not followed
    assert main(["inspect", str(data)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (
        f"inferproxy inspect: {data} is not a checkpoints dir: it holds checkpoints/: "
        f"did you mean {data / 'checkpoints'}?\n"
    )


def test_a_records_per_chunk_other_than_the_recorded_one_is_reported_and_not_used(tmp_path: Path) -> None:
    root = checkpoints(tmp_path / "checkpoints", "0")
    report = inspect_dir(str(root), records_per_chunk=5)
    (problem,) = report.problems
    assert "--records-per-chunk 5: a proxy started with it refuses to" in problem
    assert "written with records_per_chunk=3" in problem
    resume = report.ranks[0].resume
    assert resume is not None
    assert resume.docs_to_skip == 3


def test_a_corrupt_chunk_line_means_no_restore_and_no_prediction(tmp_path: Path) -> None:
    root = checkpoints(tmp_path / "checkpoints", chunks={0: ["a"]})
    with open(chunk_path(root, 0), "ab") as f:
        f.write(b"{not json\n")
    write_chunk_file(root, 0, ["b"])
    before = dir_snapshot(root)
    report = inspect_dir(str(root))
    assert dir_snapshot(root) == before
    (rank,) = report.ranks
    assert (rank.resume, rank.chunks[0].documents) == (None, None)
    assert "a restarted proxy cannot restore this rank" in rank.problems[0]
    assert "line 2 is not valid JSON" in rank.problems[0]


def test_a_live_owner_lock_is_reported_held_and_the_probe_leaves_it_held(tmp_path: Path) -> None:
    root = checkpoints(tmp_path / "checkpoints")
    layout = CheckpointsLayout(str(root))
    owner = RankOwnership(layout, port=8123)
    owner.claim(4)
    try:
        before = dir_snapshot(root)
        report = inspect_dir(str(root))
        assert dir_snapshot(root) == before
        (rank,) = to_json(report)["ranks"]
        assert rank["rank"] == 4
        assert {key: rank["owner"][key] for key in ("held", "pid", "port")} == {
            "held": True,
            "pid": os.getpid(),
            "port": 8123,
        }
        assert f"held by pid {os.getpid()} on " in render(report)
        with pytest.raises(RankOwnedError):  # still held by its owner: the probe let go of nothing but its own
            RankOwnership(layout).claim(4)
    finally:
        owner.release_all()
    (released,) = to_json(inspect_dir(str(root)))["ranks"]
    assert released["owner"] == {"held": False, "host": None, "pid": None, "port": None, "since": None}
    assert "free (released)" in render(inspect_dir(str(root)))


async def test_cache_entries_are_read_from_the_wal_with_or_without_its_index_writing_nothing(tmp_path: Path) -> None:
    root = checkpoints(tmp_path / "checkpoints", chunks={0: ["a"]})
    rank_dir = root / "00000"
    cache = await open_cache(root)
    for i in range(5):
        await cache.store_result(0, f"doc-{i}", 0, {"answer": i}, payload_hash="h")
    await cache.flush()

    def entries() -> int | None:
        # In another process, as the command runs: SQLite shares one WAL index per file within a process.
        before = dir_snapshot(root)
        done = run_cli("inspect", str(root), "--json")
        assert dir_snapshot(root) == before
        entries: int | None = orjson.loads(done.stdout)["ranks"][0]["cache"]["entries"]
        return entries

    assert (rank_dir / "replay.sqlite3-wal").stat().st_size > 0
    assert entries() == 5  # open: WAL and index in use
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)  # the WAL without its index, as a copy taken without it leaves them
    (copy / "00000" / "replay.sqlite3-shm").unlink()
    before = dir_snapshot(copy)
    assert inspect_dir(str(copy)).ranks[0].cache_entries == 5
    assert dir_snapshot(copy) == before
    await cache.close()
    assert not (rank_dir / "replay.sqlite3-wal").exists()
    assert entries() == 5  # closed: all in the main file


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda root: None, "does not exist: give the --checkpoints-dir of the proxy to inspect"),
        (lambda root: root.write_text("x"), "is a file, not a checkpoints dir"),
        (lambda root: root.mkdir(), "is empty: not a checkpoints dir"),
        (lambda root: (root / "sub").mkdir(parents=True), "is not a checkpoints dir: it holds none of"),
    ],
    ids=["missing", "file", "empty", "unrelated"],
)
def test_a_path_that_is_not_a_checkpoints_dir_gets_one_line_and_exit_2(
    tmp_path: Path, make: Callable[[Path], object], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "dir"
    make(root)
    assert main(["inspect", str(root)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == f"inferproxy inspect: {root} {message}" + err.split(message, 1)[1]
    assert err.count("\n") == 1


def test_a_path_under_a_file_or_an_empty_one_gets_one_line_naming_what_is_wrong(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A path under a file was said to be the file itself, and '' inspected the current folder.
    (tmp_path / "afile").write_text("x")
    assert main(["inspect", str(tmp_path / "afile" / "sub")]) == 2
    out, err = capsys.readouterr()
    assert (out, err) == (
        "",
        f"inferproxy inspect: {tmp_path / 'afile' / 'sub'} cannot be a checkpoints dir: "
        f"{tmp_path / 'afile'} is a file, not a folder\n",
    )
    checkpoints(tmp_path / "checkpoints")
    monkeypatch.chdir(tmp_path / "checkpoints")
    assert main(["inspect", ""]) == 2
    out, err = capsys.readouterr()
    assert (out, err) == (
        "",
        "inferproxy inspect: the path is empty: give the --checkpoints-dir of the proxy to inspect\n",
    )


def test_an_unreadable_dir_gets_one_line_and_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    root = checkpoints(tmp_path / "checkpoints")
    os.chmod(root, 0)
    if os.geteuid() == 0:
        # Root reads any dir, and running the command as another user needs the clone (and its venv)
        # readable by that user, which a clone in a private folder (mktemp -d: CI's) is not: the refusal
        # a user without the right gets is made here.
        real_listdir = os.listdir

        def refusing(path: Any = ".") -> list[str]:
            if Path(path) == root:
                raise PermissionError(errno.EACCES, "Permission denied", str(path))
            return real_listdir(path)

        monkeypatch.setattr(os, "listdir", refusing)
    try:
        assert main(["inspect", str(root)]) == 2
    finally:
        os.chmod(root, stat.S_IRWXU)
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"inferproxy inspect: cannot read {root}: Permission denied\n"


#: A folder of a checkpoints dir made unreadable (its mode), and the problem line that says so: the dir's, a
#: rank's (`rank N`, its resume then null) or a batch's (`batch`).
UNREADABLE = {
    "owners/": ("owners", 0, "dir", "cannot list {root}/owners: Permission denied"),
    "last_chunk/": ("last_chunk", 0, "dir", "cannot list {root}/last_chunk: Permission denied"),
    "a rank folder": ("00001", 0, "rank 1", "cannot list {root}/00001: Permission denied"),
    "a rank folder not searchable": ("00001", 0o444, "rank 1", "cannot read {root}/00001/replay.sqlite3"),
    "files/": ("files", 0, "dir", "cannot list {root}/files: Permission denied"),
    "batches/": ("batches", 0, "dir", "cannot list {root}/batches: Permission denied"),
    "batches/ not searchable": ("batches", 0o444, "batch", "cannot read {root}/batches/{batch}: Permission denied"),
    "a host's answers": ("batches/answers/host-x", 0, "dir", "cannot read {root}/batches/answers/host-x/00000"),
    "a host's answers' folder": (
        "batches/answers/host-x/00000",
        0,
        "dir",
        "cannot read {root}/batches/answers/host-x/00000/replay.sqlite3: Permission denied",
    ),
}


@pytest.mark.parametrize(("where", "mode", "whose", "problem"), UNREADABLE.values(), ids=UNREADABLE.keys())
def test_a_folder_that_cannot_be_read_is_a_problem_line_not_a_traceback(
    tmp_path: Path, where: str, mode: int, whose: str, problem: str
) -> None:
    # A dir another user left, or a folder of it made private: each was a PermissionError traceback and exit
    # 1. Modes stop only a process without CAP_DAC_OVERRIDE: as root, inspect runs without any capability.
    without_capabilities = ["setpriv", "--bounding-set=-all", "--inh-caps=-all"] if os.geteuid() == 0 else []
    root = checkpoints(tmp_path / "checkpoints", "0", {1: ["a"]})
    write_chunk_file(root, 0, ["b"], rank=1)
    owner = RankOwnership(CheckpointsLayout(str(root)))
    owner.claim(1)
    owner.release_all()
    store = FileStore(root / "files")
    store.open()
    with store.writing("in.jsonl", "batch") as upload:
        upload.write(b"{}\n")
    batch_id = new_batch_id(time.time())
    folder = BatchDir(root / "batches" / batch_id)
    folder.create(BatchRecord(batch_id, "/v1/chat/completions", upload.id, "24h", 0, 86400, 7, status="in_progress"))
    folder.release()
    (root / "batches" / "answers" / "host-x" / "00000").mkdir(parents=True)
    os.chmod(root / where, mode)
    try:
        done = subprocess.run(
            [*without_capabilities, sys.executable, "-m", "app.cli", "inspect", str(root), "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        os.chmod(root / where, stat.S_IRWXU)
    assert (done.returncode, done.stderr) == (0, "")
    report = orjson.loads(done.stdout)
    expected = problem.format(root=root, batch=batch_id)
    ranks = {rank["rank"]: rank for rank in report["ranks"]}
    if whose == "dir":
        assert any(line.startswith(expected) for line in report["problems"]), report["problems"]
    elif whose == "batch":
        (batch,) = report["batches"]
        assert any(line.startswith(expected) for line in batch["problems"]), batch["problems"]
    else:
        assert any(line.startswith(expected) for line in ranks[1]["problems"]), ranks[1]["problems"]
        assert ranks[1]["resume"] is None
    assert ranks[0]["resume"] is not None  # the rest is read
    if where == "files":  # its input may be there: unknown, not missing
        (batch,) = report["batches"]
        assert (batch["input_file_exists"], batch["problems"]) == (None, [])


def test_json_has_every_key_and_rank_restricts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = checkpoints(tmp_path / "checkpoints", "0", {1: ["a"]})
    Path(last_chunk_path(root, 2)).write_text("3")
    assert main(["inspect", str(root), "--json"]) == 0
    report = orjson.loads(capsys.readouterr().out)
    assert set(report) == {
        "checkpoints_dir",
        "records_per_chunk",
        "problems",
        "notes",
        "ranks",
        "batches",
        "files",
        "answers",
    }
    assert (report["batches"], report["files"], report["answers"]) == ([], [], None)
    assert [rank["rank"] for rank in report["ranks"]] == [0, 2]
    assert set(report["ranks"][0]) == {
        "rank",
        "last_chunk_index",
        "chunks",
        "torn_lines",
        "cache",
        "owner",
        "resume",
        "problems",
    }
    assert main(["inspect", str(root), "--json", "--rank", "2"]) == 0
    (only,) = orjson.loads(capsys.readouterr().out)["ranks"]
    assert (only["rank"], only["resume"]["docs_to_skip"]) == (2, 12)
    assert main(["inspect", str(root), "--rank", "2"]) == 0
    table = capsys.readouterr().out
    assert "1 rank\n" in table
    assert "\n2 " in table
    assert "\n0 " not in table


def test_an_output_filename_without_an_output_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = checkpoints(tmp_path / "checkpoints", "0")
    assert main(["inspect", str(root), "--output-filename", "${rank}_${chunk_index}.jsonl"]) == 2
    assert (
        capsys.readouterr().err == "inferproxy inspect: --output-filename names files in --output: give --output too\n"
    )
    assert main(["inspect", str(root), "--output", str(tmp_path), "--output-filename", "chunk.jsonl"]) == 2
    assert "inferproxy inspect: output_filename must use ${rank} and ${chunk_index}" in capsys.readouterr().err


def test_a_rank_without_checkpoints_resumes_after_the_chunks_the_output_lists(tmp_path: Path) -> None:
    root = checkpoints(tmp_path / "checkpoints")
    owner = RankOwnership(CheckpointsLayout(str(root)))
    owner.claim(5)  # claimed, nothing written yet; or its checkpoints were lost with a node's disk
    owner.release_all()
    output = tmp_path / "output"
    output.mkdir()
    for chunk_index in (0, 1, 3):
        (output / f"00005_chunk_{chunk_index}.jsonl").write_text("{}\n")
    (rank,) = to_json(inspect_dir(str(root), output=str(output)))["ranks"]
    assert rank["resume"] == {"last_chunk_index": 1, "docs_to_skip": 6, "processed_id_count": 0, "source": "output"}
    (unchecked,) = to_json(inspect_dir(str(root)))["ranks"]
    assert unchecked["resume"]["source"] == "unchecked_output"
    assert unchecked["resume"]["last_chunk_index"] == -1


def test_a_last_chunk_file_beyond_any_chunk_index_is_reported_as_a_restore_reads_it(tmp_path: Path) -> None:
    root = checkpoints(tmp_path / "checkpoints", str(2**31), {0: ["a"]})
    (rank,) = inspect_dir(str(root)).ranks
    assert rank.last_chunk_index == -1
    assert rank.resume is not None
    assert (rank.resume.last_chunk_index, rank.resume.docs_to_skip) == (-1, 0)
    (problem,) = rank.problems
    assert f"is empty or unreadable ('{2**31}'): not a chunk index from -1 to {2**31 - 1}" in problem


SECRET = "content of a file outside the checkpoints dir"
#: Entries a hostile writer of a shared checkpoints dir may plant: where each is.
PLANTED = {
    "chunk file": "00007/chunk_00001.jsonl",
    "meta file": META_FILENAME,
    "last_chunk file": "last_chunk/00007.txt",
    "request cache": "00007/replay.sqlite3",
    "cache's WAL": "00007/replay.sqlite3-wal",
    "owner lock": "owners/00007.lock",
}


def plant(root: Path, where: str, kind: str) -> Path:
    """A link to a file outside the dir, or a FIFO, at `where` in `root`, in place of what was there."""
    path = root / where
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    if kind == "link":
        outside = root.parent / "outside.txt"
        outside.write_text(SECRET)  # no newline: a "torn line" a repair would have cut
        path.symlink_to(outside)
    else:
        os.mkfifo(path)  # opened for reading, blocked for ever
    return path


@pytest.mark.parametrize("kind", ["link", "fifo"])
@pytest.mark.parametrize("where", PLANTED.values(), ids=PLANTED.keys())
def test_a_planted_link_or_fifo_is_a_problem_line_and_never_opened(tmp_path: Path, where: str, kind: str) -> None:
    root = checkpoints(tmp_path / "checkpoints", "0", {1: ["a"]})
    write_chunk_file(root, 0, ["b"], rank=7)
    path = plant(root, where, kind)
    before = dir_snapshot(root)
    report = inspect_dir(str(root))
    text, as_json = render(report), orjson.dumps(to_json(report)).decode()
    assert dir_snapshot(root) == before
    what = "a symbolic link" if kind == "link" else "a FIFO"
    refusal = f"{path} is {what}, not a regular file"
    if where == META_FILENAME:
        assert f"problem: a restarted proxy refuses to start: {refusal}" in text
    else:
        refuses = "cannot restore" if where == PLANTED["chunk file"] else "refuses"
        assert f"problem: rank 7: a restarted proxy {refuses} this rank: {refusal}" in text
        assert next(rank for rank in report.ranks if rank.rank == 7).resume is None
        assert next(rank for rank in report.ranks if rank.rank == 0).resume is not None  # the others are read
    assert SECRET not in text
    assert SECRET not in as_json


def test_a_linked_rank_folder_is_reported_and_what_it_points_to_not_read(tmp_path: Path) -> None:
    root = checkpoints(tmp_path / "checkpoints", "0")
    elsewhere = tmp_path / "elsewhere"
    write_chunk_file(elsewhere, 0, ["not-ours"], rank=7)
    (root / "00007").symlink_to(elsewhere / "00007")
    (root / "owners").symlink_to("/etc")
    before = dir_snapshot(root)
    report = inspect_dir(str(root))
    assert dir_snapshot(root) == before
    assert [rank.rank for rank in report.ranks] == [0, 7]  # none named after what /etc holds
    seven = report.ranks[1]
    assert (seven.chunks, seven.resume) == ([], None)
    assert seven.problems == [
        f"a restarted proxy refuses this rank: {root / '00007'} is a symbolic link, not a folder: inferproxy opens "
        f"nothing in a checkpoints dir through a link or of another kind (it could be made to read, cut or "
        f"overwrite another file). Remove it, or put the folder itself there, then retry"
    ]
    assert (
        f"a restarted proxy refuses every rank: {root / 'owners'} is a symbolic link, not a folder"
        in (report.problems[0])
    )
    assert report.ranks[0].resume is None


def test_a_last_chunk_file_over_a_few_kib_is_a_corrupt_one_read_no_further(tmp_path: Path) -> None:
    root = checkpoints(tmp_path / "checkpoints", "1" * 5000, {0: ["a"]})
    (rank,) = inspect_dir(str(root)).ranks
    assert rank.last_chunk_index == -1
    (problem,) = rank.problems
    assert "is empty or unreadable ('<unreadable: more than 4096 bytes>')" in problem


def test_an_owner_lock_not_written_by_inferproxy_keeps_the_json_types_and_prints_no_escape(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = checkpoints(tmp_path / "checkpoints")
    lock = root / "owners" / "00003.lock"
    lock.parent.mkdir()
    lock.write_bytes(b"\x1b[2J\x1b]0;pwned\x07 not json")
    (root / "owners" / "00004.lock").write_text('{"host": "\\u001b[31mred\\r\\nfake line", "pid": "12", "port": 80}')
    assert main(["inspect", str(root), "--json"]) == 0
    three, four = orjson.loads(capsys.readouterr().out)["ranks"]
    assert three["owner"] == {"held": False, "host": None, "pid": None, "port": None, "since": None}
    assert three["problems"] == [f"{lock} names no pid (a process id): it holds '\\x1b[2J\\x1b]0;pwned\\x07 not json'"]
    assert four["owner"] == {
        "held": False,
        "host": "\\x1b[31mred\\r\\nfake line",
        "pid": None,
        "port": 80,
        "since": None,
    }
    assert main(["inspect", str(root)]) == 0
    table = capsys.readouterr().out
    assert "\x1b" not in table
    assert "\r" not in table
    assert "free (pid ? on \\x1b[31mred\\r\\nfake line, port 80 is gone)" in table


def test_chunks_recorded_as_published_but_missing_from_the_output_are_a_problem_with_output(tmp_path: Path) -> None:
    root = checkpoints(tmp_path / "checkpoints", "3", {4: ["a"]})
    output = tmp_path / "output"
    output.mkdir()
    for chunk_index in (0, 2):  # 1 and 3 were lost after publication (a pruned or recreated bucket)
        (output / f"00000_chunk_{chunk_index}.jsonl").write_text("{}\n")
    (rank,) = inspect_dir(str(root), output=str(output)).ranks
    (problem,) = rank.problems
    assert "chunks [1, 3] are recorded as published (last_chunk 3)" in problem
    assert "409 output_lost_error" in problem
    assert "0 is written into" in problem
    (unchecked,) = inspect_dir(str(root)).ranks  # without --output the output is not looked at
    assert unchecked.problems == []


def test_a_rank_a_restart_refuses_for_chunks_missing_from_the_output_has_no_resume(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Its resume was predicted beside the problem line saying a restarted proxy refuses the rank: /resume
    # answers it 409 output_lost_error, nothing to predict.
    root = checkpoints(tmp_path / "checkpoints", "0", {1: ["a"]})
    output = tmp_path / "output"
    output.mkdir()
    assert main(["inspect", str(root), "--json", "--output", str(output)]) == 0
    (rank,) = orjson.loads(capsys.readouterr().out)["ranks"]
    assert "a restarted proxy refuses the rank (409 output_lost_error)" in rank["problems"][0]
    assert rank["resume"] is None
    assert main(["inspect", str(root), "--output", str(output)]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("0 "))
    assert row.endswith("?")
