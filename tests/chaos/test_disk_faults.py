"""A disk that fills up or fails under load: clear errors, nothing half-written, recovery once it is fixed.

The checkpoints and the output each get a small tmpfs of their own (a disk that really fills up), and
EIO is injected into the real `inferproxy serve` through `faulty_serve`'s switch. Under load from four
ranks, one fault after another (each at a moment drawn by progress from the seed):

- the checkpoints disk full: `POST /documents` gets 507, and where it says nothing of the request was
  written, `/resume` agrees (the jobs check it); the cache's commits fail too, and are retried;
- the output disk full: the documents go on being acknowledged, the chunks wait, and `/stats` says why
  (`publication_error`) until the publications, retried in the background, go through;
- EIO on checkpoint appends: 500, saying what failed; EIO on the output's fsync: as a full output;
- EIO on a checkpoint fsync: 500, and then the rank refuses everything until the proxy restarts (its
  files may have lost what the kernel could not write), which it is made to.

Each fault is lifted once the jobs have been refused for it; the run then ends with every invariant
checked (`Run.finish`): nothing acknowledged is lost, no file half-written.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.chaos.conftest import Chaos
from tests.chaos.harness import ProxyProcess, RankJob, Run, UpstreamProcess, chaos_run
from tests.chaos.invariants import Ledger
from tests.faults import fill_disk, small_disk

pytestmark = pytest.mark.chaos

RANKS = 4
RECORDS_PER_CHUNK = 5
FLUSH_INTERVAL_MS = 50
#: A commit refused by a full disk is retried after a backoff that doubles up to 5 s (`RequestCache`): an
#: answer stored while the disk was full is durable only once that retry has run.
SETTLE_S = 1.0 + 5.0


def refused(run: Run, status: int) -> int:
    return sum(job.refusals[status] for job in run.jobs)


async def until_publications_fail(run: Run, url: str, what: str) -> list[str]:
    """Wait until `/stats` says a rank's publications fail (the jobs' writes go on being acknowledged);
    returns the reasons it gives."""
    deadline = time.monotonic() + 120
    async with httpx.AsyncClient(timeout=10) as client:
        while True:
            ranks = (await client.get(url + "/stats")).json()["ranks"]
            if errors := [rank["publication_error"] for rank in ranks if rank["publication_error"]]:
                return errors
            assert not run.jobs_done(), f"the jobs ended before {what}"
            assert time.monotonic() < deadline, f"no failing publication for {what}"
            await asyncio.sleep(0.02)


async def test_a_full_or_failing_disk_gives_clear_errors_writes_nothing_half_and_recovers(
    tmp_path: Path, chaos: Chaos
) -> None:
    rng = chaos.rng("disk")
    documents = chaos.count(59, 239)
    with contextlib.ExitStack() as disks:
        # Room for a long run's caches and their WALs: the fault is the filler, which takes what is free.
        checkpoints = disks.enter_context(small_disk(tmp_path / "checkpoints-disk", "64m")) / "checkpoints"
        output = disks.enter_context(small_disk(tmp_path / "output-disk", "16m")) / "output"
        upstream = UpstreamProcess(tmp_path, latency_ms=5)
        upstream.start()
        disks.callback(upstream.close)
        await upstream.ready()
        proxy = ProxyProcess(
            tmp_path,
            [upstream.url],
            f"--records-per-chunk={RECORDS_PER_CHUNK}",
            checkpoints=checkpoints,
            output=output,
        )
        inputs = {rank: [f"r{rank}-doc-{i}" for i in range(documents)] for rank in range(RANKS)}
        ledger = Ledger(inputs, RECORDS_PER_CHUNK, replay_window_s=FLUSH_INTERVAL_MS / 1000 + SETTLE_S)
        jobs = [RankJob(proxy.url, ledger, rank, restarts=rank % 2 == 1) for rank in range(RANKS)]

        def full(disk: Path) -> tuple[Callable[[], None], Callable[[], None]]:
            filler = disk.parent / "filler"
            return lambda: fill_disk(disk.parent), lambda: filler.unlink()

        def failing(code: str, calls: str, where: Path) -> tuple[Callable[[], None], Callable[[], None]]:
            return lambda: proxy.fail_io(code, calls, where), proxy.heal_io

        faults = [
            ("the checkpoints disk full", 507, *full(checkpoints)),
            ("the output disk full", None, *full(output)),
            ("EIO on checkpoint appends", 500, *failing("EIO", "write", checkpoints)),
            ("EIO on the output's fsync", None, *failing("EIO", "fsync", output)),
            ("EIO on a checkpoint fsync", 500, *failing("EIO", "fsync", checkpoints)),
        ]
        total = RANKS * documents
        async with chaos_run(proxy, ledger, jobs) as run:
            for number, (name, status, start, heal) in enumerate(faults, start=1):
                point = rng.randint(total * number // 7, total * number // 7 + total // 14)
                await run.until(lambda point=point: ledger.acks() >= point, f"{point} acknowledged documents")
                if status is None:  # the output's: publications wait, retried in the background
                    start()
                    await until_publications_fail(run, proxy.url, name)
                    heal()
                    continue
                before = refused(run, status)
                start()
                await run.until(
                    lambda status=status, before=before: refused(run, status) > before, f"{status} for {name}"
                )
                heal()
                if name == "EIO on a checkpoint fsync":
                    await run.kill_and_restart()
            await run.finish()
