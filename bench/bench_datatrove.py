"""A datatrove pipeline with its own runner straight to the upstream, against the same pipeline
through `ProxyInferenceRunner` and `inferproxy serve`, in one run.

    .venv/bin/python bench/bench_datatrove.py [--documents 3000] [--tasks 2] [--latency-ms 0]

The same `LocalPipelineExecutor(tasks, workers=tasks)` pipeline (JsonlReader -> runner ->
JsonlWriter, 2 rollouts a document, one generation each) is run:

- (a) with datatrove's `InferenceRunner`, `RequestCache` and `CheckpointManager`, `server_type=
  "endpoint"` pointed at the fake upstream (to localhost datatrove posts through its own socket
  code, a connection per request);
- (b) with `ProxyInferenceRunner` pointed at `inferproxy serve` in front of the same upstream.

Each variant is measured twice:

- **fresh**: empty checkpoints and output, every generation computed;
- **cached rerun**: the replay storm of a restarted job. A first pass computes every generation
  and caches it but checkpoints no document (the job "died" before any was written); the
  measured rerun then gets every answer from the cache and writes every document.

Reported per pass: documents/s (wall clock of the pipeline) and CPU seconds per 1,000 documents of
every process involved (the executor and its workers, the upstream, and the proxy for (b)). The
ratios (b)/(a) are what count: the machine is shared and noisy. Targets: fresh >= 1.0x, cached
rerun >= 3x (documents/s).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import MethodType
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ports import free_port  # noqa: E402

ROLLOUTS = 2
RECORDS_PER_CHUNK = 500


# ------------------------------------------------------------------ one pass, in its own process


async def rollout(document: Any, generate: Any) -> Any:
    result = await generate({"messages": [{"role": "user", "content": document.text}], "max_tokens": 16})
    return result.text


def run_pass(variant: str, endpoint: str, work: Path, tasks: int, prime: bool) -> None:
    """One pipeline run; with `prime`, nothing is checkpointed or written (generations are cached only)."""
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.inference.run_inference import InferenceConfig, InferenceRunner
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.writers import JsonlWriter

    config = InferenceConfig(
        server_type="endpoint",
        endpoint_url=endpoint,
        model_name_or_path="fake-model",
        rollouts_per_document=ROLLOUTS,
        metric_interval=3600,
    )
    writer = JsonlWriter(str(work / "output"), output_filename="${rank}_chunk_${chunk_index}.jsonl", compression=None)
    if variant == "datatrove":
        runner: Any = InferenceRunner(
            rollout,
            config,
            writer,
            checkpoints_local_dir=str(work / "checkpoints"),
            records_per_chunk=RECORDS_PER_CHUNK,
        )
        # Keep the cache file when a task ends, so that a rerun replays it (datatrove deletes it on success).
        runner.request_cache.close = MethodType(close_keeping_file, runner.request_cache)
    else:
        from app.integrations.datatrove import ProxyInferenceRunner

        runner = ProxyInferenceRunner(rollout, config, writer)
    if prime:
        # Set on the instances, which are pickled to the executor's workers with the pipeline.
        manager = runner.checkpoint_manager
        manager.write_document = MethodType(write_nothing, manager)
        manager.cleanup_last_chunk = MethodType(complete_nothing, manager)
        if hasattr(manager, "finish"):
            manager.finish = MethodType(finish_nothing, manager)
    LocalPipelineExecutor(
        pipeline=[JsonlReader(str(work / "input")), runner],
        tasks=tasks,
        workers=tasks,
        logging_dir=str(work / ("logs-prime" if prime else "logs")),
        skip_completed=False,
        # fork, not datatrove's default forkserver: a forkserver's workers are not our descendants once
        # it exits, and their CPU time would escape getrusage(RUSAGE_CHILDREN). The same for (a) and (b).
        start_method="fork",
    ).run()


async def close_keeping_file(self: Any, delete_file: bool = False) -> None:
    await type(self).close(self, delete_file=False)


async def write_nothing(self: Any, *args: Any, **kwargs: Any) -> None:
    return None


async def complete_nothing(self: Any, rank: int, chunk_index: int) -> None:
    return None


async def finish_nothing(self: Any, rank: int) -> None:
    return None


# ------------------------------------------------------------------ the driver


def cpu_seconds(pid: int) -> float:
    """utime + stime of a running process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def start(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "app.cli", *args], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


def wait_for(url: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code < 500:
                return
        except httpx.HTTPError:
            time.sleep(0.05)
    raise TimeoutError(url)


def measured_pass(
    variant: str, endpoint: str, work: Path, tasks: int, servers: list[subprocess.Popen[bytes]], *, prime: bool = False
) -> tuple[float, float, float]:
    """(wall seconds, inference seconds, CPU seconds of the pass and the servers) of one pipeline run in a
    child process. Inference seconds: the longest of the tasks' `inference_time`, datatrove's own
    measure of a runner's work (from the first document read to the last written, without the
    executor's start-up and the interpreter's imports)."""
    before = children_cpu() + sum(cpu_seconds(s.pid) for s in servers)
    start_time = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            __file__,
            "--pass",
            variant,
            "--endpoint",
            endpoint,
            "--work",
            str(work),
            "--tasks",
            str(tasks),
            *(["--prime"] if prime else []),
        ],
        check=True,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wall = time.perf_counter() - start_time
    cpu = children_cpu() + sum(cpu_seconds(s.pid) for s in servers) - before
    inference = max(
        step["stats"]["inference_time"]["total"]
        for path in (work / ("logs-prime" if prime else "logs") / "stats").glob("*.json")
        for step in json.loads(path.read_text())
        if "inference_time" in step.get("stats", {})
    )
    if os.environ.get("BENCH_VERBOSE"):
        print(f"  {variant} prime={prime}: wall {wall:.2f} s, inference {inference:.2f} s, CPU {cpu:.2f} s")
    return wall, inference, cpu


