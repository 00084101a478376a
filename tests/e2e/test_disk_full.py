"""A real full disk (a small tmpfs): 507, nothing of the request written, the proxy keeps serving,
and writes succeed again once space is freed; a batch pauses meanwhile, saying so once, and carries on.
Needs root to mount, as CI and developers run here."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.service.batches import engine as engine_module
from app.service.settings import Settings
from app.store.batches import BatchDir
from tests import faults
from tests.servers import fake_upstream, proxy_client
from tests.service.test_batches import CHAT, chat_line, final, put_file, read_file, until

pytestmark = pytest.mark.e2e


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    with faults.small_disk(tmp_path / "disk") as disk:
        yield disk


@pytest.fixture
def batch_disk(tmp_path: Path) -> Iterator[Path]:
    """A disk for a batch that fills it up: room enough once the filler goes for what the batch still
    writes (the answers' cache's WAL grows by megabytes before a checkpoint), so that it does not fill
    again (1 MiB did, at times, and the batch paused again for good)."""
    with faults.small_disk(tmp_path / "disk", size="32m") as disk:
        yield disk


async def test_a_full_disk_gives_507_keeps_the_checkpoint_intact_and_recovers(tmp_path: Path, small_disk: Path) -> None:
    settings = Settings(
        upstream=["http://127.0.0.1:9"],
        checkpoints_dir=small_disk / "ckpt",
        output=str(tmp_path / "out"),
        records_per_chunk=100_000,
    )
    chunk_file = small_disk / "ckpt" / "00000" / "chunk_00000.jsonl"
    async with proxy_client(settings) as client:

        async def post(ids: list[str]) -> int:
            body = [{"id": i, "text": "x" * 2000} for i in ids]
            answer = await client.post("/documents", json=body, headers={"X-Chunk-Index": "0"})
            return answer.status_code

        assert await post(["first"]) == 200
        filler = faults.fill_disk(small_disk, leave=40_000)

        acknowledged = ["first"]
        status, batch = 200, 0
        while status == 200:
            ids = [f"b{batch}-{i}" for i in range(5)]
            status = await post(ids)
            if status == 200:
                acknowledged += ids
            batch += 1
            assert batch < 100, "the disk never filled up"
        assert status == 507
        lines = chunk_file.read_text().splitlines()
        assert [json.loads(line)["id"] for line in lines] == acknowledged  # whole lines, nothing of the failed batch
        assert (await client.get("/healthz")).status_code == 200

        filler.unlink()
        assert await post(ids) == 200
        resume = (await client.get("/resume")).json()
        assert set(resume["processed_ids"]) == {*acknowledged, *ids}


async def test_ranks_opened_on_a_full_disk_get_507_naming_the_checkpoints_dir_and_open_once_space_is_freed(
    tmp_path: Path, small_disk: Path
) -> None:
    settings = Settings(
        upstream=["http://127.0.0.1:9"],
        checkpoints_dir=small_disk / "ckpt",
        output=str(tmp_path / "out"),
        records_per_chunk=100,
    )
    async with proxy_client(settings) as client:
        first = await client.post("/documents", json={"id": "a", "text": "x"}, headers={"X-Chunk-Index": "0"})
        assert first.status_code == 200  # owners/ and checkpoint_meta.json exist, as under a job that fills the disk
        filler = faults.fill_disk(small_disk)

        # A new rank's first request claims it: the owner lock's write is refused, before anything else.
        refusals = [
            await client.get("/resume", headers={"X-Rank": "1"}),
            await client.post(
                "/documents", json={"id": "b", "text": "x"}, headers={"X-Rank": "2", "X-Chunk-Index": "0"}
            ),
            await client.post("/v1/completions", json={"prompt": "p"}, headers={"X-Rank": "3", "X-Doc-Id": "c"}),
        ]
        for answer in refusals:
            assert answer.status_code == 507, answer.text
            message = answer.json()["error"]["message"]
            assert "the checkpoints disk is full (No space left on device)" in message
            assert f"free space under {settings.checkpoints_dir}, then send it again" in message
        assert (await client.get("/stats")).json()["owned_ranks"] == [0]

        filler.unlink()
        assert (await client.get("/resume", headers={"X-Rank": "1"})).status_code == 200
        again = await client.post(
            "/documents", json={"id": "b", "text": "x"}, headers={"X-Rank": "2", "X-Chunk-Index": "0"}
        )
        assert again.status_code == 200


async def test_a_released_rank_reopened_on_a_full_disk_gets_507_when_sqlite_cannot_grow_its_wal_index(
    tmp_path: Path, small_disk: Path
) -> None:
    # Its owner lock, emptied on release, takes the last free page again; SQLite then fails to create the
    # cache's `-shm` with SQLITE_IOERR_SHMSIZE, "disk I/O error": it was a 500.
    settings = Settings(
        upstream=["http://127.0.0.1:9"],
        checkpoints_dir=small_disk / "ckpt",
        output=str(tmp_path / "out"),
        records_per_chunk=100,
        rank_idle_s=0.1,
    )
    async with proxy_client(settings) as client:
        assert (
            await client.post("/documents", json={"id": "a", "text": "x"}, headers={"X-Chunk-Index": "0"})
        ).status_code == 200
        for _ in range(200):  # released once idle
            if not (await client.get("/stats")).json()["owned_ranks"]:
                break
            await asyncio.sleep(0.05)
        filler = faults.fill_disk(small_disk, leave=8192)
        answer = await client.get("/resume")
        assert answer.status_code == 507, answer.text
        assert answer.json()["error"]["message"] == (
            f"rank 0 cannot be opened: the checkpoints disk is full (disk I/O error), and nothing of this request "
            f"was written; free space under {settings.checkpoints_dir}, then send it again"
        )
        filler.unlink()
        assert (await client.get("/resume")).json()["processed_ids"] == ["a"]


async def until_paused(client: httpx.AsyncClient, batch_id: str) -> dict[str, Any]:
    """The batch's view in /stats once it says the batch is paused."""
    deadline = time.monotonic() + 60
    while True:
        running = [b for b in (await client.get("/stats")).json()["batches"] if b["id"] == batch_id]
        if running and running[0]["paused"]:
            return running[0]
        assert time.monotonic() < deadline, "/stats never said the batch was paused"
        await asyncio.sleep(0.01)


