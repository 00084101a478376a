"""The Batch API (`/v1/batches`, contract §7) in-process: a real proxy on a loopback port in front of the
fake upstream, its input files in the proxy's file store as an upload leaves them."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import logging
import shutil
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

import app.service.batches.engine
import app.store.batches
from app.service.asgi import Receive, Scope, Send, send_bytes
from app.service.batches.answers import line_request
from app.service.batches.engine import BatchEngine
from app.service.coalescing import Flights
from app.service.settings import Settings
from app.service.upstream import UpstreamPool
from app.store.batches import BatchDir, BatchRecord
from app.store.cache import count_rows
from app.store.files import FileStore
from app.store.hashing import payload_hash
from app.tools import status
from tests.servers import fake_upstream, serve_in_loop, serve_proxy
from tests.waiting import eventually

CHAT = "/v1/chat/completions"


def chat_line(custom_id: str, text: str, **body: Any) -> dict[str, Any]:
    request = {"model": "fake-model", "messages": [{"role": "user", "content": text}], **body}
    return {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": request}


def put_file(checkpoints: Path, lines: list[Any], *, raw: bytes | None = None) -> str:
    """An input file in the proxy's store, as `POST /v1/files` leaves one."""
    store = FileStore(checkpoints / "files")
    store.open()
    data = raw if raw is not None else b"".join(orjson.dumps(line) + b"\n" for line in lines)
    with store.writing("input.jsonl", "batch") as out:
        out.write(data)
    return out.id