def check_output(work: Path, documents: int) -> None:
    ids: list[str] = []
    for path in (work / "output").glob("*.jsonl"):
        ids += [json.loads(line)["id"] for line in path.read_text().splitlines()]
    if sorted(ids) != sorted(f"doc-{i}" for i in range(documents)):
        raise SystemExit(f"{work}: the output has {len(ids)} lines ({len(set(ids))} ids), not {documents} documents")


def variant_runs(
    variant: str, upstream: str, upstream_proc: subprocess.Popen[bytes], base: Path, documents: int, tasks: int
) -> dict[str, tuple[float, float, float]]:
    results = {}
    for scenario in ("fresh", "cached rerun"):
        work = base / f"{variant}-{scenario.replace(' ', '-')}"
        shutil.copytree(base / "input", work / "input")
        servers = [upstream_proc]
        proxy = None
        endpoint = upstream
        if variant == "proxy":
            port = free_port()
            proxy = start(
                "serve",
                f"--port={port}",
                f"--upstream={upstream}",
                f"--checkpoints-dir={work / 'checkpoints'}",
                f"--output={work / 'output'}",
                f"--records-per-chunk={RECORDS_PER_CHUNK}",
                "--log-level=warning",
            )
            endpoint = f"http://127.0.0.1:{port}"
            wait_for(endpoint + "/healthz")
            servers.append(proxy)
        try:
            if scenario == "cached rerun":
                measured_pass(variant, endpoint, work, tasks, servers, prime=True)
                generated = httpx.get(upstream + "/_fake/stats").json()["generations"]
            results[scenario] = measured_pass(variant, endpoint, work, tasks, servers)
            if scenario == "cached rerun":
                again = httpx.get(upstream + "/_fake/stats").json()["generations"] - generated
                if again:
                    raise SystemExit(f"{variant}: the cached rerun generated {again} answers again")
            check_output(work, documents)
        finally:
            if proxy is not None:
                proxy.terminate()
                proxy.wait(timeout=30)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--documents", type=int, default=8000)
    parser.add_argument("--tasks", type=int, default=2)
    parser.add_argument("--latency-ms", type=float, default=0.0, help="the fake upstream's generation time")
    parser.add_argument("--pass", dest="one_pass", choices=["datatrove", "proxy"], help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--prime", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_pass:
        run_pass(args.one_pass, args.endpoint, args.work, args.tasks, args.prime)
        return

    base = Path(tempfile.mkdtemp(prefix="bench-datatrove-"))
    # One input file per task: datatrove's JsonlReader gives each task whole files.
    (base / "input").mkdir()
    for task in range(args.tasks):
        with open(base / "input" / f"part-{task}.jsonl", "w") as f:
            for i in range(task, args.documents, args.tasks):
                f.write(json.dumps({"id": f"doc-{i}", "text": f"Document {i}: " + "a few words of text " * 8}) + "\n")
    port = free_port()
    upstream_proc = start("fake-upstream", f"--port={port}", f"--latency-ms={args.latency_ms}")
    upstream = f"http://127.0.0.1:{port}"
    try:
        wait_for(upstream + "/v1/models")
        results = {
            "datatrove": variant_runs("datatrove", upstream, upstream_proc, base, args.documents, args.tasks),
            "proxy": variant_runs("proxy", upstream, upstream_proc, base, args.documents, args.tasks),
        }
    finally:
        upstream_proc.terminate()
        upstream_proc.wait(timeout=30)
        shutil.rmtree(base, ignore_errors=True)

    n = args.documents
    print(
        f"{n} documents x {ROLLOUTS} rollouts, LocalPipelineExecutor tasks={args.tasks} workers={args.tasks}, "
        f"fake upstream latency {args.latency_ms:g} ms"
    )
    print(
        "| pass | (a) datatrove docs/s | (b) proxy docs/s | ratio | (a) docs/s, inference | (b) docs/s, inference "
        "| ratio | (a) CPU s/1k docs | (b) CPU s/1k docs | target |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for scenario, target in (("fresh", 1.0), ("cached rerun", 3.0)):
        (wall_a, inf_a, cpu_a), (wall_b, inf_b, cpu_b) = results["datatrove"][scenario], results["proxy"][scenario]
        ratio, inf_ratio = wall_a / wall_b, inf_a / inf_b
        print(
            f"| {scenario} | {n / wall_a:,.0f} | {n / wall_b:,.0f} | {ratio:.2f}x | {n / inf_a:,.0f} | "
            f"{n / inf_b:,.0f} | {inf_ratio:.2f}x | {1000 * cpu_a / n:.2f} | {1000 * cpu_b / n:.2f} | "
            f">= {target:g}x (wall {'ok' if ratio >= target else 'missed'}, inference "
            f"{'ok' if inf_ratio >= target else 'missed'}) |"
        )


if __name__ == "__main__":
    main()
