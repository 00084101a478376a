"""Many proxies on one checkpoints dir, a proxy SIGKILLed under load, and checkpoints lost with a node.

Real `inferproxy serve` and `fake-upstream` processes; the jobs are `app.job.run.run_job`
in this process, one per rank, each pointed at its node's proxy as a cluster's would be.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from app.http.client import HTTPClient, HTTPClientError
from app.job.run import run_job
from tests.e2e.conftest import Upstream, running_upstream
from tests.e2e.conftest import start_proxy as proxy_args
from tests.servers import process, wait_for_http

pytestmark = pytest.mark.e2e

ROLLOUTS = 2


class Stop(Exception):
    """Raised from a job's progress callback: the job dies there."""


@pytest.fixture
def slow_upstream() -> Iterator[Upstream]:
    with running_upstream(latency_ms=15) as started:
        yield started


def inputs(rank: int, n: int) -> list[dict[str, Any]]:
    return [{"id": f"r{rank}-d{i}", "text": f"question {i} of rank {rank}"} for i in range(n)]


async def job(
    url: str, rank: int, n: int, *, records_per_chunk: int, stop_after: int | None = None, concurrency: int = 4
) -> None:
    http = HTTPClient(connect_timeout=2.0, read_timeout=60.0)
    written = 0

    async def rollout(document: Any, rollout_idx: int, headers: dict[str, str]) -> str:
        body = {"model": "fake-model", "messages": [{"role": "user", "content": document.text}], "max_tokens": 8}
        raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
        async with http.request(
            "POST",
            url + "/v1/chat/completions",
            headers=[*raw, (b"content-type", b"application/json")],
            body=orjson.dumps(body),
        ) as answer:
            data = await answer.read()
        if answer.status != 200:
            raise RuntimeError(f"rank {rank}: {answer.status} {data[:300]!r}")
        return str(orjson.loads(data)["choices"][0]["message"]["content"])

    def count(_: str) -> None:
        nonlocal written
        written += 1
        if stop_after is not None and written >= stop_after:
            raise Stop

    try:
        await run_job(
            inputs(rank, n),
            rollout,
            base_url=url,
            rank=rank,
            rollouts_per_document=ROLLOUTS,
            concurrency=concurrency,
            records_per_chunk=records_per_chunk,
            on_written=count,
            progress=False,
            unreachable_wait_s=1.0,  # its proxy killed for good: the job fails at once, and is run elsewhere
        )
    finally:
        await http.close()


def output_ids(output: Path) -> Counter[str]:
    """Every document id in the published output, with how often it appears (each with its rollouts)."""
    seen: Counter[str] = Counter()
    for path in output.iterdir():
        assert not path.name.startswith("."), f"a partial file was left: {path.name}"
        for line in path.read_bytes().split(b"\n"):
            if line:
                record = json.loads(line)
                assert len(record["metadata"]["rollout_results"]) == ROLLOUTS
                seen[record["id"]] += 1
    return seen


def test_proxies_share_a_checkpoints_dir_and_a_killed_ones_ranks_finish_through_another(
    slow_upstream: Upstream, tmp_path: Path
) -> None:
    ranks, per_rank, rpc = 8, 60, 10
    extra = ["--records-per-chunk=10", "--flush-interval-ms=5"]
    started = [proxy_args(slow_upstream.url, tmp_path, *extra) for _ in range(3)]
    with process(*started[0][0]) as victim, process(*started[1][0]), process(*started[2][0]):
        urls = [f"http://127.0.0.1:{port}" for _, port in started]
        for url in urls:
            wait_for_http(url + "/healthz")

        async def everything() -> None:
            # rank r's node runs proxy r % 3; proxy 0 dies once 4 chunks of its ranks are published
            jobs = {
                rank: asyncio.create_task(job(urls[rank % 3], rank, per_rank, records_per_chunk=rpc))
                for rank in range(ranks)
            }
            victims = [rank for rank in range(ranks) if rank % 3 == 0]

            async def watch() -> None:
                while True:
                    done = [(tmp_path / "output").glob(f"{rank:05d}_chunk_*.jsonl") for rank in victims]
                    if sum(len(list(files)) for files in done) >= 4:
                        return
                    await asyncio.sleep(0.01)

            await asyncio.wait_for(watch(), timeout=60)
            victim.kill()  # SIGKILL under load: its ranks' requests fail mid-flight
            for rank in victims:
                with pytest.raises(
                    (HTTPClientError, RuntimeError)
                ):  # a connection error or a 5xx, whichever came first
                    await jobs[rank]
            # the restarted tasks of its ranks go to the next node's proxy, which takes the ranks over
            for rank in victims:
                jobs[rank] = asyncio.create_task(job(urls[1], rank, per_rank, records_per_chunk=rpc))
            await asyncio.wait_for(asyncio.gather(*jobs.values()), timeout=120)

        asyncio.run(everything())
    seen = output_ids(tmp_path / "output")
    expected = {f"r{rank}-d{i}" for rank in range(ranks) for i in range(per_rank)}
    assert set(seen) == expected
    assert max(seen.values()) == 1
    # Generations: what was needed, plus at most what the killed proxy's ranks had in flight at its
    # death (3 ranks x 4 documents x 2 rollouts) and what it answered in its last 5 ms group-commit
    # window without storing (the same bound again).
    needed = ranks * per_rank * ROLLOUTS
    assert needed <= slow_upstream.stats()["generations"] <= needed + 2 * 3 * 4 * ROLLOUTS


def test_a_rank_whose_checkpoints_are_lost_resumes_after_its_last_published_chunk(
    slow_upstream: Upstream, tmp_path: Path
) -> None:
    per_rank, rpc = 100, 10
    args, port = proxy_args(slow_upstream.url, tmp_path, "--records-per-chunk=10")
    url = f"http://127.0.0.1:{port}"
    with process(*args) as proxy:
        wait_for_http(url + "/healthz")
        with pytest.raises(Stop):
            asyncio.run(job(url, 3, per_rank, records_per_chunk=rpc, stop_after=45))
        proxy.kill()
    # The node is lost with its disk: nothing of rank 3's checkpoints is left, its cache included.
    shutil.rmtree(tmp_path / "checkpoints" / "00003")
    (tmp_path / "checkpoints" / "last_chunk" / "00003.txt").unlink()
    published = sorted(int(p.name.split("_")[-1].split(".")[0]) for p in (tmp_path / "output").iterdir())
    last = -1
    while last + 1 in published:
        last += 1
    assert last >= 1
    before = slow_upstream.stats()["generations"]
    with process(*args):
        wait_for_http(url + "/healthz")
        asyncio.run(job(url, 3, per_rank, records_per_chunk=rpc))
    seen = output_ids(tmp_path / "output")
    assert seen == Counter({f"r3-d{i}": 1 for i in range(per_rank)})
    # Only the documents of chunks after the recovered one were generated again.
    assert slow_upstream.stats()["generations"] - before == (per_rank - (last + 1) * rpc) * ROLLOUTS
