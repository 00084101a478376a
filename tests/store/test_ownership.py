"""Ranks owned per proxy (`app.store.ownership`): one live owner at a time, named to the others, taken over at once."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest

import app.checkpoints.chunkfiles
import app.store.cache
import app.store.ownership
from app.checkpoints.manager import CheckpointManager
from app.job.client import ProxyJob, RankOwnedElsewhere
from app.service.app import create_app
from app.store.layout import CheckpointsLayout
from app.store.ownership import RankOwnedError, RankOwnership
from tests.factories import completion_request
from tests.servers import fake_upstream, proxy_client, serve_in_loop
from tests.service.test_checkpoint_routes import config, doc, post

# Under both servers: the app must behave the same under the built-in one and under uvicorn.
pytestmark = pytest.mark.usefixtures("http_server")


def test_a_rank_is_owned_by_one_holder_at_a_time_and_the_refusal_names_it(tmp_path: Path) -> None:
    layout = CheckpointsLayout(str(tmp_path))
    first, second = RankOwnership(layout, port=8123), RankOwnership(layout)
    first.claim(3)
    first.claim(3)  # again: already ours
    second.claim(4)  # other ranks are free
    with pytest.raises(RankOwnedError, match=rf"rank 3 is owned by .*pid {os.getpid()} on host {socket.gethostname()}"):
        second.claim(3)
    with pytest.raises(RankOwnedError, match="listening on port 8123"):
        second.claim(3)
    assert first.owned() == [3]
    first.release(3)
    first.release(3)  # idempotent
    second.claim(3)  # free again: taken over at once
    assert second.owned() == [3, 4]
    second.release_all()
    assert not second.owns(3)


def test_a_claim_that_fails_half_way_is_not_left_taken(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def disk_full(*_: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    layout = CheckpointsLayout(str(tmp_path))
    with monkeypatch.context() as patched:
        patched.setattr(os, "pwrite", disk_full)
        with pytest.raises(OSError, match="No space left"):
            RankOwnership(layout).claim(0)
    RankOwnership(layout).claim(0)  # not held by the failed attempt


async def first_request(client: httpx.AsyncClient, route: str) -> httpx.Response:
    """A route's request for rank 0: each claims the rank first when it is not open."""
    if route == "documents":
        return await post(client, doc("a"))
    if route == "resume":
        return await client.get("/resume", headers={"X-Rank": "0"})
    if route == "complete":
        return await client.post("/chunks/0/complete", headers={"X-Rank": "0"})
    if route == "lookup":
        return await client.post("/lookup", json=[{"doc_id": "a", "body": completion_request()}])
    return await client.post("/v1/completions", json=completion_request(), headers={"X-Doc-Id": "a"})


@pytest.mark.parametrize(
    ("route", "code", "refused"),
    [
        pytest.param("documents", errno.ENOSPC, "pwrite", id="documents-ENOSPC"),
        pytest.param("documents", errno.EDQUOT, "pwrite", id="documents-EDQUOT"),
        pytest.param("documents", errno.ENOSPC, "owners folder", id="documents-owners-folder"),
        pytest.param("resume", errno.ENOSPC, "pwrite", id="resume"),
        pytest.param("complete", errno.ENOSPC, "pwrite", id="complete"),
        pytest.param("lookup", errno.ENOSPC, "pwrite", id="lookup"),
        pytest.param("v1", errno.ENOSPC, "pwrite", id="v1"),
    ],
)
async def test_a_full_disk_refusing_the_owner_lock_gets_507_naming_the_checkpoints_dir_and_leaves_the_rank_free(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, route: str, code: int, refused: str
) -> None:
    # Was a 500 ("inferproxy failed on this request: OSError: ..."), as if the proxy were at fault.
    def disk_full(*_: object) -> int:
        raise OSError(code, os.strerror(code))

    async with fake_upstream() as (url, upstream):
        settings = config(tmp_path, url)
        async with proxy_client(settings) as client:
            if refused == "pwrite":
                monkeypatch.setattr(os, "pwrite", disk_full)
            else:
                monkeypatch.setattr(app.store.ownership, "make_dirs_durable", disk_full)
            answer = await first_request(client, route)
            monkeypatch.undo()
            assert answer.status_code == 507
            error = answer.json()["error"]
            assert error["type"] == "insufficient_storage"
            assert error["message"] == (
                f"rank 0 cannot be opened: the checkpoints disk is full ({os.strerror(code)}), and nothing of this "
                f"request was written; free space under {settings.checkpoints_dir}, then send it again"
            )
            assert upstream.requests == 0
            assert not (settings.checkpoints_dir / "00000").exists()
            other = RankOwnership(CheckpointsLayout(str(settings.checkpoints_dir)))
            other.claim(0)  # the failed claim holds nothing
            other.release(0)
            assert (await first_request(client, route)).status_code == 200


