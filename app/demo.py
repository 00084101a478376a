"""`inferproxy demo`: kill a batch job twice with SIGKILL, restart it, get exactly-once output.

The parent starts the job (`inferproxy demo-job`, a real process), kills it
with SIGKILL at random moments, restarts it, and finally checks and reports
what happened: documents published exactly once, generations computed,
generations replayed from the request cache instead of recomputed.

The job is datatrove's inference loop on `app.checkpointing`: documents
numbered into chunks, `parse_existing_checkpoints` to resume, several
rollouts per document looked up in the `RequestCache` before generating,
`write_document` once all rollouts are done. Generation is simulated
in-process (a short sleep and a random sample) until the proxy lands.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.checkpointing import CheckpointManager, Document, RequestCache
from app.output import ChunkOutputWriter

MARKER = ".inferproxy-demo"


@dataclass(frozen=True, slots=True)
class DemoOptions:
    workdir: Path = Path("inferproxy-data/demo")
    documents: int = 2000
    rollouts: int = 2
    records_per_chunk: int = 100
    kills: int = 2
    latency_ms: float = 30.0
    concurrency: int = 64
    seed: int | None = None


@dataclass
class RunReport:
    skipped: int = 0
    skipped_by_id: int = 0
    generated: int = 0
    replayed: int = 0
    written: int = 0
    killed: bool = False


@dataclass
class DemoReport:
    runs: list[RunReport] = field(default_factory=list)
    seconds: float = 0.0


# ---------------------------------------------------------------- the job


def say(*parts: object) -> None:
    sys.stdout.write(" ".join(str(p) for p in parts) + "\n")
    sys.stdout.flush()


def demo_documents(n: int) -> list[Document]:
    return [Document(text=f"Question {i}: what is {i} squared, and why?", id=f"q-{i:06d}") for i in range(n)]


async def run_job(options: DemoOptions) -> None:
    """The batch job itself; prints RESUME/GEN/HIT/ACK/DONE events for the parent."""
    checkpoints = str(options.workdir / "checkpoints")
    cache = RequestCache(checkpoints)
    await cache.initialize(0)
    cm = CheckpointManager(checkpoints, options.records_per_chunk, request_cache=cache)
    rng = random.Random()
    finished = False
    try:
        with ChunkOutputWriter(str(options.workdir / "output")) as writer:
            skip, processed = await cm.parse_existing_checkpoints(0, writer)
            say("RESUME", skip, len(processed))
            slots = asyncio.Semaphore(options.concurrency)

            async def generate(doc: Document, chunk_index: int, rollout_idx: int) -> dict[str, Any]:
                payload = {"model": "demo", "messages": [{"role": "user", "content": doc.text}], "temperature": 0.8}
                key = cache.prepare_payload(payload)
                result, _ = await cache.get_cached_response(doc.id, rollout_idx, payload_hash=key)
                if result is not None:
                    say("HIT", doc.id, rollout_idx)
                    return result
                await asyncio.sleep(options.latency_ms / 1000 * rng.uniform(0.1, 1.9))  # the GPU at work
                result = {"text": f"sample {rng.getrandbits(32):08x}", "finish_reason": "stop"}
                await cache.store_result(chunk_index, doc.id, rollout_idx, result, payload_hash=key)
                say("GEN", doc.id, rollout_idx)
                return result

            async def process(doc: Document, chunk_index: int) -> None:
                async with slots:
                    results = await asyncio.gather(*(generate(doc, chunk_index, r) for r in range(options.rollouts)))
                    doc.metadata["rollout_results"] = list(results)
                    await cm.write_document(doc, 0, chunk_index, writer)
                    await cache.mark_document_complete(doc.id)
                    say("ACK", doc.id)

            todo, last_chunk = cm.remaining(demo_documents(options.documents), skip, processed)
            await asyncio.gather(*(process(doc, chunk_index) for doc, chunk_index in todo))
            await cm.cleanup_last_chunk(0, last_chunk)
            finished = True
    finally:
        await cache.close(delete_file=finished)
        await cm.close()
    say("DONE")


# ------------------------------------------------------------- the parent


def prepare_workdir(workdir: Path) -> None:
    """Start from a clean demo dir; refuse to clear a dir the demo did not create."""
    if workdir.exists() and any(workdir.iterdir()) and not (workdir / MARKER).exists():
        raise SystemExit(f"{workdir} is not empty and was not created by `inferproxy demo`: pick another --workdir")
    for name in ("checkpoints", "output"):
        shutil.rmtree(workdir / name, ignore_errors=True)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / MARKER).touch()


def job_command(options: DemoOptions) -> list[str]:
    return [
        sys.executable,
        "-m",
        "app.cli",
        "demo-job",
        f"--workdir={options.workdir}",
        f"--documents={options.documents}",
        f"--rollouts={options.rollouts}",
        f"--records-per-chunk={options.records_per_chunk}",
        f"--latency-ms={options.latency_ms}",
        f"--concurrency={options.concurrency}",
    ]


def run_once(options: DemoOptions, kill_after_acks: int | None) -> RunReport:
    report = RunReport()
    proc = subprocess.Popen(job_command(options), stdout=subprocess.PIPE, text=True, bufsize=1)
    assert proc.stdout is not None
    done = False
    for line in proc.stdout:
        event, *args = line.split()
        if event == "RESUME":
            report.skipped, report.skipped_by_id = int(args[0]), int(args[1])
        elif event == "GEN":
            report.generated += 1
        elif event == "HIT":
            report.replayed += 1
        elif event == "ACK":
            report.written += 1
            if kill_after_acks is not None and report.written >= kill_after_acks:
                proc.send_signal(signal.SIGKILL)
                report.killed = True
                break
        elif event == "DONE":
            done = True
    proc.stdout.close()
    code = proc.wait()
    if not report.killed and (code != 0 or not done):
        raise SystemExit(f"the demo job failed (exit code {code}); see its error above")
    return report


def verify_output(options: DemoOptions) -> tuple[int, int]:
    """Every document exactly once, each with all its rollouts; returns (documents, files)."""
    seen: dict[str, int] = {}
    files = sorted((options.workdir / "output").glob("*.jsonl"))
    for path in files:
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if len(record["metadata"]["rollout_results"]) != options.rollouts:
                raise SystemExit(f"{path}: document {record['id']} lacks rollouts")
            seen[record["id"]] = seen.get(record["id"], 0) + 1
    expected = {doc.id for doc in demo_documents(options.documents)}
    repeated = sorted(doc_id for doc_id, count in seen.items() if count > 1)
    missing = sorted(expected - seen.keys())
    if repeated or missing:
        raise SystemExit(f"output check FAILED: {len(missing)} missing (e.g. {missing[:3]}), {len(repeated)} repeated")
    return len(seen), len(files)


def run_demo(options: DemoOptions) -> DemoReport:
    rng = random.Random(options.seed)
    prepare_workdir(options.workdir)
    report = DemoReport()
    start = time.monotonic()
    remaining = options.documents
    for run in range(options.kills + 1):
        kill_after = None
        if run < options.kills and remaining > 10:
            kill_after = rng.randint(max(1, remaining * 15 // 100), max(2, remaining * 50 // 100))
        result = run_once(options, kill_after)
        report.runs.append(result)
        print(describe_run(run + 1, result), flush=True)
        remaining -= result.written
        if not result.killed:
            break
    report.seconds = time.monotonic() - start
    return report


def describe_run(number: int, run: RunReport) -> str:
    start = (
        "started fresh"
        if number == 1
        else (
            f"resumed: skipped {run.skipped} documents in published chunks and {run.skipped_by_id} already checkpointed"
        )
    )
    end = "killed with SIGKILL" if run.killed else "finished"
    return (
        f"  run {number}: {start}; {run.generated} generations computed, {run.replayed} replayed from the "
        f"cache; {run.written} documents written; {end}"
    )


def main(options: DemoOptions) -> int:
    print(
        f"inferproxy demo: {options.documents} documents x {options.rollouts} rollouts, chunks of "
        f"{options.records_per_chunk}, the job killed {options.kills} times with SIGKILL and restarted",
        flush=True,
    )
    report = run_demo(options)
    documents, files = verify_output(options)
    needed = options.documents * options.rollouts
    generated = sum(run.generated for run in report.runs)
    replayed = sum(run.replayed for run in report.runs)
    print(f"documents published:   {documents}, each exactly once with its {options.rollouts} rollouts (checked)")
    print(f"chunks published:      {files} output files")
    print(f"generations computed:  {generated} for {needed} needed ({generated - needed} lost in flight at kills)")
    print(f"generations replayed:  {replayed} from the request cache instead of recomputed")
    print(f"time:                  {report.seconds:.1f} s")
    print(f"output:                {options.workdir / 'output'}")
    return 0


def job_main(options: DemoOptions) -> int:
    # Die on SIGTERM like a preempted worker would: no cleanup runs either way.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.makedirs(options.workdir, exist_ok=True)
    asyncio.run(run_job(options))
    return 0
