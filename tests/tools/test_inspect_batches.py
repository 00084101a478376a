"""`inferproxy inspect` on the Batch API's folders, built with the store's own writers: what a real proxy
killed mid-batch leaves is tests/e2e/test_inspect.py's; here, what only a damaged or planted dir shows."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import orjson
import pytest

from app.cli import main
from app.store.batches import BatchDir, BatchRecord, Result, new_batch_id
from app.store.files import FileStore, StoredFile
from app.tools.inspect import inspect_dir, render, to_json
from tests.factories import dir_snapshot


def batch(root: Path, *, input_file_id: str = "file-000000000000000000000000", status: str = "in_progress") -> BatchDir:
    """A batch of 3 lines, as a proxy's engine creates one."""
    batch_id = new_batch_id(time.time())
    record = BatchRecord(batch_id, "/v1/chat/completions", input_file_id, "24h", 0, 86400, 7, status=status, total=3)
    folder = BatchDir(root / "batches" / batch_id)
    folder.create(record)
    folder.release()  # as a proxy that stopped left it
    return folder


def result(line: int, ok: bool = True) -> Result:
    return Result(line, ok, (1, 2), orjson.dumps({"custom_id": f"c{line}"}))


def test_a_dir_with_batches_only_is_a_checkpoints_dir_and_misses_no_records_per_chunk(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = FileStore(tmp_path / "files")
    store.open()
    with store.writing("in.jsonl", "batch") as upload:
        upload.write(b"{}\n")
    folder = batch(tmp_path, input_file_id=upload.id)
    folder.append([result(1), result(2, ok=False), result(1)], fsync=False)  # line 1 twice: counted once
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    report = orjson.loads(capsys.readouterr().out)
    assert (report["ranks"], report["problems"]) == ([], [])
    (shown,) = report["batches"]
    assert set(shown) == {
        "id",
        "status",
        "request_counts",
        "results",
        "input_file_id",
        "input_file_exists",
        "output_file_id",
        "error_file_id",
        "owner",
        "problems",
    }
    assert shown["results"] == {"completed": 1, "failed": 1, "bytes": shown["results"]["bytes"], "torn": None}
    assert (shown["input_file_exists"], shown["owner"], shown["problems"]) == (True, {"held": False}, [])
    assert report["files"] == [
        {"id": upload.id, "filename": "in.jsonl", "purpose": "batch", "bytes": 3, "created_at": upload.created_at}
    ]
    assert report["answers"] is None


def test_a_results_line_that_is_no_result_before_the_last_is_one_problem_and_the_file_is_left_alone(
    tmp_path: Path,
) -> None:
    folder = batch(tmp_path)
    folder.append([result(1)], fsync=False)
    with open(folder.root / "results.jsonl", "ab") as f:
        f.write(b'{"line": "two"}\n')
    folder.append([result(3)], fsync=False)
    before = dir_snapshot(tmp_path)
    report = inspect_dir(str(tmp_path))
    assert dir_snapshot(tmp_path) == before
    (shown,) = to_json(report)["batches"]
    assert shown["results"] is None
    (problem, missing) = shown["problems"]
    assert problem.startswith("results.jsonl cannot be read back, so no proxy can carry the batch on: ")
    assert 'a line is no result (an object with an integer "line" and a boolean "ok"): {"line":"two"}' in problem
    assert missing.startswith("it is in_progress but its input file file-000000000000000000000000 is missing")
    assert render(report).count("\nproblem: ") == 2


def test_a_batch_record_with_a_field_of_another_type_is_a_problem_and_shown_unknown(tmp_path: Path) -> None:
    folder = batch(tmp_path)
    record = orjson.loads((folder.root / "batch.json").read_bytes())
    (folder.root / "batch.json").write_bytes(orjson.dumps({**record, "status": ["\x1b[2J"]}))
    report = inspect_dir(str(tmp_path))
    (shown,) = to_json(report)["batches"]
    assert (shown["status"], shown["request_counts"], shown["input_file_exists"]) == (None, None, None)
    assert shown["problems"] == [
        "batch.json holds ['\\x1b[2J'] for status: not as inferproxy writes it, so the batch is shown as unknown; "
        "repair it or remove the batch's folder"
    ]
    assert "\x1b" not in render(report)


def test_a_linked_batch_folder_or_results_file_is_a_problem_and_never_followed(tmp_path: Path) -> None:
    elsewhere = batch(tmp_path / "elsewhere")
    elsewhere.append([result(1)], fsync=False)
    linked = tmp_path / "batches" / new_batch_id(1.5)
    linked.parent.mkdir(parents=True)
    linked.symlink_to(elsewhere.root)
    folder = batch(tmp_path)
    os.symlink(elsewhere.root / "results.jsonl", folder.root / "results.jsonl")
    shown = {item["id"]: item for item in to_json(inspect_dir(str(tmp_path)))["batches"]}
    assert shown[linked.name]["status"] is None
    assert shown[linked.name]["problems"] == [
        f"not read: {linked} is a symbolic link, not a folder: inferproxy opens nothing in a checkpoints "
        f"dir through a link or of another kind (it could be made to read, cut or overwrite another file). "
        f"Remove it, or put the folder itself there, then retry"
    ]
    assert shown[folder.id]["results"] is None
    assert shown[folder.id]["problems"][0].startswith(
        f"results.jsonl cannot be read back, so no proxy can carry the batch on: {folder.root / 'results.jsonl'} "
        f"is a symbolic link"
    )


def test_a_files_metadata_that_does_not_parse_or_has_lost_its_bytes_is_one_problem_line_each(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "files")
    store.open()
    kept = []
    for name in ("a.jsonl", "b.jsonl", "c.jsonl"):
        with store.writing(name, "batch") as upload:
            upload.write(b"{}\n")
        kept.append(upload.id)
    with store.writing("d.jsonl", "batch") as upload:
        upload.write(b"{}\n")
    kept.append(upload.id)
    with store.writing("e.jsonl", "batch") as upload:  # expired: no problem, a file a sweep removes
        upload.write(b"{}\n")
        upload.expires_after = 3600
    kept.append(upload.id)
    (store.root / (kept[0] + ".json")).write_bytes(b'{"id": ')
    store.path(kept[1]).unlink()
    store.path(kept[3]).unlink()
    store.path(kept[3]).symlink_to(store.path(kept[2]))  # its bytes a link: never served
    expired = StoredFile(**{**orjson.loads((store.root / (kept[4] + ".json")).read_bytes()), "expires_at": 1})
    (store.root / (kept[4] + ".json")).write_bytes(orjson.dumps(dataclasses.asdict(expired)))
    report = inspect_dir(str(tmp_path))
    assert [item["id"] for item in to_json(report)["files"]] == [kept[1], kept[2], kept[4]]
    assert [line[: line.index(" (") if " (" in line else None] for line in report.problems] == [
        f"file {kept[0]} is damaged",
        f"file {kept[1]}: its bytes are missing: its content cannot be downloaded",
        f"file {kept[3]} is damaged",
    ]
    assert "unexpected end of data" in report.problems[0]
    assert "is a symbolic link" in report.problems[2]


@pytest.mark.parametrize(
    "content", [b"[1]", b"{}", b'{"id": 7, "status": "in_progress"}'], ids=["list", "empty", "fields"]
)
def test_a_batch_json_that_is_no_batch_is_one_problem_line_and_the_rest_still_reported(
    tmp_path: Path, content: bytes
) -> None:
    bad, good = batch(tmp_path), batch(tmp_path)
    (bad.root / "batch.json").write_bytes(content)
    report = inspect_dir(str(tmp_path))
    shown = {item["id"]: item for item in to_json(report)["batches"]}
    assert shown[bad.id]["status"] is None
    (problem,) = shown[bad.id]["problems"]
    assert problem.startswith("batch.json does not parse (")
    assert problem.endswith("): no proxy lists or runs this batch until it is repaired or its folder removed")
    assert shown[good.id]["status"] == "in_progress"
    assert f"\nproblem: {bad.id}: batch.json does not parse (" in render(report)


def test_a_run_batch_state_folder_names_no_records_per_chunk_nor_a_proxy_as_its_batchs_owner(tmp_path: Path) -> None:
    # `inspect OUT.inferproxy` printed "records_per_chunk not recorded" and "held by a live proxy" of a
    # run-batch process's folder: it has no rank, and owner.lock names no one.
    state = tmp_path / "out.jsonl.inferproxy"
    folder = batch(state)
    assert folder.claim()  # as the run-batch process holds it
    try:
        text = render(inspect_dir(str(state)))
    finally:
        folder.release()
    assert text.splitlines()[0] == f"checkpoints dir {state}: 0 ranks, 1 batch, 0 files"
    assert "records_per_chunk" not in text
    assert "live proxy" not in text
    (row,) = [line for line in text.splitlines() if line.startswith(folder.id) and "in_progress" in line]
    assert row.endswith("held by a live process")
    assert f"{folder.id} is run by a live process: its files move while they are read" in text