@pytest.mark.parametrize("route", ["documents", "resume", "v1"])
@pytest.mark.parametrize("code", [errno.EROFS, errno.EACCES], ids=["EROFS", "EACCES"])
async def test_a_checkpoints_dir_that_became_unwritable_gets_503_saying_what_to_fix_and_leaves_the_rank_free(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, route: str, code: int
) -> None:
    # Was a 500 with a traceback logged for every request ("inferproxy failed on this request: OSError").
    lock = str(tmp_path / "ckpt" / "owners" / "00000.lock")

    def unwritable(*_: object) -> int:
        raise OSError(code, os.strerror(code), lock)

    async with fake_upstream() as (url, upstream):
        settings = config(tmp_path, url)
        async with proxy_client(settings) as client:
            monkeypatch.setattr(os, "pwrite", unwritable)
            answer = await first_request(client, route)
            monkeypatch.undo()
            assert answer.status_code == 503
            assert answer.headers["retry-after"] == "10"
            assert answer.json()["error"]["message"] == (
                f"rank 0 cannot be opened: the checkpoints dir cannot be written ({os.strerror(code)}: {lock}), and "
                f"nothing of this request was written; make {settings.checkpoints_dir} writable for the proxy's "
                f"user (remount it read-write, or fix its permissions), then send it again"
            )
            assert upstream.requests == 0
            assert (await first_request(client, route)).status_code == 200


async def test_an_open_ranks_write_into_a_checkpoints_dir_that_became_unwritable_is_503_without_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    chunk_file = str(tmp_path / "ckpt" / "00000" / "chunk_00001.jsonl")

    async def read_only(*_: object) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), chunk_file)

    async with fake_upstream() as (url, _), proxy_client(config(tmp_path, url)) as client:
        assert (await post(client, doc("a"), chunk=0)).status_code == 200
        monkeypatch.setattr(app.checkpoints.chunkfiles.ChunkFiles, "open", read_only)
        answers = [await post(client, doc(f"b{i}"), chunk=1) for i in range(3)]
        monkeypatch.undo()
        for answer in answers:
            assert answer.status_code == 503
            assert answer.headers["retry-after"] == "10"
            assert answer.json()["error"]["message"].startswith(
                f"the checkpoints dir cannot be written (Read-only file system: {chunk_file}), and nothing of this "
                "request was written; make "
            )
        assert not [r for r in caplog.records if r.exc_info]  # one WARNING line each, no traceback
        assert (await post(client, doc("b0"), chunk=1)).json()["written"] == 1


async def test_two_proxies_share_a_checkpoints_dir_and_each_rank_has_one_owner(tmp_path: Path) -> None:
    async with fake_upstream() as (url, _):
        settings = config(tmp_path, url)
        async with proxy_client(settings) as first, proxy_client(settings) as second:
            assert (await post(first, doc("a"), rank=0)).status_code == 200
            assert (await post(second, doc("b"), rank=1)).status_code == 200
            for route in ("post", "resume", "complete", "v1"):
                if route == "post":
                    answer = await post(second, doc("c"), rank=0)
                elif route == "resume":
                    answer = await second.get("/resume", headers={"X-Rank": "0"})
                elif route == "complete":
                    answer = await second.post("/chunks/0/complete", headers={"X-Rank": "0"})
                else:
                    answer = await second.post(
                        "/v1/completions",
                        json={"model": "m", "prompt": "p"},
                        headers={"X-Rank": "0", "X-Doc-Id": "a"},
                    )
                assert answer.status_code == 409, route
                error = answer.json()["error"]
                assert error["type"] == "rank_owned_error"
                assert f"rank 0 is owned by another inferproxy (pid {os.getpid()}" in error["message"]
            # the first proxy's rank 0 is untouched by the refusals
            assert (await first.get("/resume", headers={"X-Rank": "0"})).json()["processed_ids"] == ["a"]
        # both stopped: either can take either rank, and it resumes as the first left it
        async with proxy_client(settings) as third:
            resume = (await third.get("/resume", headers={"X-Rank": "0"})).json()
            assert resume["processed_ids"] == ["a"]
            assert (await third.get("/resume", headers={"X-Rank": "1"})).json()["processed_ids"] == ["b"]