def read_file(checkpoints: Path, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    data = (checkpoints / "files" / file_id).read_bytes()
    return [orjson.loads(line) for line in data.splitlines()]


async def until(client: httpx.AsyncClient, batch_id: str, done: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    deadline = time.monotonic() + 60
    while True:
        batch: dict[str, Any] = (await client.get(f"/v1/batches/{batch_id}")).json()
        if done(batch):
            return batch
        assert time.monotonic() < deadline, batch
        await asyncio.sleep(0.05)


async def create_batch(client: httpx.AsyncClient, file_id: str) -> str:
    """A chat batch of the file, created: its id."""
    created = await client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": CHAT})
    assert created.status_code == 200, created.text
    batch_id: str = created.json()["id"]
    return batch_id


def final(batch: dict[str, Any]) -> bool:
    return batch["status"] in ("completed", "failed", "expired", "cancelled")


def batch_settings(tmp_path: Path, **overrides: Any) -> Settings:
    """Settings for batches under `tmp_path`, retrying quickly."""
    defaults: dict[str, Any] = {"retry_backoff_s": 0.01, "upstream_retries": 0, "batch_retries": 2}
    return Settings(
        checkpoints_dir=tmp_path / "checkpoints", output=str(tmp_path / "output"), **{**defaults, **overrides}
    )


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return batch_settings(tmp_path)


@pytest.fixture
async def upstream() -> AsyncIterator[tuple[str, Any]]:
    async with fake_upstream() as started:
        yield started


async def proxy(settings: Settings, *upstream_urls: str) -> AsyncIterator[httpx.AsyncClient]:
    async with (
        serve_proxy(settings.model_copy(update={"upstream": list(upstream_urls)})) as url,
        httpx.AsyncClient(base_url=url, timeout=30) as client,
    ):
        yield client


async def test_a_batch_answers_every_line_once_in_openais_format(settings: Settings, upstream: Any) -> None:
    url, fake = upstream
    lines = [chat_line(f"req-{i}", f"question {i}") for i in range(50)]
    lines.append(chat_line("too-long", "x", fake_upstream={"status": 400}))
    file_id = put_file(settings.checkpoints_dir, lines)
    async for client in proxy(settings, url):
        created = await client.post(
            "/v1/batches",
            json={"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h", "metadata": {"k": "v"}},
        )
        assert created.status_code == 200, created.text
        assert created.json()["status"] in ("validating", "in_progress")
        batch = await until(client, created.json()["id"], final)
        assert batch["status"] == "completed", batch
        assert batch["request_counts"] == {"total": 51, "completed": 50, "failed": 1}
        assert batch["metadata"] == {"k": "v"}
        for stamp in ("created_at", "in_progress_at", "finalizing_at", "completed_at", "expires_at"):
            assert isinstance(batch[stamp], int), stamp
        assert batch["usage"]["total_tokens"] > 0
        output = read_file(settings.checkpoints_dir, batch["output_file_id"])
        errors = read_file(settings.checkpoints_dir, batch["error_file_id"])
        assert sorted(o["custom_id"] for o in output) == sorted(f"req-{i}" for i in range(50))
        for line in output:
            assert line["id"].startswith("batch_req_")
            assert line["error"] is None
            assert line["response"]["status_code"] == 200
            assert line["response"]["body"]["object"] == "chat.completion"
        assert [e["custom_id"] for e in errors] == ["too-long"]
        assert errors[0]["response"]["status_code"] == 400
        assert fake.generations == 50
        listed = (await client.get("/v1/batches")).json()
        assert [b["id"] for b in listed["data"]] == [batch["id"]]


async def test_a_resubmitted_file_is_answered_from_the_first_batch_and_pays_nothing(
    settings: Settings, upstream: Any
) -> None:
    url, fake = upstream
    file_id = put_file(settings.checkpoints_dir, [chat_line(f"r{i}", f"q{i}") for i in range(20)])
    async for client in proxy(settings, url):
        first = await until(client, await create_batch(client, file_id), final)
        second = await until(client, await create_batch(client, file_id), final)
        assert fake.generations == 20
        assert second["request_counts"]["completed"] == 20
        # in the totals a person watching reads (hit ratio, generations and tokens saved), as a job's hits are
        totals = (await client.get("/stats")).json()["totals"]
        assert (totals["hits"], totals["misses"], totals["hit_ratio"]) == (20, 20, 0.5)
        assert totals["tokens_saved"] == first["usage"]["total_tokens"]

        def answers(batch: dict[str, Any]) -> dict[str, Any]:
            output = read_file(settings.checkpoints_dir, batch["output_file_id"])
            return {o["custom_id"]: o["response"]["body"] for o in output}

        assert answers(second) == answers(first)


class Hung:
    """An upstream whose probe answers and whose generations never do: a vLLM whose engine is stuck."""

    def __init__(self) -> None:
        self.requests = 0
        self.arrived = asyncio.Event()  # set at each request

    async def until(self, requests: int) -> None:
        while self.requests < requests:
            await self.arrived.wait()
            self.arrived.clear()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/v1/models":
            await send_bytes(send, 200, [(b"content-type", b"application/json")], b'{"data": []}')
            return
        self.requests += 1
        self.arrived.set()
        while (await receive())["type"] != "http.disconnect":  # no answer, until the proxy gives up on it
            pass


async def test_a_line_that_timed_out_on_a_hung_replica_is_retried_on_another(settings: Settings, upstream: Any) -> None:
    # Keyed by its custom_id, every retry of a line went back to the replica its key ranks first: one that
    # hangs (its probe still answering, so never taken out) failed every line keyed to it.
    url, fake = upstream
    hung = Hung()
    file_id = put_file(settings.checkpoints_dir, [chat_line(f"r{i}", f"q{i}") for i in range(40)])
    two = settings.model_copy(update={"read_timeout_s": 0.5, "max_inflight_per_upstream": 4})
    async with serve_in_loop(hung) as hung_url:
        async for client in proxy(two, url, hung_url):
            batch = await until(client, await create_batch(client, file_id), final)
    assert batch["status"] == "completed"
    assert batch["request_counts"] == {"total": 40, "completed": 40, "failed": 0}
    assert hung.requests > 0  # the lines keyed to it went there first
    assert fake.generations == 40


async def test_deleting_a_batchs_output_file_forgets_its_answers_and_a_resubmission_pays_again(
    settings: Settings, upstream: Any
) -> None:
    url, fake = upstream
    file_id = put_file(settings.checkpoints_dir, [chat_line(f"r{i}", f"q{i}") for i in range(10)])
    async for client in proxy(settings, url):
        first = await until(client, await create_batch(client, file_id), final)
        assert (first["status"], fake.generations) == ("completed", 10)
        deleted = await client.delete(f"/v1/files/{first['output_file_id']}")
        assert deleted.status_code == 200, deleted.text
        assert deleted.json()["deleted"] is True
        second = await until(client, await create_batch(client, file_id), final)
        assert (second["status"], fake.generations) == ("completed", 20)  # each line generated again
        third = await until(client, await create_batch(client, file_id), final)
        assert (third["status"], fake.generations) == ("completed", 20)  # from the second's, kept
        assert third["request_counts"] == {"total": 10, "completed": 10, "failed": 0}


@pytest.mark.parametrize(
    ("line", "code"),
    [
        (b"not json", "invalid_json_line"),
        (orjson.dumps({"method": "POST", "url": CHAT, "body": {}}), "missing_custom_id"),
        (orjson.dumps({"custom_id": "a", "method": "GET", "url": CHAT, "body": {}}), "invalid_method"),
        (orjson.dumps({"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {}}), "mismatched_url"),
        (orjson.dumps({"custom_id": "a", "method": "POST", "url": CHAT, "body": []}), "invalid_body"),
        (orjson.dumps(chat_line("a", "x", stream=True)), "stream_not_supported"),
        (orjson.dumps(chat_line("a", "x", stream=0)), "stream_not_supported"),
        (orjson.dumps(chat_line("ok-0", "again")), "duplicate_custom_id"),
        (orjson.dumps(chat_line("x" * 1025, "long id")), "invalid_custom_id"),
        (
            b'{"custom_id": "deep", "method": "POST", "url": "/v1/chat/completions", "body": {"a": '
            + b"[" * 300
            + b"]" * 300
            + b"}}",
            "invalid_body",
        ),
    ],
)
async def test_a_bad_line_fails_the_batch_naming_it_and_sends_nothing(
    settings: Settings, upstream: Any, line: bytes, code: str
) -> None:
    url, fake = upstream
    good = b"".join(orjson.dumps(chat_line(f"ok-{i}", f"q{i}")) + b"\n" for i in range(3))
    file_id = put_file(settings.checkpoints_dir, [], raw=good + line + b"\n")
    async for client in proxy(settings, url):
        created = await client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": CHAT})
        batch = await until(client, created.json()["id"], final)
        assert batch["status"] == "failed"
        assert isinstance(batch["failed_at"], int)
        [error] = batch["errors"]["data"]
        assert error["line"] == 4
        assert error["code"] == code
        assert error["message"]
        assert fake.by_path[f"POST {CHAT}"] == 0


async def test_a_file_with_many_bad_lines_names_the_first_100_in_order_and_sends_nothing(
    settings: Settings, upstream: Any
) -> None:
    url, fake = upstream
    rows = [b"not json" if i % 2 else orjson.dumps(chat_line(f"ok-{i}", f"q{i}")) for i in range(1, 301)]
    file_id = put_file(settings.checkpoints_dir, [], raw=b"\n".join(rows) + b"\n")
    async for client in proxy(settings, url):
        batch = await until(client, await create_batch(client, file_id), final)
    assert batch["status"] == "failed"
    errors = batch["errors"]["data"]
    assert [e["line"] for e in errors] == list(range(1, 200, 2))  # 150 bad lines: the first 100 of them
    assert {e["code"] for e in errors} == {"invalid_json_line"}
    assert fake.by_path[f"POST {CHAT}"] == 0


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"input_file_id": "file-000000000000000000000000"}, "input_file_id"),
        ({"input_file_id": None}, "input_file_id"),
        ({"endpoint": "/v1/responses"}, "endpoint"),
        ({"completion_window": "1h"}, "completion_window"),
        ({"completion_window": "tomorrow"}, "completion_window"),
        ({"completion_window": "24h\n"}, "completion_window"),
        ({"completion_window": "0024h"}, "completion_window"),
        ({"completion_window": "\u0662\u0664h"}, "completion_window"),
        ({"completion_window": 24}, "completion_window"),  # a number, null, an object: not a 500
        ({"completion_window": None}, "completion_window"),
        ({"completion_window": {}}, "completion_window"),
        ({"endpoint": "/v1/" + "x" * 3000}, "endpoint"),
        ({"metadata": {"k": 1}}, "metadata"),
    ],
)
async def test_a_bad_create_request_is_a_400_naming_the_field_and_creates_nothing(
    settings: Settings, upstream: Any, change: dict[str, Any], param: str
) -> None:
    url, _ = upstream
    file_id = put_file(settings.checkpoints_dir, [chat_line("a", "q")])
    async for client in proxy(settings, url):
        body = {"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h", **change}
        answer = await client.post("/v1/batches", json=body)
        assert answer.status_code == 400
        assert answer.json()["error"]["param"] == param
        assert len(answer.json()["error"]["message"]) < 300  # what was sent is quoted, not echoed whole
        assert (await client.get("/v1/batches")).json()["data"] == []


async def test_a_batch_created_on_a_full_disk_is_a_507_and_leaves_no_folder(
    settings: Settings, upstream: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, _ = upstream
    file_id = put_file(settings.checkpoints_dir, [chat_line("a", "q")])

    def disk_full(*_: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(app.store.batches, "atomic_write_bytes", disk_full)
    async for client in proxy(settings, url):
        answer = await client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": CHAT})
        assert answer.status_code == 507, answer.text
        assert answer.json()["error"]["message"].startswith(
            "the batch cannot be created: the checkpoints disk is full (No space left on device)"
        )
        assert (await client.get("/v1/batches")).json()["data"] == []
    assert [p.name for p in (settings.checkpoints_dir / "batches").iterdir()] == ["answers"]


async def test_unknown_batch_ids_are_404_in_openais_envelope(settings: Settings, upstream: Any) -> None:
    async for client in proxy(settings, upstream[0]):
        for answer in (
            await client.get("/v1/batches/batch_nope"),
            await client.post("/v1/batches/batch_000000000000000000000000/cancel"),
        ):
            assert answer.status_code == 404
            assert "No batch found" in answer.json()["error"]["message"]


async def test_cancel_sends_no_new_line_and_keeps_every_finished_one(settings: Settings, tmp_path: Path) -> None:
    async with fake_upstream(latency_ms=200) as (url, fake):
        file_id = put_file(settings.checkpoints_dir, [chat_line(f"c{i}", f"q{i}") for i in range(400)])
        slow = settings.model_copy(update={"max_inflight_per_upstream": 4})
        async for client in proxy(slow, url):
            created = (await client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": CHAT})).json()
            await until(client, created["id"], lambda b: b["request_counts"]["completed"] >= 8)
            cancelling = (await client.post(f"/v1/batches/{created['id']}/cancel")).json()
            assert cancelling["status"] in ("cancelling", "cancelled")
            sent = fake.requests
            batch = await until(client, created["id"], final)
            assert batch["status"] == "cancelled"
            assert isinstance(batch["cancelled_at"], int)
            assert fake.requests <= sent + 0, "a line was sent after the cancel"
            output = read_file(settings.checkpoints_dir, batch["output_file_id"])
            assert len(output) == batch["request_counts"]["completed"] >= 8
            assert len({o["custom_id"] for o in output}) == len(output)
            await asyncio.sleep(0.5)
            assert fake.requests == sent


async def test_a_restart_carries_on_without_paying_for_the_lines_done(settings: Settings) -> None:
    async with fake_upstream(latency_ms=50) as (url, fake):
        file_id = put_file(settings.checkpoints_dir, [chat_line(f"k{i}", f"q{i}") for i in range(200)])
        slow = settings.model_copy(update={"max_inflight_per_upstream": 8})
        async for client in proxy(slow, url):
            batch_id = await create_batch(client, file_id)
            stopped = await until(client, batch_id, lambda b: b["request_counts"]["completed"] >= 40)
            [running] = (await client.get("/stats")).json()["batches"]
            assert running["id"] == batch_id
            assert running["total"] == 200
            assert 40 <= running["completed"] < 200
            assert running["in_flight"] <= 8
            metrics = (await client.get("/metrics")).text
            assert f'inferproxy_batch_lines{{batch="{batch_id}",state="completed"}}' in metrics
        done_before = stopped["request_counts"]["completed"]
        async for client in proxy(slow, url):
            batch = await until(client, batch_id, final)
        assert batch["status"] == "completed"
        assert batch["request_counts"]["completed"] == 200
        output = read_file(settings.checkpoints_dir, batch["output_file_id"])
        assert sorted(o["custom_id"] for o in output) == sorted(f"k{i}" for i in range(200))
        # only the lines in flight at the stop (at most max_inflight) were generated twice
        assert 200 <= fake.generations <= 200 + 8, (fake.generations, done_before)


async def stats_until(client: httpx.AsyncClient, done: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    deadline = time.monotonic() + 60
    while True:
        stats: dict[str, Any] = (await client.get("/stats")).json()
        if done(stats):
            return stats
        assert time.monotonic() < deadline, stats
        await asyncio.sleep(0.05)


async def test_the_batches_that_ended_are_counted_in_stats_and_status_also_after_a_restart(
    settings: Settings, upstream: Any
) -> None:
    """`inferproxy status` said "no job yet" once a batch ended (/stats' `batches` holds the running ones only)."""
    url, _ = upstream
    good = put_file(settings.checkpoints_dir, [chat_line(f"k{i}", f"q{i}") for i in range(5)])
    bad = put_file(settings.checkpoints_dir, [], raw=b"not json\n")
    counted = {"completed": 1, "failed": 1, "cancelled": 0, "expired": 0}
    async for client in proxy(settings, url):
        assert (await client.get("/stats")).json()["batches_done"] == dict.fromkeys(counted, 0)
        for file_id in (good, bad):
            created = await client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": CHAT})
            await until(client, created.json()["id"], final)
        stats = await stats_until(client, lambda s: not s["batches"] and s["batches_done"] == counted)
        lines = status.render(status.decode(orjson.dumps(stats), "u"), "u")
        assert "batches: 1 completed, 1 failed (GET /v1/batches)" in lines
        assert not any("no job" in line for line in lines)
    async for client in proxy(settings, url):  # found in the dir at the start
        assert (await client.get("/stats")).json()["batches_done"] == counted


async def test_a_batch_never_takes_a_live_clients_place_in_the_queue(settings: Settings) -> None:
    """With every slot held by a batch's lines and the live queue one place long, a live request waits for the
    next slot ahead of the batch's lines and is answered: never a 429 a batch caused."""
    async with fake_upstream(latency_ms=100) as (url, _):
        file_id = put_file(settings.checkpoints_dir, [chat_line(f"b{i}", f"q{i}") for i in range(300)])
        tight = settings.model_copy(update={"max_inflight_per_upstream": 4, "max_queued_requests": 1})
        async for client in proxy(tight, url):
            batch_id = await create_batch(client, file_id)
            await until(client, batch_id, lambda b: b["request_counts"]["completed"] >= 4)
            live = [
                await client.post(
                    "/v1/chat/completions",
                    json={"model": "fake-model", "messages": [{"role": "user", "content": f"live {i}"}]},
                    headers={"X-Doc-Id": f"live-{i}"},
                )
                for i in range(5)
            ]
            assert [answer.status_code for answer in live] == [200] * 5
            [running] = (await client.get("/stats")).json()["batches"]
            assert running["in_flight"] <= 4


async def test_two_batches_share_the_slots_in_turn(settings: Settings) -> None:
    async with fake_upstream(latency_ms=50) as (url, _):
        big = put_file(settings.checkpoints_dir, [chat_line(f"big{i}", f"q{i}") for i in range(400)])
        small = put_file(settings.checkpoints_dir, [chat_line(f"small{i}", f"s{i}") for i in range(40)])
        tight = settings.model_copy(update={"max_inflight_per_upstream": 4})
        async for client in proxy(tight, url):
            first = (await client.post("/v1/batches", json={"input_file_id": big, "endpoint": CHAT})).json()["id"]
            await until(client, first, lambda b: b["request_counts"]["completed"] >= 8)
            second = (await client.post("/v1/batches", json={"input_file_id": small, "endpoint": CHAT})).json()["id"]
            done_small = await until(client, second, final)
            big_then = (await client.get(f"/v1/batches/{first}")).json()["request_counts"]["completed"]
            assert done_small["status"] == "completed"
            # the small batch got about half the slots: it did not wait behind the big one's 400 lines
            assert big_then < 400 - 40, big_then


async def test_a_batch_past_its_window_expires_with_what_finished(settings: Settings, monkeypatch: Any) -> None:
    from app.service.batches import engine

    async with fake_upstream(latency_ms=100) as (url, _):
        file_id = put_file(settings.checkpoints_dir, [chat_line(f"e{i}", f"q{i}") for i in range(200)])
        tight = settings.model_copy(update={"max_inflight_per_upstream": 2})
        monkeypatch.setattr(engine, "window_seconds", lambda window: 2)  # a "24h" window of 2 s
        async for client in proxy(tight, url):
            batch_id = await create_batch(client, file_id)
            batch = await until(client, batch_id, final)
        assert batch["status"] == "expired"
        assert isinstance(batch["expired_at"], int)
        done = batch["request_counts"]["completed"]
        assert 0 < done < 200
        assert batch["request_counts"]["failed"] == 200 - done
        output = read_file(settings.checkpoints_dir, batch["output_file_id"])
        errors = read_file(settings.checkpoints_dir, batch["error_file_id"])
        assert len(output) == done
        assert {e["error"]["code"] for e in errors} == {"batch_expired"}
        assert sorted(o["custom_id"] for o in output + errors) == sorted(f"e{i}" for i in range(200))


def test_the_id_check_finds_every_repeated_id_and_no_other_among_many(tmp_path: Path) -> None:
    from app.service.batches.validation import check_input

    path = tmp_path / "input.jsonl"
    ids = [f"id-{i}" for i in range(50_000)]
    ids += ["id-7", "id-49999", "id-7"]  # lines 50001-50003
    with path.open("wb") as f:
        for custom_id in ids:
            f.write(orjson.dumps(chat_line(custom_id, "q")) + b"\n")
    checked = check_input(path, CHAT)
    assert [(e["line"], e["code"]) for e in checked.errors] == [
        (50001, "duplicate_custom_id"),
        (50002, "duplicate_custom_id"),
        (50003, "duplicate_custom_id"),
    ]
    assert "line 8" in checked.errors[0]["message"]
    assert checked.lines == 50_000


async def test_after_a_kill_the_counts_shown_are_the_durable_ones_from_the_start(settings: Settings) -> None:
    """A kill within `SAVE_EVERY_S` of the last save leaves batch.json's counts behind results.jsonl's: the
    restarted proxy must show the durable ones from its first answer on, never the older ones (seen in the
    chaos suite's batch scenario, seed 20251201: completed 3828, then 1856 just after a restart)."""
    async with fake_upstream(latency_ms=20) as (url, _):
        file_id = put_file(settings.checkpoints_dir, [chat_line(f"k{i}", f"q{i}") for i in range(200)])
        slow = settings.model_copy(update={"max_inflight_per_upstream": 4, "upstream": [url]})
        async for client in proxy(slow, url):
            created = await client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": CHAT})
            batch_id = created.json()["id"]
            await until(client, batch_id, lambda b: b["request_counts"]["completed"] >= 20)
        folder = BatchDir(settings.checkpoints_dir / "batches" / batch_id)
        stale = folder.load()
        durable = len({r.line for r in folder.results()})
        assert 20 <= durable < 200
        stale.completed = stale.failed = 0  # as the last save before the kill left it
        folder.save(stale)
        pool = UpstreamPool([url], max_inflight=4)
        await pool.start()
        files = FileStore(settings.checkpoints_dir / "files")
        files.open()
        engine = BatchEngine(slow, pool, Flights(), files, str(settings.checkpoints_dir / "batches"))
        try:
            await engine.start()
            shown = engine.get(batch_id)
            assert shown.completed >= durable, f"{shown.completed} completed shown after the restart, {durable} durable"
        finally:
            await engine.close()
            await pool.close()


async def test_answers_not_yet_on_disk_are_bounded_and_the_upstream_kept_busy_meanwhile(
    settings: Settings, monkeypatch: Any
) -> None:
    """What a kill loses, and a restart pays for again, is what is not on disk: lines sent, and answers
    waiting for the writer's round, at most twice `max_inflight_per_upstream` (unbounded, the chaos suite's
    batch scenario, seed 20251201, paid 5212 generations for 4950 lines after 6 kills with 16 slots); while
    answers wait for the disk, the next lines go to the upstream (at most `max_inflight_per_upstream` of
    them): a slow fsync does not leave it idle."""
    from app.service.batches import engine as engine_module

    monkeypatch.setattr(engine_module, "RESULTS_ROUND_S", 0.2)  # a slow disk's round
    async with fake_upstream(latency_ms=20) as (url, _):
        file_id = put_file(settings.checkpoints_dir, [chat_line(f"k{i}", f"q{i}") for i in range(200)])
        slow = settings.model_copy(update={"max_inflight_per_upstream": 4, "upstream": [url]})
        pool = UpstreamPool([url], max_inflight=4)
        await pool.start()
        files = FileStore(settings.checkpoints_dir / "files")
        files.open()
        engine = BatchEngine(slow, pool, Flights(), files, str(settings.checkpoints_dir / "batches"))
        try:
            await engine.start()
            record = await engine.create(file_id, CHAT, "24h", None)
            most_held = most_sent = busy_while_waiting = 0
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline and record.id in engine.running:
                waiting, sent = len(engine.running[record.id].pending), pool.replicas[0].in_flight
                most_held, most_sent = max(most_held, waiting + sent), max(most_sent, sent)
                busy_while_waiting += waiting > 0 and sent == 4
                await asyncio.sleep(0.005)
            assert most_held <= 8, f"{most_held} lines sent or waiting for the disk at once"
            assert most_sent <= 4
            assert busy_while_waiting > 0, "the upstream was short of lines while answers waited for the disk"
        finally:
            await engine.close()
            await pool.close()


async def test_a_stop_gives_the_lines_in_flight_only_what_is_left_of_their_grace(settings: Settings) -> None:
    # The lines' 5 s began only once the live requests had had their shutdown_grace_s: a SIGTERM took
    # shutdown_grace_s + 5 s. They count from the stop's beginning now.
    hung = Hung()
    async with serve_in_loop(hung) as url:
        file_id = put_file(settings.checkpoints_dir, [chat_line(f"k{i}", f"q{i}") for i in range(10)])
        pool = UpstreamPool([url], max_inflight=4)
        files = FileStore(settings.checkpoints_dir / "files")
        files.open()
        engine = BatchEngine(settings, pool, Flights(), files, str(settings.checkpoints_dir / "batches"))
        await engine.start()
        try:
            await engine.create(file_id, CHAT, "24h", None)
            await hung.until(4)  # its lines in flight, never answered
            engine.stop_sending()
            engine._stopping_since = time.monotonic() - settings.shutdown_grace_s  # the live requests' grace, spent
            await asyncio.wait_for(engine.close(), 3.0)  # not the lines' 5 s on top
        finally:
            await engine.close()
            await pool.close()


def test_a_lines_body_is_sent_as_written_its_long_integers_exact() -> None:
    # orjson reads an integer past 64 bits as a float: a seed of 30 digits went upstream as 1.2345678901234568e+29
    raw = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"seed": '
    raw += b'123456789012345678901234567890, "n": 1, "messages": [{"role": "user", "content": "caf\xc3\xa9"}]}}\n'
    custom_id, body, digest = line_request(raw)
    assert custom_id == "a"
    assert (
        body == '{"seed":123456789012345678901234567890,"n":1,"messages":[{"role":"user","content":"café"}]}'.encode()
    )
    assert line_request(raw)[2] == digest  # the same line, the same key
    # past -2**63 in 19 digits: -1e+19 went upstream
    negative = b'{"custom_id": "n", "method": "POST", "url": "/v1/chat/completions", "body": {"seed": '
    assert line_request(negative + b"-9999999999999999999}}")[1] == b'{"seed":-9999999999999999999}'
    assert line_request(negative + b"-9223372036854775809}}")[1] == b'{"seed":-9223372036854775809}'
    assert line_request(negative + b"-9223372036854775808}}")[1] == b'{"seed":-9223372036854775808}'
    usual = orjson.dumps(chat_line("b", "question"))
    assert line_request(usual) == (
        "b",
        orjson.dumps(chat_line("b", "question")["body"]),
        payload_hash(chat_line("b", "question")["body"]),
    )


async def test_a_bad_limit_is_a_400_naming_it(settings: Settings, upstream: Any) -> None:
    async for client in proxy(settings, upstream[0]):
        for limit in ("abc", "1.5", "", "0", "101"):
            answer = await client.get("/v1/batches", params={"limit": limit})
            assert answer.status_code == 400, (limit, answer.text)
            assert answer.json()["error"]["param"] == "limit"


async def test_an_error_in_a_2xx_goes_to_the_error_file_and_is_not_kept(settings: Settings, upstream: Any) -> None:
    url, fake = upstream
    lines = [chat_line("fine", "q"), chat_line("disguised", "q", fake_upstream={"error_with_status": 200})]
    file_id = put_file(settings.checkpoints_dir, lines)
    async for client in proxy(settings, url):
        body = {"input_file_id": file_id, "endpoint": CHAT}
        first = await until(client, (await client.post("/v1/batches", json=body)).json()["id"], final)
        assert first["request_counts"] == {"total": 2, "completed": 1, "failed": 1}
        [error] = read_file(settings.checkpoints_dir, first["error_file_id"])
        assert error["custom_id"] == "disguised"
        asked = fake.requests
        await until(client, (await client.post("/v1/batches", json=body)).json()["id"], final)
        assert fake.requests == asked + 1  # sent again: it was not kept


async def test_a_running_batchs_input_is_not_deleted_through_another_proxy_on_the_dir(settings: Settings) -> None:
    async with fake_upstream(latency_ms=100) as (url, _):
        file_id = put_file(settings.checkpoints_dir, [chat_line(f"d{i}", f"q{i}") for i in range(300)])
        tight = settings.model_copy(update={"max_inflight_per_upstream": 2})
        async for owner in proxy(tight, url):
            batch_id = (await owner.post("/v1/batches", json={"input_file_id": file_id, "endpoint": CHAT})).json()["id"]
            await until(owner, batch_id, lambda b: b["status"] == "in_progress")
            async for other in proxy(tight, url):
                refused = await other.delete(f"/v1/files/{file_id}")
                assert refused.status_code == 409, refused.text
                assert batch_id in refused.json()["error"]["message"]
                await other.post(f"/v1/batches/{batch_id}/cancel")
            assert (await until(owner, batch_id, final))["status"] == "cancelled"


@pytest.mark.parametrize("content", [b"[1]", b"{}"], ids=["list", "no-fields"])
async def test_a_batch_json_that_is_json_but_no_batch_is_skipped_as_a_torn_one_is(
    settings: Settings, upstream: Any, content: bytes
) -> None:
    url, _ = upstream
    file_id = put_file(settings.checkpoints_dir, [chat_line("only", "q")])
    bad = settings.checkpoints_dir / "batches" / "batch_000000000000000000000000"
    bad.mkdir(parents=True)
    (bad / "batch.json").write_bytes(content)
    async for client in proxy(settings, url):
        created = (await client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": CHAT})).json()
        assert (await until(client, created["id"], final))["status"] == "completed"
        listed = await client.get("/v1/batches")
        assert listed.status_code == 200, listed.text
        assert [batch["id"] for batch in listed.json()["data"]] == [created["id"]]
        assert (await client.get(f"/v1/batches/{bad.name}")).status_code == 404


async def test_a_linked_batch_folder_or_input_file_is_never_read_through(settings: Settings, upstream: Any) -> None:
    """Whoever can write in a shared checkpoints dir cannot make a proxy run, list or read through a link
    (as the ranks' files are never opened through one)."""
    url, fake = upstream
    file_id = put_file(settings.checkpoints_dir, [chat_line("a", "q")])
    async for client in proxy(settings, url):
        done = (await client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": CHAT})).json()
        assert (await until(client, done["id"], final))["status"] == "completed"
    batches = settings.checkpoints_dir / "batches"
    elsewhere = settings.checkpoints_dir.parent / "elsewhere"
    (batches / done["id"]).rename(elsewhere)
    (batches / done["id"]).symlink_to(elsewhere)
    files = settings.checkpoints_dir / "files"
    (files / file_id).rename(settings.checkpoints_dir.parent / "input")
    (files / file_id).symlink_to(settings.checkpoints_dir.parent / "input")
    generations = fake.generations
    async for client in proxy(settings, url):
        assert (await client.get(f"/v1/batches/{done['id']}")).status_code == 404
        assert (await client.get("/v1/batches")).json()["data"] == []
        assert (await client.get(f"/v1/files/{file_id}/content")).status_code == 404
        assert (await client.get(f"/v1/files/{file_id}")).status_code == 404
        assert file_id not in [f["id"] for f in (await client.get("/v1/files")).json()["data"]]
        refused = await client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": CHAT})
        assert refused.status_code in (400, 404), refused.text
        assert file_id in refused.json()["error"]["message"]
    assert fake.generations == generations


async def test_a_batch_whose_input_is_lost_while_it_runs_fails_keeping_what_finished(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    """An input's bytes removed by hand (or a link put in their place) while the batch was stopped: its lines
    not run cannot be, so it fails saying why, with the lines done in its output file, once; not a retry
    (and a traceback) every 10 s for ever."""
    async with fake_upstream(latency_ms=50) as (url, fake):
        file_id = put_file(settings.checkpoints_dir, [chat_line(f"k{i}", f"q{i}") for i in range(200)])
        slow = settings.model_copy(update={"max_inflight_per_upstream": 8})
        async for client in proxy(slow, url):
            batch_id = await create_batch(client, file_id)
            await until(client, batch_id, lambda b: b["request_counts"]["completed"] >= 20)
        (settings.checkpoints_dir / "files" / file_id).unlink()
        generations = fake.generations
        async for client in proxy(slow, url):
            batch = await until(client, batch_id, final)
        assert fake.generations == generations  # nothing more sent
    assert batch["status"] == "failed", batch
    assert batch["failed_at"] is not None
    [error] = batch["errors"]["data"]
    assert error["code"] == "missing_input_file"
    done = batch["request_counts"]["completed"]
    assert f"with {done} of 200 lines done" in error["message"]
    output = read_file(settings.checkpoints_dir, batch["output_file_id"])
    assert len(output) == done == len({o["custom_id"] for o in output})
    assert "Traceback" not in caplog.text


async def test_a_planted_batch_folder_is_said_once_and_stops_no_other_batch(
    settings: Settings, upstream: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A folder whose owner.lock is a link (or whose batch.json is no record) is never run nor claimed, one
    WARNING line; it stopped the start, and then every look for batches to carry on (a traceback every 5 s)."""
    url, _ = upstream
    planted = settings.checkpoints_dir / "batches" / "batch_000000000000000000000001"
    source = settings.checkpoints_dir.parent / "elsewhere"
    source.write_text("")
    file_id = put_file(settings.checkpoints_dir, [chat_line("only", "q")])
    planted.mkdir(parents=True)
    record = {"id": planted.name, "status": "in_progress", "input_file_id": file_id, "endpoint": CHAT}
    fields = {"completion_window": "24h", "created_at": 1, "expires_at": 2**40, "serial": 7}
    (planted / "batch.json").write_bytes(orjson.dumps({**record, **fields}))
    (planted / "owner.lock").symlink_to(source)
    torn = settings.checkpoints_dir / "batches" / "batch_000000000000000000000002"
    torn.mkdir()
    (torn / "batch.json").write_bytes(b'{"id": "batch_000000000000000000000002", "sta')
    from app.service.batches import engine as engine_module

    with caplog.at_level(logging.WARNING), pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine_module, "ADOPT_EVERY_S", 0.05)
        async for client in proxy(settings, url):
            created = (await client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": CHAT})).json()
            assert (await until(client, created["id"], final))["status"] == "completed"
            await asyncio.sleep(0.3)  # several looks for batches to carry on (a wait, not a barrier)
    assert "Traceback" not in caplog.text
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert [line for line in said if planted.name in line] == [next(line for line in said if planted.name in line)], (
        said
    )
    assert "is a symbolic link" in next(line for line in said if planted.name in line)
    assert len([line for line in said if torn.name in line]) <= 1, said


async def test_a_batch_whose_results_were_damaged_says_so_once_then_carries_on_once_repaired(
    settings: Settings, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from app.service.batches import engine as engine_module

    monkeypatch.setattr(engine_module, "DAMAGED_RETRY_S", 0.1)
    async with fake_upstream(latency_ms=20) as (url, fake):
        file_id = put_file(settings.checkpoints_dir, [chat_line(f"k{i}", f"q{i}") for i in range(100)])
        slow = settings.model_copy(update={"max_inflight_per_upstream": 4})
        async for client in proxy(slow, url):
            batch_id = await create_batch(client, file_id)
            await until(client, batch_id, lambda b: b["request_counts"]["completed"] >= 10)
        results = settings.checkpoints_dir / "batches" / batch_id / "results.jsonl"
        whole = results.read_bytes()
        first_end = whole.index(b"\n") + 1
        results.write_bytes(whole[:first_end] + b"garbage\n" + whole[first_end:])
        with caplog.at_level(logging.WARNING):
            async for client in proxy(slow, url):
                deadline = time.monotonic() + 30
                while not (running := (await client.get("/stats")).json()["batches"]) or not running[0]["paused"]:
                    assert time.monotonic() < deadline, running
                    await asyncio.sleep(0.05)
                assert "results.jsonl" in running[0]["paused"]
                await asyncio.sleep(0.5)  # several tries (a wait, not a barrier)
                results.write_bytes(whole)  # repaired
                batch = await until(client, batch_id, final)
    assert batch["status"] == "completed"
    assert sorted(o["custom_id"] for o in read_file(settings.checkpoints_dir, batch["output_file_id"])) == sorted(
        f"k{i}" for i in range(100)
    )
    assert "Traceback" not in caplog.text
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, errors
    assert fake.generations <= 100 + 8


async def test_a_running_batch_whose_folder_is_removed_is_run_no_more(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    async with fake_upstream(latency_ms=100) as (url, fake):
        file_id = put_file(settings.checkpoints_dir, [chat_line(f"k{i}", f"q{i}") for i in range(500)])
        slow = settings.model_copy(update={"max_inflight_per_upstream": 4})
        with caplog.at_level(logging.WARNING):
            async for client in proxy(slow, url):
                batch_id = await create_batch(client, file_id)
                await until(client, batch_id, lambda b: b["request_counts"]["completed"] >= 8)
                shutil.rmtree(settings.checkpoints_dir / "batches" / batch_id)
                deadline = time.monotonic() + 30
                while (await client.get("/stats")).json()["batches"]:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.05)
                sent = fake.requests
                assert (await client.get(f"/v1/batches/{batch_id}")).status_code == 404
                await asyncio.sleep(0.5)  # nothing more is sent meanwhile (a wait, not a barrier)
                assert fake.requests == sent
    assert "Traceback" not in caplog.text
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and batch_id in r.getMessage()]
    assert len(said) == 1, said
    assert "was removed: it is run no more" in said[0]


async def test_a_create_with_a_field_of_the_wrong_kind_names_the_kind_json_calls_it(
    settings: Settings, upstream: Any
) -> None:
    async for client in proxy(settings, upstream[0]):
        for body, expected in (
            ({"input_file_id": ["x"], "endpoint": CHAT}, "`input_file_id` must be a string, the id of a file"),
            ({"endpoint": CHAT}, "`input_file_id` is required"),
            (None, "the request body must be a JSON object, got null"),
            ([1], "the request body must be a JSON object, got array"),
        ):
            answer = await client.post("/v1/batches", content=orjson.dumps(body))
            assert answer.status_code == 400, answer.text
            assert answer.json()["error"]["message"].startswith(expected), answer.text


async def test_deleting_the_error_file_of_a_batch_whose_lines_all_failed_forgets_its_kept_errors(
    settings: Settings, upstream: Any
) -> None:
    # A batch whose every line got a kept 400 has no output file to delete: its errors were replayed to
    # every later batch of the same lines, even once the cause was fixed.
    url, fake = upstream
    line = chat_line("a", "q", fake_upstream={"status": 400, "fail_times": 1})
    file_id = put_file(settings.checkpoints_dir, [line])
    async for client in proxy(settings, url):
        first = await until(client, await create_batch(client, file_id), final)
        assert (first["output_file_id"], first["request_counts"]["failed"]) == (None, 1)
        assert (await client.delete(f"/v1/files/{first['error_file_id']}")).status_code == 200
        again = await until(client, await create_batch(client, file_id), final)
    assert again["request_counts"] == {"total": 1, "completed": 1, "failed": 0}
    assert fake.requests == 2


async def test_proxies_of_two_hosts_keep_answers_apart_and_both_forget_an_output_deleted_through_either(
    settings: Settings, upstream: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One answers' file written by the proxies of every host sharing the checkpoints dir is one SQLite WAL
    # written from two kernels: corrupted. Each host has its own; a deletion through one host's proxy is
    # carried out by the other's at its next look at the batches.
    url, fake = upstream
    monkeypatch.setattr(app.service.batches.engine, "ADOPT_EVERY_S", 0.05)
    file_id = put_file(settings.checkpoints_dir, [chat_line(f"r{i}", f"q{i}") for i in range(10)])
    answers = settings.checkpoints_dir / "batches" / "answers"
    monkeypatch.setattr(app.store.batches.socket, "gethostname", lambda: "node-a")
    async for on_a in proxy(settings, url):
        monkeypatch.setattr(app.store.batches.socket, "gethostname", lambda: "node-b")
        async for on_b in proxy(settings, url):
            (a_file,) = answers.glob("host-node-a/00000/replay.sqlite3")
            (b_file,) = answers.glob("host-node-b/00000/replay.sqlite3")
            first = await until(on_a, await create_batch(on_a, file_id), final)
            assert (first["status"], fake.generations) == ("completed", 10)
            await eventually(lambda a=str(a_file): count_rows(a) == 10, "node a's answers were not kept in its file")
            assert count_rows(str(b_file)) == 0

            deleted = await on_b.delete(f"/v1/files/{first['output_file_id']}")
            assert deleted.status_code == 200, deleted.text
            await eventually(lambda a=str(a_file): count_rows(a) == 0, "node a kept the answers of a deleted output")
            again = await until(on_a, await create_batch(on_a, file_id), final)
            assert (again["status"], fake.generations) == ("completed", 20)  # each line generated again


async def test_an_output_whose_answers_cannot_be_forgotten_is_not_deleted(
    settings: Settings, upstream: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The answers are forgotten before the file goes: a full disk then refuses the deletion (507), rather
    # than a deleted output whose answers other hosts' proxies keep serving.
    url, fake = upstream
    file_id = put_file(settings.checkpoints_dir, [chat_line(f"r{i}", f"q{i}") for i in range(3)])
    async for client in proxy(settings, url):
        first = await until(client, await create_batch(client, file_id), final)

        def full(*_: Any, **__: Any) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(app.store.batches, "atomic_write_bytes", full)
        refused = await client.delete(f"/v1/files/{first['output_file_id']}")
        assert refused.status_code == 507, refused.text
        assert refused.json()["error"]["message"].startswith(f"file {first['output_file_id']} is not deleted: ")
        assert (await client.get(f"/v1/files/{first['output_file_id']}")).status_code == 200
        monkeypatch.undo()
        assert (await client.delete(f"/v1/files/{first['output_file_id']}")).status_code == 200
        again = await until(client, await create_batch(client, file_id), final)
        assert (again["status"], fake.generations) == ("completed", 6)


async def test_a_cancel_is_in_batch_json_when_it_is_answered_even_as_a_save_of_the_counts_is_under_way(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The periodic save of the counts and the cancel's own save wrote batch.json at once: the one begun first
    # (in_progress) could land last, and a kill then lost the acknowledged cancel: the batch ran every line.
    real_save = BatchDir.save
    slow_save_began = threading.Event()

    def slow_save(folder: BatchDir, record: BatchRecord) -> None:
        snapshot = dataclasses.replace(record)  # what a save's thread serializes as it begins
        if snapshot.status == "in_progress":
            slow_save_began.set()
            time.sleep(0.5)
        real_save(folder, snapshot)

    monkeypatch.setattr(app.service.batches.engine, "SAVE_EVERY_S", 0.02)
    monkeypatch.setattr(BatchDir, "save", slow_save)
    async with fake_upstream(latency_ms=50) as (url, _):
        file_id = put_file(settings.checkpoints_dir, [chat_line(f"d{i}", f"q{i}") for i in range(2000)])
        async for client in proxy(settings.model_copy(update={"max_inflight_per_upstream": 4}), url):
            batch_id = await create_batch(client, file_id)
            await until(client, batch_id, lambda b: b["status"] == "in_progress" and b["request_counts"]["completed"])
            slow_save_began.clear()
            await asyncio.to_thread(slow_save_began.wait, 10)  # a save of the counts is under way
            cancelled = await client.post(f"/v1/batches/{batch_id}/cancel")
            assert cancelled.json()["status"] == "cancelling"
            on_disk = orjson.loads((settings.checkpoints_dir / "batches" / batch_id / "batch.json").read_bytes())
            assert on_disk["status"] == "cancelling"
            await asyncio.sleep(0.6)  # the save of the counts has landed by now
            on_disk = orjson.loads((settings.checkpoints_dir / "batches" / batch_id / "batch.json").read_bytes())
            assert on_disk["status"] in ("cancelling", "cancelled")
            assert (await until(client, batch_id, final))["status"] == "cancelled"


async def test_a_batch_cancelled_while_its_input_is_checked_ends_cancelled_whatever_the_check_finds(
    settings: Settings, upstream: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A check that found a bad line after the cancel ended the batch `failed` (never `cancelled`, which a
    # client waiting after `cancelling` waits for); a good file got an `in_progress_at` it never ran at.
    url, fake = upstream
    real_check = app.service.batches.engine.check_input
    checking = threading.Event()
    go_on = threading.Event()

    def held_check(*args: Any) -> Any:
        checking.set()
        go_on.wait(10)
        return real_check(*args)

    monkeypatch.setattr(app.service.batches.engine, "check_input", held_check)
    good = put_file(settings.checkpoints_dir, [chat_line("a", "q")])
    bad = put_file(settings.checkpoints_dir, [], raw=orjson.dumps(chat_line("a", "q")) + b"\n{not json\n")
    async for client in proxy(settings, url):
        for file_id in (bad, good):
            checking.clear()
            go_on.clear()
            batch_id = await create_batch(client, file_id)
            await asyncio.to_thread(checking.wait, 10)
            assert (await client.post(f"/v1/batches/{batch_id}/cancel")).json()["status"] == "cancelling"
            go_on.set()
            ended = await until(client, batch_id, final)
            assert (ended["status"], ended["failed_at"], ended["in_progress_at"]) == ("cancelled", None, None)
            assert ended["cancelling_at"] is not None
            assert ended["cancelled_at"] is not None
            if file_id == bad:
                assert [error["code"] for error in ended["errors"]["data"]] == ["invalid_json_line"]
    assert fake.requests == 0


async def test_a_page_of_batches_reads_its_own_records_and_one_more_not_every_batchs(
    settings: Settings, upstream: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each GET /v1/batches read every batch.json ever written, on the event loop: 100 ms a page at 2,000
    # batches, every other request (cache hits too) waiting meanwhile.
    url, _ = upstream
    file_id = put_file(settings.checkpoints_dir, [chat_line("a", "q")])
    real_load = BatchDir.load
    loaded: list[str] = []

    def counted(folder: BatchDir) -> BatchRecord:
        loaded.append(folder.id)
        return real_load(folder)

    async for client in proxy(settings, url):
        made = [await create_batch(client, file_id) for _ in range(12)]
        for batch_id in made:
            await until(client, batch_id, final)
        monkeypatch.setattr(BatchDir, "load", counted)
        first = (await client.get("/v1/batches", params={"limit": 3})).json()
        assert [b["id"] for b in first["data"]] == made[::-1][:3]
        assert first["has_more"] is True
        assert len(loaded) <= 4
        last = (await client.get("/v1/batches", params={"limit": 5, "after": made[4]})).json()
        assert ([b["id"] for b in last["data"]], last["has_more"]) == (made[:4][::-1], False)


async def test_the_input_of_a_cancelling_batch_is_refused_saying_to_wait_and_not_to_be_retried_at_once(
    settings: Settings,
) -> None:
    # The refusal said to cancel a batch already cancelling; and the openai client retried the 409 twice.
    hung = Hung()
    file_id = put_file(settings.checkpoints_dir, [chat_line(f"r{i}", f"q{i}") for i in range(4)])
    async with serve_in_loop(hung) as url:
        async for client in proxy(settings.model_copy(update={"read_timeout_s": 30.0, "shutdown_grace_s": 1.0}), url):
            batch_id = await create_batch(client, file_id)
            await hung.until(1)  # a line in flight, which the cancel lets finish
            assert (await client.post(f"/v1/batches/{batch_id}/cancel")).json()["status"] == "cancelling"
            refused = await client.delete(f"/v1/files/{file_id}")
            assert refused.status_code == 409
            assert refused.headers["x-should-retry"] == "false"
            assert refused.json()["error"]["message"] == (
                f"file {file_id} is the input of batch {batch_id}, which is cancelling: wait for it to end (its "
                f"lines in flight), then delete the file"
            )