async def test_a_batch_on_a_full_disk_pauses_says_so_once_and_finishes_every_line_once_when_space_is_freed(
    tmp_path: Path, batch_disk: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Tried again often, so that many retries pass while the disk is full (each would have logged a traceback)
    monkeypatch.setattr(engine_module, "DISK_RETRY_S", 0.05)
    monkeypatch.setattr(engine_module, "SAVE_EVERY_S", 0.05)
    refused = 0  # the batch's writes the disk refused
    for name in ("append", "save"):
        real = getattr(BatchDir, name)

        def spied(self: BatchDir, *args: Any, real: Any = real, **kwargs: Any) -> None:
            nonlocal refused
            try:
                real(self, *args, **kwargs)
            except OSError as exc:
                refused += exc.errno == errno.ENOSPC
                raise

        monkeypatch.setattr(BatchDir, name, spied)
    caplog.set_level(logging.INFO)
    checkpoints = batch_disk / "ckpt"
    lines = 300
    file_id = put_file(checkpoints, [chat_line(f"req-{i}", f"question {i}") for i in range(lines)])
    slots = 4
    async with fake_upstream(latency_ms=5) as (url, upstream):
        settings = Settings(
            upstream=[url], checkpoints_dir=checkpoints, output=str(tmp_path / "out"), max_inflight_per_upstream=slots
        )
        async with proxy_client(settings) as client:
            created = await client.post(
                "/v1/batches", json={"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"}
            )
            batch_id = created.json()["id"]
            await until(client, batch_id, lambda batch: batch["request_counts"]["completed"] >= 20)
            filler = faults.fill_disk(batch_disk)
            view = await until_paused(client, batch_id)
            deadline = time.monotonic() + 60
            assert (
                view["paused"]
                == f"the checkpoints disk is full (No space left on device): free space under {checkpoints}"
            )
            sent = upstream.requests
            assert sent < lines, "the batch ended before the disk filled up"
            seen = refused
            while refused < seen + 20:  # many tries of its writes, every one refused
                assert time.monotonic() < deadline, f"the batch tried its writes {refused - seen} times only"
                await asyncio.sleep(0.01)
            assert upstream.requests <= sent + slots, "lines were sent while their answers could not be kept"
            assert (await client.get("/healthz")).status_code == 200

            filler.unlink()
            batch = await until(client, batch_id, final)
    assert batch["status"] == "completed", batch
    assert batch["request_counts"] == {"total": lines, "completed": lines, "failed": 0}
    output = [line["custom_id"] for line in read_file(checkpoints, batch["output_file_id"])]
    assert sorted(output) == sorted(f"req-{i}" for i in range(lines))  # each line exactly once
    assert upstream.requests == lines  # none sent twice
    assert "Traceback" not in caplog.text
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    batch_warnings = [w for w in warnings if w.startswith(f"batch {batch_id}")]
    assert len(batch_warnings) == 1, warnings
    assert "the checkpoints disk is full (No space left on device)" in batch_warnings[0]
    assert f"free space under {checkpoints}" in batch_warnings[0]
    assert len(warnings) <= 2, warnings  # and at most one of the answers' cache, whose commits failed too
    assert f"batch {batch_id}: its writes go through again; carrying on" in caplog.messages


async def test_a_proxy_stopped_while_a_batch_waits_for_disk_stops_without_a_traceback_and_the_next_finishes_it(
    tmp_path: Path, batch_disk: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The shutdown of a proxy whose disk is full: the answers' cache cannot keep its last answers, which is
    one WARNING line (they are generated again if asked again), not "failed to shut down cleanly"."""
    monkeypatch.setattr(engine_module, "DISK_RETRY_S", 0.05)
    caplog.set_level(logging.INFO)
    checkpoints = batch_disk / "ckpt"
    lines, slots = 200, 4
    file_id = put_file(checkpoints, [chat_line(f"req-{i}", f"question {i}") for i in range(lines)])
    async with fake_upstream(latency_ms=5) as (url, upstream):
        settings = Settings(
            upstream=[url], checkpoints_dir=checkpoints, output=str(tmp_path / "out"), max_inflight_per_upstream=slots
        )
        async with proxy_client(settings) as client:
            created = await client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": CHAT})
            batch_id = created.json()["id"]
            await until(client, batch_id, lambda batch: batch["request_counts"]["completed"] >= 20)
            filler = faults.fill_disk(batch_disk)
            await until_paused(client, batch_id)
        assert "Traceback" not in caplog.text
        assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
        filler.unlink()
        async with proxy_client(settings) as client:
            batch = await until(client, batch_id, final)
    assert batch["request_counts"] == {"total": lines, "completed": lines, "failed": 0}
    output = [line["custom_id"] for line in read_file(checkpoints, batch["output_file_id"])]
    assert sorted(output) == sorted(f"req-{i}" for i in range(lines))  # each line exactly once
    assert upstream.requests <= lines + 2 * slots  # those not on disk at the stop (sent or answered), sent again