async def test_a_finished_rank_is_released_for_another_proxy(tmp_path: Path) -> None:
    async with fake_upstream() as (url, _):
        settings = config(tmp_path, url)
        async with proxy_client(settings) as first, proxy_client(settings) as second:
            assert (await post(first, [doc("a"), doc("b")], rank=2)).status_code == 200
            assert (await first.post("/chunks/0/complete", headers={"X-Rank": "2"})).status_code == 200
            resume = (await second.get("/resume", headers={"X-Rank": "2"})).json()
            assert resume["last_chunk_index"] == 0
            assert resume["docs_to_skip"] == 3


async def test_an_idle_rank_is_released_for_another_proxy_and_a_busy_one_is_not(tmp_path: Path) -> None:
    async with fake_upstream(latency_ms=600) as (url, _):
        settings = config(tmp_path, url, rank_idle_s=0.1)
        async with proxy_client(settings) as first, proxy_client(settings) as second:
            slow = asyncio.create_task(
                first.post("/v1/completions", json=completion_request(), headers={"X-Doc-Id": "b"})
            )
            await asyncio.sleep(0.4)  # several release rounds while the request is in flight
            assert (await second.get("/resume")).status_code == 409
            assert (await slow).headers["x-cache"] == "MISS"
            assert (await post(first, doc("a"))).status_code == 200
            # the job has moved on: once the rank is idle, the other proxy gets it and resumes it
            for _ in range(100):
                answer = await second.get("/resume")
                if answer.status_code == 200:
                    break
                await asyncio.sleep(0.05)
            assert answer.json()["processed_ids"] == ["a"]
            assert (await first.get("/stats")).json()["owned_ranks"] == []
            again = await second.post("/v1/completions", json=completion_request(), headers={"X-Doc-Id": "b"})
            assert again.headers["x-cache"] == "HIT"  # the cache moved with the rank


