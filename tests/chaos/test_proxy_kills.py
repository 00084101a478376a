"""SIGKILL of `inferproxy serve` at random moments, under load from four ranks, restarted each time.

Half the kills (drawn from the seed) are power cuts as far as checkpoints go: every chunk file is cut
back to what its last fsync made durable (`ProxyProcess.cut_power`), so that an acknowledgement sent
before its fsync shows, which a SIGKILL alone never does (the kernel keeps what was written).

Each rank is a job-like client (`RankJob`): rollouts through `/v1/*`, streamed and not, chat and
completions, then its documents to `/documents`, full chunks completing as they fill. Two ranks ride
through a kill (each call retried, as the job client retries), two start over from `/resume` (as a job
killed with its proxy is restarted). The kill moments are drawn by progress (acknowledged documents) and
a few milliseconds more, from the seed. Short mode: 7 kills; `--chaos-long`: 40.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.chaos.conftest import Chaos
from tests.chaos.harness import ProxyProcess, RankJob, UpstreamProcess, chaos_run
from tests.chaos.invariants import Ledger

pytestmark = pytest.mark.chaos

RANKS = 4
RECORDS_PER_CHUNK = 10
FLUSH_INTERVAL_MS = 50
#: A commit takes an fsync more than its window, which a loaded machine stretches (see invariants.py).
SETTLE_S = 1.0


async def test_sigkill_at_random_moments_under_load_breaks_no_invariant(tmp_path: Path, chaos: Chaos) -> None:
    kills = chaos.count(7, 40)
    # Not a whole number of chunks: the last chunk of each rank stays open until the end, for the replay check.
    documents = chaos.count(79, 599)
    rng = chaos.rng("kills")
    upstream = UpstreamProcess(tmp_path, latency_ms=5)
    upstream.start()
    try:
        await upstream.ready()
        proxy = ProxyProcess(tmp_path, [upstream.url], f"--records-per-chunk={RECORDS_PER_CHUNK}")
        inputs = {rank: [f"r{rank}-doc-{i}" for i in range(documents)] for rank in range(RANKS)}
        ledger = Ledger(inputs, RECORDS_PER_CHUNK, replay_window_s=FLUSH_INTERVAL_MS / 1000 + SETTLE_S)
        jobs = [RankJob(proxy.url, ledger, rank, restarts=rank % 2 == 1) for rank in range(RANKS)]
        total = RANKS * documents
        async with chaos_run(proxy, ledger, jobs) as run:
            for point in sorted(rng.sample(range(total // 20, total * 9 // 10), kills)):
                await run.until(lambda point=point: ledger.acks() >= point, f"{point} acknowledged documents")
                await asyncio.sleep(rng.uniform(0, 0.05))
                await run.kill_and_restart(power_cut=rng.random() < 0.5)
            await run.finish()
        assert len(ledger.deaths) == kills + 1  # and the last one, in `finish`
    finally:
        upstream.close()
