"""The Batch API under kills: one large batch through `inferproxy serve`, the proxy killed again and again
at random moments (half of them power cuts) and restarted each time on the same directories.

Some lines fail transiently at the fake upstream (503 twice, then answered: retried, they end in the
output file), some are refused (400: they go to the error file). The kill moments are drawn from the
seed by progress (`request_counts.completed`, a watcher asking `GET /v1/batches/{id}` all along) and a
few milliseconds more. A power cut (`ProxyProcess.cut_power`) also cuts each `results.jsonl` back to
what its last fsync made durable, which a SIGKILL alone never does. Then, once every line is done, the
batch is killed while it finalizes, at three moments injected in `faulty_serve` (an output file's bytes
in place but not its metadata; a file complete; the other file complete, the record not yet saved), one
life each, then a last one that ends it.

Checked: `request_counts.completed` (and `failed`) never go back, as the watcher saw them and as the
durable `results.jsonl` holds them just after each death; every `custom_id` once across the output and
the error files, the 400s in the error file; the batch `completed`; the upstream's generations at most the
lines plus what was in flight at the kills (sent, or answered and not yet on disk: twice
`max_inflight_per_upstream` per kill).
Short run: 5,000 lines and 6 random kills; `--chaos-long`: 20,000 lines and 20.

A second scenario cancels a batch between kills, and kills it again while it is `cancelling`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.store.batches import BatchDir
from tests.chaos.conftest import Chaos
from tests.chaos.harness import READY_S, ProxyProcess, UpstreamProcess
from tests.service.test_batches import CHAT, chat_line, put_file, read_file

pytestmark = pytest.mark.chaos

INFLIGHT = 16
#: a kill's cost: lines sent, or answered and not yet on disk (twice `max_inflight_per_upstream`, contract §12)
UNWRITTEN = 2 * INFLIGHT
#: The kills while the batch finalizes, in this order, one life each (see `faulty_serve`).
FINALIZING_FAULTS = ("batch_file_bytes@1", "batch_file@1", "batch_file@1")


@dataclass
class Watch:
    """What `GET /v1/batches/{id}` said, in order, across every life of the proxy."""

    seen: list[tuple[float, str, int, int]] = field(default_factory=list)

    @property
    def completed(self) -> int:
        return self.seen[-1][2] if self.seen else 0

    @property
    def status(self) -> str:
        return self.seen[-1][1] if self.seen else ""

    def went_back(self) -> list[str]:
        problems = []
        for (at0, _, completed0, failed0), (at1, status, completed1, failed1) in itertools.pairwise(self.seen):
            if completed1 < completed0 or failed1 < failed0:
                problems.append(
                    f"request_counts went back from completed={completed0} failed={failed0} "
                    f"to completed={completed1} failed={failed1} ({status}, {at1 - at0:.3f} s later)"
                )
        return problems


async def watch(url: str, batch_id: str, seen: Watch, stop: asyncio.Event) -> None:
    """Ask for the batch again and again (each once the last was answered), through kills and restarts."""
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        while not stop.is_set():
            with contextlib.suppress(httpx.HTTPError):
                answer = await client.get(f"/v1/batches/{batch_id}")
                if answer.status_code == 200:
                    batch = answer.json()
                    counts = batch["request_counts"]
                    seen.seen.append((time.monotonic(), batch["status"], counts["completed"], counts["failed"]))
            await asyncio.sleep(0.01)


def durable_counts(proxy: ProxyProcess, batch_id: str) -> tuple[int, int]:
    """(completed, failed) as the batch's `results.jsonl` holds them (each line's first result), read while
    no proxy runs."""
    done: dict[int, bool] = {}
    for result in BatchDir(proxy.checkpoints / "batches" / batch_id).results():
        done.setdefault(result.line, result.ok)
    ok = sum(done.values())
    return ok, len(done) - ok


async def until(condition: Any, what: str, proxy: ProxyProcess) -> None:
    deadline = time.monotonic() + READY_S * 2
    while not condition():
        assert proxy.running(), f"the proxy died before {what}:\n{proxy.log_tail()}"
        assert time.monotonic() < deadline, f"no {what} in {READY_S * 2} s:\n{proxy.log_tail()}"
        await asyncio.sleep(0.005)


async def test_a_batch_killed_at_random_moments_ends_with_every_line_once(tmp_path: Path, chaos: Chaos) -> None:
    lines = chaos.count(5_000, 20_000)
    kills = chaos.count(6, 20)
    rng = chaos.rng("batch-kills")
    transient = set(rng.sample(range(lines), lines // 50))
    refused = set(rng.sample(sorted(set(range(lines)) - transient), lines // 100))
    inputs = []
    for i in range(lines):
        fault = {"status": 503, "fail_times": 2} if i in transient else {"status": 400} if i in refused else None
        inputs.append(
            chat_line(f"line-{i}", f"question {i}", max_tokens=4, **({"fake_upstream": fault} if fault else {}))
        )
    checkpoints = tmp_path / "checkpoints"
    file_id = put_file(checkpoints, inputs)

    upstream = UpstreamProcess(tmp_path, latency_ms=2)
    upstream.start()
    proxy = ProxyProcess(tmp_path, [upstream.url], f"--max-inflight-per-upstream={INFLIGHT}", "--batch-retries=4")
    seen, stop = Watch(), asyncio.Event()
    problems: list[str] = []
    deaths: list[str] = []
    watcher: asyncio.Task[None] | None = None

    def died(how: str) -> None:
        """The proxy is dead: what it showed as completed must be durable (before anything restarts)."""
        deaths.append(how)
        durable = durable_counts(proxy, batch_id)
        shown = max((c for _, _, c, _ in seen.seen), default=0)
        if durable[0] < shown:
            problems.append(f"death {len(deaths)} ({how}): {durable[0]} completed lines durable, {shown} shown")

    try:
        await upstream.ready()
        proxy.start()
        await proxy.ready()
        async with httpx.AsyncClient(base_url=proxy.url, timeout=30) as client:
            created = await client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": CHAT})
        assert created.status_code == 200, created.text
        batch_id = created.json()["id"]
        watcher = asyncio.create_task(watch(proxy.url, batch_id, seen, stop))

        points = sorted(rng.sample(range(lines // 20, lines * 9 // 10), kills))
        for k, point in enumerate(points):
            await until(lambda point=point: seen.completed >= point, f"{point} completed lines", proxy)
            await asyncio.sleep(rng.uniform(0, 0.05))
            power_cut = rng.random() < 0.5
            proxy.cut_power() if power_cut else proxy.kill()
            died(f"{'power cut' if power_cut else 'SIGKILL'} at {seen.completed}+ completed lines")
            if k < len(points) - 1:
                proxy.start()
                await proxy.ready()

        # The life that finalizes dies of its fault, and the next one of the next fault: no `ready` (one may
        # die before it answers), and a power cut each time (whatever the files store left unsynced is lost).
        for fault in FINALIZING_FAULTS:
            proxy.start(fault)
            deadline = time.monotonic() + READY_S * 3
            while proxy.running():
                assert time.monotonic() < deadline, f"{fault} did not happen:\n{proxy.log_tail()}"
                await asyncio.sleep(0.01)
            assert proxy.died_of_fault() is not None, f"it died of something else than {fault}:\n{proxy.log_tail()}"
            proxy.lose_unsynced()
            died(f"{fault} while finalizing")
        proxy.start()
        await proxy.ready()
        await until(lambda: seen.status == "completed", "completed batch", proxy)
        stop.set()
        await watcher
        assert proxy.stop() == 0, f"SIGTERM did not exit 0:\n{proxy.log_tail()}"

        problems += seen.went_back()
        batch = BatchDir(checkpoints / "batches" / batch_id).load()
        assert batch.status == "completed", batch
        assert (batch.total, batch.completed, batch.failed) == (lines, lines - len(refused), len(refused))
        output = read_file(checkpoints, batch.output_file_id)
        errors = read_file(checkpoints, batch.error_file_id)
        ids = Counter(o["custom_id"] for o in [*output, *errors])
        twice = sorted(i for i, n in ids.items() if n > 1)
        missing = sorted({f"line-{i}" for i in range(lines)} - set(ids))
        assert not twice, f"{len(twice)} custom_ids in the output and error files twice: {twice[:5]}"
        assert not missing, f"{len(missing)} custom_ids in neither the output nor the error file: {missing[:5]}"
        assert {o["custom_id"] for o in errors} == {f"line-{i}" for i in refused}
        assert all(o["response"]["status_code"] == 400 for o in errors), errors[:3]
        assert all(o["response"]["status_code"] == 200 for o in output), [o for o in output if o["error"]][:3]
        generations = (await upstream.stats())["generations"]
        paid = lines - len(refused)  # a 400 is no generation; a 503 neither (the fake upstream fails it first)
        # nothing is in flight while the batch finalizes: only the random kills pay twice
        assert paid <= generations <= paid + kills * UNWRITTEN, f"{generations} generations for {paid} lines"
        assert not problems, "\n".join(problems)
        print(f"{lines} lines, {len(deaths)} deaths, {generations - paid} generations paid twice")
    finally:
        stop.set()
        if watcher is not None:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
        proxy.close()
        upstream.close()


async def test_a_batch_cancelled_between_kills_sends_nothing_more_and_keeps_every_finished_line(
    tmp_path: Path, chaos: Chaos
) -> None:
    """Killed at random moments, then cancelled, and killed again while `cancelling` (a power cut or not,
    drawn from the seed): it ends `cancelled`, its output holds every line completed (each once), and
    nothing is sent upstream past what was in flight at the cancel and at the kills."""
    lines = chaos.count(2_000, 10_000)
    kills = chaos.count(2, 8)
    rng = chaos.rng("batch-cancel")
    checkpoints = tmp_path / "checkpoints"
    file_id = put_file(checkpoints, [chat_line(f"line-{i}", f"question {i}", max_tokens=4) for i in range(lines)])
    upstream = UpstreamProcess(tmp_path, latency_ms=50)
    upstream.start()
    proxy = ProxyProcess(tmp_path, [upstream.url], f"--max-inflight-per-upstream={INFLIGHT}")
    seen, stop = Watch(), asyncio.Event()
    watcher: asyncio.Task[None] | None = None
    try:
        await upstream.ready()
        proxy.start()
        await proxy.ready()
        async with httpx.AsyncClient(base_url=proxy.url, timeout=30) as client:
            created = await client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": CHAT})
        assert created.status_code == 200, created.text
        batch_id = created.json()["id"]
        watcher = asyncio.create_task(watch(proxy.url, batch_id, seen, stop))
        for point in sorted(rng.sample(range(lines // 20, lines // 3), kills)):
            await until(lambda point=point: seen.completed >= point, f"{point} completed lines", proxy)
            await asyncio.sleep(rng.uniform(0, 0.05))
            proxy.cut_power() if rng.random() < 0.5 else proxy.kill()
            proxy.start()
            await proxy.ready()
        await until(lambda: seen.completed >= lines * 2 // 5, f"{lines * 2 // 5} completed lines", proxy)
        async with httpx.AsyncClient(base_url=proxy.url, timeout=30) as client:
            cancelled = (await client.post(f"/v1/batches/{batch_id}/cancel")).json()
        assert cancelled["status"] == "cancelling", cancelled
        at_cancel = cancelled["request_counts"]["completed"]
        await asyncio.sleep(rng.uniform(0, 0.04))  # lines in flight take the upstream's 50 ms
        proxy.cut_power() if rng.random() < 0.5 else proxy.kill()
        was = BatchDir(checkpoints / "batches" / batch_id).load().status  # as the kill left it on disk
        proxy.start()
        await proxy.ready()
        await until(lambda: seen.status == "cancelled", "cancelled batch", proxy)
        generations = (await upstream.stats())["generations"]
        await asyncio.sleep(0.5)  # nothing more, once cancelled
        assert (await upstream.stats())["generations"] == generations
        stop.set()
        await watcher
        assert proxy.stop() == 0, f"SIGTERM did not exit 0:\n{proxy.log_tail()}"

        problems = seen.went_back()
        assert not problems, "\n".join(problems)
        batch = BatchDir(checkpoints / "batches" / batch_id).load()
        assert batch.status == "cancelled", batch
        output = read_file(checkpoints, batch.output_file_id)
        ids = Counter(o["custom_id"] for o in output)
        assert not [i for i, n in ids.items() if n > 1], "a line twice in the output"
        assert len(output) == batch.completed, (len(output), batch.completed)
        # what was in flight at the cancel may finish; nothing was started after it
        assert at_cancel <= batch.completed <= at_cancel + UNWRITTEN, (at_cancel, batch.completed, was)
        assert batch.failed == 0
        assert batch.completed <= generations <= batch.completed + (kills + 1) * UNWRITTEN, generations
        print(f"cancelled at {at_cancel} completed, killed while {was}: {batch.completed} kept, {generations} paid")
    finally:
        stop.set()
        if watcher is not None:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
        proxy.close()
        upstream.close()
