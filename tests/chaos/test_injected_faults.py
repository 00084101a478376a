"""A crash at each step where the proxy makes something durable, then a restart: nothing lost, nothing twice.

The proxy (a real `inferproxy serve`, see `faulty_serve`) kills itself with SIGKILL the N-th time a step
happens (N drawn from the seed), under load from four ranks; it is restarted, the jobs carry on, and the
run ends with every invariant checked (`Run.finish`). The steps:

- each step of chunk completion (`CheckpointManager`'s `fault` hook): the output closed (published),
  `last_chunk` written, the chunk file deleted, the chunk's cache rows dropped;
- publishing a chunk: its file written under a temporary name, not yet renamed over its own;
- the cache writer: a batch of answers inserted but not committed, and a batch cut between two of its
  INSERT statements. A batch is one transaction: none of the cut batch's rows may be in the file.
"""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

import pytest

from tests.chaos.conftest import Chaos
from tests.chaos.harness import ProxyProcess, RankJob, UpstreamProcess, chaos_run
from tests.chaos.invariants import Ledger
from tests.faults import CHUNK_COMPLETION_STEPS

pytestmark = pytest.mark.chaos

RANKS = 4
RECORDS_PER_CHUNK = 5
SETTLE_S = 1.0
CACHE_STEPS = ("cache_commit", "cache_mid_batch")


def rows_of_cut_batch(fault: dict[str, object]) -> list[tuple[str, int]]:
    """Which of the rows the cut batch had inserted are in its cache file now."""
    keys = fault["keys"]
    assert isinstance(keys, list)
    assert keys, f"the fault cut no rows: {fault}"
    with contextlib.closing(sqlite3.connect(str(fault["db"]))) as conn:
        return [
            (doc_id, rollout_idx)
            for doc_id, rollout_idx in keys
            if conn.execute(
                "SELECT 1 FROM request_cache WHERE doc_id = ? AND rollout_idx = ?", (doc_id, rollout_idx)
            ).fetchone()
        ]


@pytest.mark.parametrize("step", [*CHUNK_COMPLETION_STEPS, "publish_rename", *CACHE_STEPS])
async def test_a_crash_at_each_durable_step_breaks_no_invariant(tmp_path: Path, chaos: Chaos, step: str) -> None:
    nth = chaos.rng(step).randint(1, chaos.count(3, 8))
    documents = chaos.count(24, 99)
    # A long group-commit window for the cache steps: batches of several rows, several INSERT statements.
    flush_interval_ms = 200 if step in CACHE_STEPS else 50
    upstream = UpstreamProcess(tmp_path, latency_ms=5)
    upstream.start()
    try:
        await upstream.ready()
        proxy = ProxyProcess(
            tmp_path,
            [upstream.url],
            f"--records-per-chunk={RECORDS_PER_CHUNK}",
            f"--flush-interval-ms={flush_interval_ms}",
        )
        inputs = {rank: [f"r{rank}-doc-{i}" for i in range(documents)] for rank in range(RANKS)}
        ledger = Ledger(inputs, RECORDS_PER_CHUNK, replay_window_s=flush_interval_ms / 1000 + SETTLE_S)
        jobs = [RankJob(proxy.url, ledger, rank, restarts=rank % 2 == 1) for rank in range(RANKS)]
        async with chaos_run(proxy, ledger, jobs, fault=f"{step}@{nth}") as run:
            await run.until(lambda: proxy.died_of_fault() is not None, f"a crash at {step} (time {nth})")
            fault = proxy.died_of_fault()
            assert fault is not None
            if step in CACHE_STEPS:
                assert rows_of_cut_batch(fault) == [], "a batch cut by a crash left some of its rows behind"
            run.died(float(fault["at"]))
            await run.restart()
            await run.finish()
    finally:
        upstream.close()
