"""`inferproxy inspect` on the checkpoints dir of a real `inferproxy serve`, killed with SIGKILL, then restarted:
it writes nothing, and the restarted proxy's `GET /resume` answers what it said it would, and carries a batch
on from the lines inspect counted."""

from __future__ import annotations

import json
import os
import shutil
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import Upstream, running_upstream, start_proxy
from tests.factories import chat_request, dir_snapshot
from tests.servers import process, wait_for_http
from tests.service.test_batches import CHAT, chat_line, put_file, read_file

pytestmark = pytest.mark.e2e

RECORDS_PER_CHUNK = 4


def inspect(checkpoints: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "app.cli", "inspect", str(checkpoints), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def inspect_json(checkpoints: Path, *args: str) -> dict[str, Any]:
    done = inspect(checkpoints, "--json", *args)
    assert done.returncode == 0, done.stderr
    report: dict[str, Any] = json.loads(done.stdout)
    return report


def by_rank(report: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {rank["rank"]: rank for rank in report["ranks"]}


def generate(client: httpx.Client, rank: int, doc_id: str, chunk_index: int) -> None:
    headers = {"X-Rank": str(rank), "X-Doc-Id": doc_id, "X-Chunk-Index": str(chunk_index)}
    answer = client.post("/v1/chat/completions", json=chat_request(), headers=headers)
    assert answer.status_code == 200, answer.text


def write(client: httpx.Client, rank: int, chunk_index: int, ids: list[str]) -> None:
    documents = [{"id": doc_id, "text": f"text of {doc_id}"} for doc_id in ids]
    answer = client.post("/documents", json=documents, headers={"X-Rank": str(rank), "X-Chunk-Index": str(chunk_index)})
    assert answer.status_code == 200, answer.text


def entries_of_a_copy(rank_dir: Path, into: Path) -> int:
    """The cache's entries as SQLite reads them from a copy of its files (read-write there: WAL replayed)."""
    into.mkdir()
    for name in ("replay.sqlite3", "replay.sqlite3-wal", "replay.sqlite3-shm"):
        if (rank_dir / name).exists():
            shutil.copyfile(rank_dir / name, into / name)
    conn = sqlite3.connect(into / "replay.sqlite3")
    try:
        return int(conn.execute("SELECT COUNT(*) FROM request_cache").fetchone()[0])
    finally:
        conn.close()


def entries_of_the_main_file(rank_dir: Path) -> int:
    """The entries the cache's main file holds alone, its WAL ignored."""
    conn = sqlite3.connect(f"{(rank_dir / 'replay.sqlite3').as_uri()}?immutable=1", uri=True)
    try:
        tables = conn.execute("SELECT COUNT(*) FROM sqlite_master WHERE name = 'request_cache'").fetchone()[0]
        return int(conn.execute("SELECT COUNT(*) FROM request_cache").fetchone()[0]) if tables else 0
    finally:
        conn.close()


def peak_rss_of_inspect(checkpoints: Path) -> int:
    """The peak resident memory of `inferproxy inspect CHECKPOINTS`, run to its end, in bytes."""
    with subprocess.Popen(
        [sys.executable, "-m", "app.cli", "inspect", str(checkpoints), "--json"], stdout=subprocess.DEVNULL
    ) as done:
        _, status, usage = os.wait4(done.pid, 0)
        done.returncode = os.waitstatus_to_exitcode(status)
    assert done.returncode == 0
    return usage.ru_maxrss * 1024  # KiB on Linux


def test_a_huge_torn_last_line_is_reported_without_holding_it(tmp_path: Path) -> None:
    # A crash mid-append of a huge document (or a disk's garbage without a newline): its tail was read whole
    # as one line, twice over (about 2 x 256 MiB at the peak here), to find it torn.
    checkpoints = tmp_path / "checkpoints"
    rank_dir = checkpoints / "00000"
    rank_dir.mkdir(parents=True)
    (checkpoints / "checkpoint_meta.json").write_text('{"records_per_chunk": 4}')
    chunk = rank_dir / "chunk_00000.jsonl"
    chunk.write_bytes(b'{"id": "a", "text": "text of a"}\n')
    whole = chunk.stat().st_size
    before = peak_rss_of_inspect(checkpoints)
    with open(chunk, "ab") as f:
        f.write(b'{"id": "b", "text": "')
        for _ in range(256):
            f.write(b"x" * (1 << 20))
    grown = peak_rss_of_inspect(checkpoints) - before
    (rank,) = inspect_json(checkpoints)["ranks"]
    assert rank["chunks"][0]["torn"] == {"offset": whole, "bytes": chunk.stat().st_size - whole}
    assert grown < 32 << 20, f"inspect's peak memory grew by {grown >> 20} MiB for a 256 MiB torn line"


def test_inspect_of_a_killed_proxys_dir_writes_nothing_and_predicts_resume_after_a_restart(
    upstream: Upstream, tmp_path: Path
) -> None:
    args, port = start_proxy(upstream.url, tmp_path, f"--records-per-chunk={RECORDS_PER_CHUNK}")
    url = f"http://127.0.0.1:{port}"
    checkpoints, output = tmp_path / "checkpoints", tmp_path / "output"
    with process(*args) as killed, httpx.Client(base_url=url, timeout=30) as client:
        wait_for_http(url + "/healthz")
        for i in range(14):  # rank 0: chunks 0 and 1 complete, 2 and 3 open
            generate(client, 0, f"d{i}", i // RECORDS_PER_CHUNK)
        write(client, 0, 0, ["d0", "d1", "d2", "d3"])
        write(client, 0, 1, ["d4", "d5", "d6", "d7"])
        write(client, 0, 2, ["d8", "d9", "d10"])
        write(client, 0, 3, ["d12", "d13"])
        generate(client, 1, "e0", 0)
        generate(client, 1, "e1", 0)
        write(client, 1, 0, ["e0"])
        generate(client, 2, "f0", 0)  # rank 2: a cache, no checkpoint yet
        # Entries of completed chunks are dropped: d8..d13, e0 and e1, f0. Inspecting the live proxy
        # (read-only too) until its group commits have landed, so that the kill leaves them in the WAL.
        deadline = time.monotonic() + 30
        while [by_rank(inspect_json(checkpoints))[rank]["cache"]["entries"] for rank in (0, 1, 2)] != [6, 2, 1]:
            assert time.monotonic() < deadline, "the proxy's cache commits never showed"
        killed.kill()
        killed.wait(timeout=10)
    chunk_2 = checkpoints / "00000" / "chunk_00002.jsonl"
    whole = chunk_2.stat().st_size
    with open(chunk_2, "ab") as f:
        f.write(b'{"text":"text of d11","id":"d1')  # a crash mid-append
    assert (checkpoints / "00000" / "replay.sqlite3-wal").stat().st_size > 0
    assert entries_of_the_main_file(checkpoints / "00000") < 6  # the rest is only in the WAL

    before = dir_snapshot(checkpoints)
    report = inspect_json(checkpoints)
    with_output = inspect_json(checkpoints, "--output", str(output))
    table = inspect(checkpoints)
    assert dir_snapshot(checkpoints) == before

    assert (table.returncode, table.stderr) == (0, "")
    assert "rank 0: chunk 2 ends in a torn line (30 bytes): a restart cuts the file back to" in table.stdout
    assert (report["records_per_chunk"], report["problems"]) == (RECORDS_PER_CHUNK, [])
    ranks = by_rank(report)
    assert sorted(ranks) == [0, 1, 2]
    zero = ranks[0]
    assert zero["last_chunk_index"] == 1
    assert [(c["chunk_index"], c["documents"], c["state"]) for c in zero["chunks"]] == [(2, 3, "open"), (3, 2, "open")]
    assert zero["chunks"][0]["torn"] == {"offset": whole, "bytes": 30}
    assert zero["torn_lines"] == 1
    assert {key: zero["owner"][key] for key in ("held", "host", "pid", "port")} == {
        "held": False,
        "host": socket.gethostname(),
        "pid": killed.pid,
        "port": port,
    }
    for rank, entries in ((0, 6), (1, 2), (2, 1)):
        rank_dir = checkpoints / f"{rank:05d}"
        assert ranks[rank]["cache"]["entries"] == entries == entries_of_a_copy(rank_dir, tmp_path / f"copy{rank}")
        assert ranks[rank]["cache"]["bytes"] == sum(
            (rank_dir / name).stat().st_size for name in ("replay.sqlite3", "replay.sqlite3-wal")
        )
    assert ranks[2]["resume"]["source"] == "unchecked_output"
    assert by_rank(with_output)[2]["resume"]["source"] == "output"
    assert by_rank(with_output)[0]["resume"] == ranks[0]["resume"]

    with process(*args) as restarted, httpx.Client(base_url=url, timeout=30) as client:
        wait_for_http(url + "/healthz")
        for rank, predicted in ranks.items():
            answer = client.get("/resume", headers={"X-Rank": str(rank)}).json()
            assert predicted["resume"] == {
                "last_chunk_index": answer["last_chunk_index"],
                "docs_to_skip": answer["docs_to_skip"],
                "processed_id_count": len(answer["processed_ids"]),
                "source": predicted["resume"]["source"],
            }, rank
        assert ranks[0]["resume"] == {
            "last_chunk_index": 1,
            "docs_to_skip": 8,
            "processed_id_count": 5,
            "source": "checkpoints",
        }
        assert chunk_2.stat().st_size == whole  # cut back where inspect said
        live = by_rank(inspect_json(checkpoints, "--rank", "0", "--rank", "1"))
        assert sorted(live) == [0, 1]
        for owner in (live[0]["owner"], live[1]["owner"]):
            assert (owner["held"], owner["pid"], owner["port"]) == (True, restarted.pid, port)
        assert "held by pid" in inspect(checkpoints, "--rank", "0").stdout


# ----------------------------------------------------------------------- the Batch API's batches and files

BATCH_LINES = 200
BATCH_INFLIGHT = 4
#: The upstream's time per answer for them: 4 in flight shared by two batches make the one killed mid-way take
#: ~20 s, so that the kill lands mid-batch however long the live `inspect` before it takes on a loaded
#: machine (at 50 ms, one took long enough for the batch to complete first).
BATCH_LATENCY_MS = 200


def until_batch(url: str, batch_id: str, done: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    deadline = time.monotonic() + 60
    while not done(batch := httpx.get(f"{url}/v1/batches/{batch_id}", timeout=10).json()):
        assert time.monotonic() < deadline, batch
        time.sleep(0.05)
    answer: dict[str, Any] = batch
    return answer


def create_batch(url: str, file_id: str) -> str:
    created = httpx.post(f"{url}/v1/batches", json={"input_file_id": file_id, "endpoint": CHAT}, timeout=10)
    assert created.status_code == 200, created.text
    batch_id: str = created.json()["id"]
    return batch_id


def lines_done(results: Path) -> tuple[int, int]:
    """(completed, failed) of results.jsonl's whole lines, each input line's first result, read here apart."""
    first: dict[int, bool] = {}
    for raw in results.read_bytes().splitlines(keepends=True):
        if raw.endswith(b"\n"):
            item = json.loads(raw)
            first.setdefault(item["line"], item["ok"])
    return sum(first.values()), sum(not ok for ok in first.values())


def test_inspect_of_a_proxy_killed_mid_batch_reports_its_batches_files_and_damage_writing_nothing(
    tmp_path: Path,
) -> None:
    checkpoints = tmp_path / "checkpoints"
    lines = [chat_line(f"line-{i}", f"question {i}") for i in range(BATCH_LINES)]
    big, lost = put_file(checkpoints, lines), put_file(checkpoints, lines)
    small, broken_input = put_file(checkpoints, lines[:3]), put_file(checkpoints, lines[3:6])
    with running_upstream(latency_ms=BATCH_LATENCY_MS) as upstream:
        args, port = start_proxy(upstream.url, tmp_path, f"--max-inflight-per-upstream={BATCH_INFLIGHT}")
        url = f"http://127.0.0.1:{port}"
        with process(*args) as killed:
            wait_for_http(url + "/healthz")
            done = until_batch(url, create_batch(url, small), lambda b: b["status"] == "completed")
            broken = until_batch(url, create_batch(url, broken_input), lambda b: b["status"] == "completed")["id"]
            running, orphan = create_batch(url, big), create_batch(url, lost)
            until_batch(url, running, lambda b: b["request_counts"]["completed"] >= 12)
            until_batch(url, orphan, lambda b: b["request_counts"]["completed"] >= 4)
            live = {batch["id"]: batch for batch in inspect_json(checkpoints)["batches"]}
            listed = httpx.get(f"{url}/v1/files", params={"order": "asc"}, timeout=10).json()["data"]
            killed.kill()
            killed.wait(timeout=10)
        results = checkpoints / "batches" / running / "results.jsonl"
        whole = results.stat().st_size
        torn = b'{"line":%d,"ok":tr' % BATCH_LINES  # a crash mid-append of the last line's result
        with open(results, "ab") as f:
            f.write(torn)
        (checkpoints / "batches" / broken / "batch.json").write_bytes(b'{"id": "batch_')  # a disk gone bad
        for name in (lost, lost + ".json"):
            (checkpoints / "files" / name).unlink()  # lost with a node's local disk

        before = dir_snapshot(checkpoints)
        report = inspect_json(checkpoints)
        table = inspect(checkpoints)
        assert dir_snapshot(checkpoints) == before

        assert (live[running]["owner"], live[orphan]["owner"]) == ({"held": True}, {"held": True})
        assert live[done["id"]]["owner"] == {"held": False}  # released once it completed
        assert report["problems"] == []
        batches = {batch["id"]: batch for batch in report["batches"]}
        assert sorted(batches) == sorted([done["id"], broken, running, orphan])

        assert {key: batches[done["id"]][key] for key in batches[done["id"]] if key != "results"} == {
            "id": done["id"],
            "status": "completed",
            "request_counts": {"total": 3, "completed": 3, "failed": 0},
            "input_file_id": small,
            "input_file_exists": True,
            "output_file_id": done["output_file_id"],
            "error_file_id": None,
            "owner": {"held": False},
            "problems": [],
        }
        assert batches[done["id"]]["results"]["completed"] == 3

        mid = batches[running]
        assert mid["status"] == "in_progress"
        assert (mid["input_file_id"], mid["input_file_exists"], mid["owner"]) == (big, True, {"held": False})
        on_disk = lines_done(results)
        assert 12 <= on_disk[0] < BATCH_LINES
        assert (mid["results"]["completed"], mid["results"]["failed"]) == on_disk
        assert mid["results"]["torn"] == {"offset": whole, "bytes": len(torn), "line": BATCH_LINES}
        counts = mid["request_counts"]  # saved every 2 s: behind the lines on disk, never ahead
        assert counts["total"] == BATCH_LINES
        assert counts["completed"] <= on_disk[0]
        assert mid["problems"] == []

        assert batches[orphan]["input_file_exists"] is False
        (missing,) = batches[orphan]["problems"]
        assert missing.startswith(f"it is in_progress but its input file {lost} is missing: ")
        assert batches[broken]["status"] is None
        (unparsed,) = batches[broken]["problems"]
        assert unparsed.startswith("batch.json does not parse (")

        stored = [{key: item[key] for key in ("id", "filename", "purpose", "bytes", "created_at")} for item in listed]
        assert report["files"] == [item for item in stored if item["id"] != lost]
        (host,) = (checkpoints / "batches" / "answers").iterdir()  # the proxy's host's
        answers = host / "00000"
        assert report["answers"]["entries"] == entries_of_a_copy(answers, tmp_path / "answers")
        assert report["answers"]["bytes"] == sum(
            (answers / name).stat().st_size for name in ("replay.sqlite3", "replay.sqlite3-wal")
        )

        assert (table.returncode, table.stderr) == (0, "")
        text = table.stdout.splitlines()
        assert text[0] == f"checkpoints dir {checkpoints}: 0 ranks, 4 batches, 5 files"  # no records_per_chunk
        assert (
            f"{running}: results.jsonl ends in a torn line ({len(torn)} bytes): a restart cuts the file back "
            f"to {whole} bytes, dropping it, and runs input line {BATCH_LINES} again"
        ) in text
        assert f"problem: {orphan}: {missing}" in text
        assert f"problem: {broken}: {unparsed}" in text
        assert sum(line.startswith("problem: ") for line in text) == 2

        with process(*args):
            wait_for_http(url + "/healthz")
            resumed = httpx.get(f"{url}/v1/batches/{running}", timeout=10).json()["request_counts"]
            assert resumed["completed"] >= on_disk[0]  # carried on from the lines on disk, not batch.json's
            finished = until_batch(url, running, lambda b: b["status"] == "completed")
        output = read_file(checkpoints, finished["output_file_id"])
        assert sorted(o["custom_id"] for o in output) == sorted(f"line-{i}" for i in range(BATCH_LINES))
