"""An S3 output that refuses uploads (403 AccessDenied) or stalls them, under load, through the shim in
front of moto (`tests/s3_server.py`).

`inferproxy serve --output=s3://bucket/prefix`, four ranks' jobs (`RankJob`) on it. At moments drawn by
progress from the seed:

- object PUTs denied (403, S3's XML error) until `/stats` says why a rank's chunks wait
  (`publication_error`), while documents go on being acknowledged (past `max_waiting_chunks`, 503 with
  `Retry-After`, which the job client retries); then allowed again, and the waiting chunks published;
- the same, with the proxy SIGKILLed and restarted in the middle of the spell (the output, snapshotted
  from the bucket, checked at rest); the restarted proxy's ranks, restored with their chunks waiting,
  fail to publish them again and say so, until the PUTs are allowed;
- object PUTs held (a stalled upload) for a few seconds while documents go on being acknowledged;
  then released.

The run ends in `Run.finish`, the output read from a snapshot of the bucket's prefix: every acknowledged
document published once, whole, nothing else under the prefix.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.chaos.conftest import Chaos
from tests.chaos.harness import ProxyProcess, RankJob, Run, UpstreamProcess, chaos_run
from tests.chaos.invariants import Ledger
from tests.chaos.test_disk_faults import until_publications_fail
from tests.e2e.test_s3_output import S3, s3, s3_server  # noqa: F401 (fixtures)

pytestmark = pytest.mark.chaos

RANKS = 4
RECORDS_PER_CHUNK = 5
FLUSH_INTERVAL_MS = 50
SETTLE_S = 1.0
#: The longest wait between two tries of a failing publication: once the PUTs are allowed again, the
#: chunks waiting go out within it (readiness, not a check of speed).
PUBLISH_RETRY_MAX_S = 2


async def control(store: S3, switch: str) -> None:
    """`/_test/deny`, `allow`, `hold` or `release` on the shim (see `tests/s3_server.py`)."""
    async with httpx.AsyncClient(timeout=10) as client:
        (await client.post(f"{store.endpoint}/_test/{switch}")).raise_for_status()


async def object_puts(store: S3) -> list[dict[str, Any]]:
    """Each object PUT to the bucket so far, as the shim recorded it (`held`, and `status` once answered)."""
    requests = await asyncio.to_thread(store.requests)
    return [r for r in requests if r["method"] == "PUT" and r["path"].count("/") >= 2]


async def acknowledged_meanwhile(run: Run, ledger: Ledger, since: int, what: str) -> None:
    """Wait until a chunk's worth more documents are acknowledged than `since` (the count when the fault
    began: a rank takes up to `max_waiting_chunks` of them before its writes get 503)."""
    await run.until(lambda: ledger.acks() >= since + RECORDS_PER_CHUNK, f"documents acknowledged {what}")


async def test_an_s3_output_refusing_or_stalling_uploads_loses_nothing_and_recovers(
    tmp_path: Path,
    chaos: Chaos,
    s3: S3,  # noqa: F811 (the fixture)
) -> None:
    rng = chaos.rng("s3-output")
    documents = chaos.count(239, 959)  # not a whole number of chunks: the last ones stay open till the end
    upstream = UpstreamProcess(tmp_path, latency_ms=5)
    upstream.start()
    try:
        await upstream.ready()
        proxy = ProxyProcess(
            tmp_path,
            [upstream.url],
            f"--records-per-chunk={RECORDS_PER_CHUNK}",
            f"--publish-retry-max-s={PUBLISH_RETRY_MAX_S}",
            output=s3.url("chaos"),
            env=s3.env,
        )
        inputs = {rank: [f"r{rank}-doc-{i}" for i in range(documents)] for rank in range(RANKS)}
        ledger = Ledger(inputs, RECORDS_PER_CHUNK, replay_window_s=FLUSH_INTERVAL_MS / 1000 + SETTLE_S)
        jobs = [RankJob(proxy.url, ledger, rank, restarts=rank % 2 == 1) for rank in range(RANKS)]
        total = RANKS * documents
        faults = ["403", "403 and SIGKILL", "a stall"]
        async with chaos_run(proxy, ledger, jobs) as run:
            for number, fault in enumerate(faults, start=1):
                point = rng.randint(total * number // 5, total * number // 5 + total // 10)
                await run.until(lambda point=point: ledger.acks() >= point, f"{point} acknowledged documents")
                since = ledger.acks()
                if fault.startswith("403"):
                    await control(s3, "deny")
                    errors = await until_publications_fail(run, proxy.url, f"PUTs denied ({fault})")
                    assert any("AccessDenied" in error or "Access Denied" in error for error in errors), errors
                    await acknowledged_meanwhile(run, ledger, since, "while the PUTs are denied")
                    if "SIGKILL" in fault:
                        await run.kill_and_restart()
                        # Its ranks, restored with their chunks waiting (up to max_waiting_chunks: 503 past
                        # it), fail to publish them again, and say so.
                        await until_publications_fail(run, proxy.url, "PUTs denied after the restart")
                    await control(s3, "allow")
                else:
                    await control(s3, "hold")
                    await run.until_async(lambda: held_put(s3), "an upload held by the stalled store", interval=0.05)
                    await acknowledged_meanwhile(run, ledger, since, "while the uploads are held")
                    await asyncio.sleep(rng.uniform(1.0, 3.0))
                    await control(s3, "release")
            await run.finish()
        puts = await object_puts(s3)
        assert sum(put.get("status") == 403 for put in puts) >= 2, "the store refused no upload"
        assert any(put["held"] for put in puts), "the store held no upload"
        assert len(ledger.deaths) == 2  # the kill mid-spell, and the last one in `finish`
    finally:
        upstream.close()


async def held_put(store: S3) -> bool:
    return any(put["held"] and "status" not in put for put in await object_puts(store))
