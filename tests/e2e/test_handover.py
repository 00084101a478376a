"""A rank handed from one proxy to another while its output misbehaves: a proxy SIGTERMed in the middle of
a slow publication, and an output that refuses chunks while the job moves to another proxy.

Real `inferproxy serve` processes (through `tests.chaos.faulty_serve`, which slows or fails the output's
file calls from outside) on one checkpoints dir and one output; the jobs are `app.job.client.ProxyJob`.
"""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import httpx
import pytest

from app.job.client import ProxyJob
from tests.chaos.harness import ProxyProcess

pytestmark = pytest.mark.e2e

RPC = 10
NOWHERE = "http://127.0.0.1:9"  # no generation is asked for: the documents are posted as they are


def proxies(tmp_path: Path, *extra_a: str) -> tuple[ProxyProcess, ProxyProcess]:
    """Two proxies, A and B (each with its own log and fault switches), on one checkpoints dir and output."""
    shared = {"checkpoints": tmp_path / "checkpoints", "output": tmp_path / "output"}
    made = []
    for name, extra in (("a", extra_a), ("b", ())):
        (tmp_path / name).mkdir()
        made.append(ProxyProcess(tmp_path / name, [NOWHERE], f"--records-per-chunk={RPC}", *extra, **shared))
    return made[0], made[1]


def documents(first: int, count: int) -> list[dict[str, str]]:
    return [{"id": f"d{i:03d}", "text": f"document {i}"} for i in range(first, first + count)]


async def post_chunk(client: httpx.AsyncClient, url: str, chunk: int, docs: list[dict[str, str]]) -> None:
    answer = await client.post(url + "/documents", json=docs, headers={"X-Rank": "0", "X-Chunk-Index": str(chunk)})
    assert answer.status_code == 200, answer.text
    assert answer.json()["written"] == len(docs)


def published(output: Path) -> dict[str, list[str]]:
    """Every file of the output (hidden ones included: none may be left) and the ids in it."""
    return {
        path.name: [json.loads(line)["id"] for line in path.read_text().splitlines()]
        for path in sorted(output.iterdir())
    }


def expected_output(chunks: int, last: int) -> dict[str, list[str]]:
    ids = [f"d{i:03d}" for i in range(chunks * RPC + last)]
    return {f"00000_chunk_{c}.jsonl": ids[c * RPC : (c + 1) * RPC] for c in range(chunks + (1 if last else 0))}


@pytest.mark.parametrize("stall_s", [4.0, 9.0], ids=["given-up", "outlasting-the-grace"])
async def test_a_proxy_sigtermed_mid_publish_keeps_the_rank_until_its_publication_is_over(
    tmp_path: Path, stall_s: float
) -> None:
    # A's output stalls for stall_s at each open: its publication of chunk 0 hangs there. With a grace of
    # 1 s, A gives the publication up (4 s: noticed after the stall, its temporary file removed) or
    # cannot (9 s: longer than it waits) and keeps the rank's lock until it exits. Either way B may take
    # the rank over only once nothing of A's publication runs any more.
    a, b = proxies(tmp_path, "--shutdown-grace-s=1")
    a.slow_io(stall_s, tmp_path / "output")
    try:
        a.start()
        b.start()
        await asyncio.gather(a.ready(), b.ready())
        async with httpx.AsyncClient(timeout=30) as client:
            await post_chunk(client, a.url, 2, documents(2 * RPC, 5))
            await post_chunk(client, a.url, 1, documents(RPC, RPC - 1))
            # Completes chunk 0: its publication starts, and hangs (the answer need not wait for it).
            first = asyncio.create_task(post_chunk(client, a.url, 0, documents(0, RPC)))
            for _ in range(1000):
                if a.slowed():
                    break
                await asyncio.sleep(0.01)
            assert a.proc is not None
            a.proc.send_signal(signal.SIGTERM)
            job = ProxyJob(b.url, 0, owned_wait_s=60)
            try:
                resume = await job.resume()  # 409 from B while A holds the rank, retried
                # B got the rank: A's publication thread is over (given up), or A is gone with it.
                assert a.slept() or a.proc.poll() is not None
                assert (resume.last_chunk_index, resume.docs_to_skip) == (0, RPC)
                assert len(resume.processed_ids) == RPC - 1 + 5
                await post_chunk(client, b.url, 1, documents(2 * RPC - 1, 1))
                assert (await job.complete_chunk(2))["last_chunk_index"] == 2
            finally:
                await job.close()
            await first  # acknowledged by A before it stopped: it is in the output once
        assert a.proc.wait(timeout=30) == 0
    finally:
        a.close()
        b.close()
    assert published(tmp_path / "output") == expected_output(2, 5)


async def test_a_failing_output_never_pins_a_rank_the_job_finishes_through_another_proxy(tmp_path: Path) -> None:
    # A's output disk is full: chunk 0 cannot be published there. A keeps acknowledging the rank's
    # documents, says why chunks wait, and releases the idle rank all the same; B takes it over and
    # publishes what A could not.
    a, b = proxies(tmp_path, "--rank-idle-s=1")
    a.fail_io("ENOSPC", "write,fsync", tmp_path / "output")
    try:
        a.start()
        b.start()
        await asyncio.gather(a.ready(), b.ready())
        async with httpx.AsyncClient(timeout=30) as client:
            await post_chunk(client, a.url, 0, documents(0, RPC))
            await post_chunk(client, a.url, 1, documents(RPC, 3))  # acknowledged while chunk 0 waits
            for _ in range(500):
                rank = next(r for r in (await client.get(a.url + "/stats")).json()["ranks"] if r["rank"] == 0)
                if rank["publication_error"]:
                    break
                await asyncio.sleep(0.01)
            assert rank["chunks_waiting"] == 1
            assert "No space left on device" in rank["publication_error"]
            assert rank["publication_attempts"] >= 1
            metrics = (await client.get(a.url + "/metrics")).text
            assert 'inferproxy_chunks_waiting{rank="0"} 1.0' in metrics
            assert 'inferproxy_publication_failing{rank="0"} 1.0' in metrics
            refused = await client.get(a.url + "/resume", headers={"X-Rank": "0"})
            assert refused.status_code == 503
            assert int(refused.headers["retry-after"]) >= 1
            assert str(tmp_path / "output") in refused.json()["error"]["message"]
        # The job is moved to B's node: A gives the rank up once idle, though chunk 0 still waits.
        job = ProxyJob(b.url, 0, owned_wait_s=20)
        try:
            resume = await job.resume()
            assert (resume.last_chunk_index, resume.docs_to_skip) == (0, RPC)
            assert resume.processed_ids == {d["id"] for d in documents(RPC, 3)}
            async with httpx.AsyncClient(timeout=30) as client:
                await post_chunk(client, b.url, 1, documents(RPC + 3, 4))
            assert (await job.complete_chunk(1))["last_chunk_index"] == 1
        finally:
            await job.close()
    finally:
        a.close()
        b.close()
    assert published(tmp_path / "output") == expected_output(1, 7)