async def test_a_proxy_stopped_while_it_releases_an_idle_rank_stops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The release round cancelled at shutdown while it waited for the rank's cache writer to stop took
    that cancellation for the writer's, went on releasing every rank_idle_s / 4, and the shutdown waited
    for it for ever (CI: a 300 s timeout under uvicorn, whose shutdown lets a round begin first)."""
    writer_loop = app.store.cache.RequestCache._writer_loop
    closing = asyncio.Event()

    async def slow_to_stop(self: Any) -> None:
        try:
            await writer_loop(self)
        finally:  # the release round waits here for the writer, and the shutdown begins meanwhile
            closing.set()
            await asyncio.sleep(1.0)

    monkeypatch.setattr(app.store.cache.RequestCache, "_writer_loop", slow_to_stop)

    async def released_then_stopped() -> None:
        async with fake_upstream() as (url, _), proxy_client(config(tmp_path, url, rank_idle_s=0.05)) as client:
            assert (await post(client, doc("a"))).status_code == 200
            await closing.wait()

    await asyncio.wait_for(released_then_stopped(), 30)


async def test_ranks_finished_or_released_leave_nothing_of_them_in_the_proxy(tmp_path: Path) -> None:
    """A proxy may serve a job of thousands of tasks over its life, a rank each (bench/soak.py runs a new
    one every second for an hour): what it keeps per rank must go with the rank, or it grows without end."""
    async with fake_upstream() as (url, _):
        app = create_app(config(tmp_path, url, rank_idle_s=0.05))
        async with serve_in_loop(app) as proxy, httpx.AsyncClient(base_url=proxy, timeout=30) as client:
            for rank in range(1, 11):  # a whole job each: a generation, its document, its last chunk completed
                headers = {"X-Rank": str(rank), "X-Doc-Id": f"d{rank}", "X-Chunk-Index": "0"}
                answer = await client.post("/v1/completions", json=completion_request(), headers=headers)
                assert answer.status_code == 200
                assert (await post(client, doc(f"d{rank}"), rank=rank)).status_code == 200
                assert (await client.post("/chunks/0/complete", headers={"X-Rank": str(rank)})).status_code == 200
            for rank in range(11, 21):  # used once, then released once idle
                assert (await client.get("/resume", headers={"X-Rank": str(rank)})).status_code == 200
            services = app.services
            assert services is not None
            for _ in range(200):  # the janitor's rounds, every rank_idle_s / 4
                if not services.caches.ownership.owned() and not services.activity.last_used:
                    break
                await asyncio.sleep(0.05)
            assert services.caches.ownership.owned() == []
            assert services.activity.last_used == {}
            assert len(services.caches._opening) == len(services.checkpoints._opening) == 0


async def test_the_job_client_waits_for_a_rank_owned_elsewhere_until_it_is_released(tmp_path: Path) -> None:
    async with fake_upstream() as (url, _):
        settings = config(tmp_path, url, rank_idle_s=0.3)
        async with proxy_client(settings) as first, proxy_client(settings) as second:
            assert (await post(first, doc("a"), rank=5)).status_code == 200
            impatient = ProxyJob(str(second.base_url), rank=5, owned_wait_s=0)
            with pytest.raises(RankOwnedElsewhere, match="rank 5 is owned by another inferproxy"):
                await impatient.resume()
            await impatient.close()
            patient = ProxyJob(str(second.base_url), rank=5, owned_wait_s=30)
            state = await patient.resume()  # waits for the first proxy to leave the idle rank
            await patient.close()
            assert state.processed_ids == frozenset({"a"})


async def test_a_batch_refused_because_the_rank_is_owned_elsewhere_is_not_sent_again_document_by_document(
    tmp_path: Path,
) -> None:
    # Each attempt waits up to owned_wait_s (180 s by default): a batch of n documents sent again one by
    # one would wait n + 1 times as long before its writers learn that the rank is another proxy's.
    async with fake_upstream() as (url, _):
        settings = config(tmp_path, url, records_per_chunk=100)
        async with proxy_client(settings) as first, proxy_client(settings) as second:
            assert (await post(first, doc("a"), rank=5)).status_code == 200
            job = ProxyJob(str(second.base_url), rank=5, owned_wait_s=0)
            sent: list[str] = []
            real_request = job._client.request

            def counting(method: str, url: str, **kwargs: Any) -> Any:
                sent.append(url.rsplit("/", 1)[-1])
                return real_request(method, url, **kwargs)

            job._client.request = counting  # type: ignore[method-assign]
            results = await asyncio.gather(
                *(job.write_document(doc(f"d{i}"), 0) for i in range(6)), return_exceptions=True
            )
            await job.close()
    assert all(isinstance(result, RankOwnedElsewhere) for result in results)
    assert sent == ["documents"]  # one batch, one refusal shared by its six writers


async def test_a_rank_whose_checkpoints_fail_to_close_when_idle_leaves_nothing_of_it_open_once_released(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_close = CheckpointManager.close

    async def eio(self: CheckpointManager, **options: Any) -> bool:
        await real_close(self, **options)  # its chunk files are closed, but their last fsync failed
        raise OSError(errno.EIO, "Input/output error")

    async with fake_upstream() as (url, _):
        settings = config(tmp_path, url, rank_idle_s=0.05)
        async with proxy_client(settings) as first:
            monkeypatch.setattr(CheckpointManager, "close", eio)
            assert (await post(first, doc("a"), rank=4)).status_code == 200
            answer = await first.post("/v1/completions", json=completion_request(), headers=rank_4("b"))
            assert answer.headers["x-cache"] == "MISS"
            for _ in range(200):  # released once idle, close failure or not
                if (await first.get("/stats")).json()["owned_ranks"] == []:
                    break
                await asyncio.sleep(0.02)
            rank_dir = str(tmp_path / "ckpt" / "00004")
            assert not [fd for fd in open_files() if fd.startswith(rank_dir)]  # its request cache was closed too
            monkeypatch.undo()
            # another proxy takes it over and finds what was stored before the release
            async with proxy_client(settings) as second:
                for _ in range(200):
                    if (await second.get("/resume", headers={"X-Rank": "4"})).status_code == 200:
                        break
                    await asyncio.sleep(0.02)
                again = await second.post("/v1/completions", json=completion_request(), headers=rank_4("b"))
                assert again.headers["x-cache"] == "HIT"


def rank_4(doc_id: str) -> dict[str, str]:
    return {"X-Rank": "4", "X-Doc-Id": doc_id}


def open_files() -> list[str]:
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            found.append(os.readlink(f"/proc/self/fd/{fd}"))
    return found


def test_a_rank_given_up_is_taken_without_calling_its_owner_gone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    layout = CheckpointsLayout(str(tmp_path))
    first, second = RankOwnership(layout), RankOwnership(layout)
    first.identity = {"host": "node-a", "pid": 1}  # another proxy's, as far as second can tell
    with caplog.at_level(logging.INFO):
        first.claim(1)
        first.release(1)  # given up (idle, or its job finished)
        second.claim(1)
        assert "took over" not in caplog.text
        first.claim(2)
        os.close(first._fds.pop(2))  # what a kill -9 leaves: the lock gone, the owner's record still there
        second.claim(2)
    assert "took over rank 2 from a proxy that is gone (pid 1 on host node-a)" in caplog.text


def test_two_proxies_recording_different_records_per_chunk_on_a_fresh_dir_cannot_both_win(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Both found no record on the fresh dir and wrote theirs: the record was replaced, the last
    # writer won, and ranks opened in between used the other value.
    import app.checkpoints.resume
    from app.checkpoints.resume import RecordsPerChunkMismatch, check_records_per_chunk

    layout = CheckpointsLayout(str(tmp_path))
    real_read = app.checkpoints.resume.read_regular
    looked: list[str] = []

    def read_before_the_other_wrote(path: str, **kwargs: Any) -> bytes:
        if path == layout.meta_file and not looked:
            looked.append(path)
            check_records_per_chunk(layout, 100, record=True)  # the other proxy, in the window
            raise FileNotFoundError(path)  # what this one saw just before
        return real_read(path, **kwargs)

    monkeypatch.setattr(app.checkpoints.resume, "read_regular", read_before_the_other_wrote)
    with pytest.raises(RecordsPerChunkMismatch, match="written with records_per_chunk=100, this run uses"):
        check_records_per_chunk(layout, 200, record=True)
    monkeypatch.undo()
    assert (tmp_path / "checkpoint_meta.json").read_bytes() == b'{"records_per_chunk":100}'


async def test_past_max_open_ranks_the_least_recently_used_idle_rank_is_closed_and_reopened_on_demand(
    tmp_path: Path,
) -> None:
    """Each open rank holds files (its SQLite cache, chunk files, ownership lock): unbounded, a client
    naming many ranks runs the process out of descriptors, and then every rank fails."""
    async with fake_upstream() as (url, upstream), proxy_client(config(tmp_path, url, max_open_ranks=4)) as client:

        async def use(rank: int) -> httpx.Response:
            headers = {"X-Doc-Id": f"d{rank}", "X-Rank": str(rank)}
            answer = await client.post("/v1/completions", json=completion_request(), headers=headers)
            assert answer.status_code == 200, answer.text
            assert (await post(client, doc(f"doc-{rank}"), rank=rank)).status_code == 200  # a chunk file open
            return answer

        first = [await use(rank) for rank in range(4)]
        baseline = len(os.listdir("/proc/self/fd"))
        for rank in range(4, 20):
            await use(rank)
        assert len(os.listdir("/proc/self/fd")) <= baseline + 8  # 16 more ranks, each ~6 files, if none closed
        assert (await client.get("/stats")).json()["owned_ranks"] == [16, 17, 18, 19]
        for rank in (0, 3):  # closed long ago: reopened, and its answers are still there
            again = await client.post(
                "/v1/completions", json=completion_request(), headers={"X-Doc-Id": f"d{rank}", "X-Rank": str(rank)}
            )
            assert (again.headers["x-cache"], again.content) == ("HIT", first[rank].content)
            resume = (await client.get("/resume", headers={"X-Rank": str(rank)})).json()
            assert resume["processed_ids"] == [f"doc-{rank}"]
        assert upstream.generations == 20


async def test_when_every_open_rank_is_in_use_a_new_rank_gets_503_naming_max_open_ranks(tmp_path: Path) -> None:
    async with (
        fake_upstream(latency_ms=400) as (url, _),
        proxy_client(config(tmp_path, url, max_open_ranks=1)) as client,
    ):
        busy = asyncio.create_task(
            client.post("/v1/completions", json=completion_request(), headers={"X-Doc-Id": "a", "X-Rank": "0"})
        )
        for _ in range(200):
            if (await client.get("/stats")).json()["in_flight"]:
                break
            await asyncio.sleep(0.01)
        refused = await client.post(
            "/v1/completions", json=completion_request(), headers={"X-Doc-Id": "b", "X-Rank": "1"}
        )
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "too_many_ranks"
        assert "max_open_ranks" in refused.json()["error"]["message"]
        assert (await post(client, doc("x"), rank=1)).status_code == 503
        assert (await busy).status_code == 200
        # rank 0 is idle now: it makes room
        assert (await post(client, doc("x"), rank=1)).status_code == 200
        assert (await client.get("/stats")).json()["owned_ranks"] == [1]
