"""`inferproxy demo`: a batch job and its proxy killed with SIGKILL, restarted, output exactly once.

The parent starts `inferproxy fake-upstream` (or uses `--upstream`, a real
vLLM/SGLang server), `inferproxy serve` in front of it, and the job
(`inferproxy demo-job`) as real processes. It kills the job with SIGKILL
part-way, restarts it; kills the job *and* the proxy, restarts both; lets
the job finish; then checks the output and reports what happened: every
document published exactly once with all its rollouts, generations computed
by the upstream, generations replayed from the proxy's cache.

Each kill lands at a moment drawn in advance (`--seed` fixes them): a
number of documents done, far enough apart that every kill happens before
the job could finish. The job stops there, frozen with its other requests
in flight at the proxy, until the parent's SIGKILL.

The job is `app.job.run.run_job`: it asks the proxy where to resume, sends
each rollout as an OpenAI-compatible chat request through the proxy with
the document's headers, and sends each finished document to the
checkpoint service.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from app.checkpoints.documents import Document, DocumentLike
from app.http.client import HTTPClient
from app.http.server import restartable_port
from app.job.client import ProxyJob
from app.job.run import run_job

MARKER = ".inferproxy-demo"
PROXY_KILLS = {"never": "the proxy never", "alternate": "the proxy too, every second time", "always": "the proxy too"}


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
    upstream: str | None = None
    model: str = "fake-model"
    kill_proxy: str = "alternate"  # with the job: "never", "alternate" (every second kill) or "always"
    proxy: str | None = None  # the job's: the proxy it talks to
    pause_at: int | None = None  # the job's: documents done at which it waits to be killed


@dataclass
class RunReport:
    skipped: int = 0
    generated: int = 0
    replayed: int = 0
    written: int = 0
    killed: str = ""


@dataclass
class DemoReport:
    runs: list[RunReport] = field(default_factory=list)
    seconds: float = 0.0
    upstream_generations: int | None = None


# ---------------------------------------------------------------- the job


def say(*parts: object) -> None:
    sys.stdout.write(" ".join(str(p) for p in parts) + "\n")
    sys.stdout.flush()


def demo_documents(n: int) -> list[Document]:
    return [Document(text=f"Question {i}: what is {i} squared, and why?", id=f"q-{i:06d}") for i in range(n)]


async def run_demo_job(options: DemoOptions) -> None:
    """One run of the job; prints RESUME/HIT/MISS/COALESCED/ACK/PAUSED/DONE events for the parent."""
    assert options.proxy is not None
    proxy = options.proxy
    job = ProxyJob(proxy)
    state = await job.resume()
    await job.close()
    say("RESUME", state.docs_to_skip, len(state.processed_ids))
    done = state.docs_to_skip + len(state.processed_ids)
    pause_at = None if options.pause_at is None else max(options.pause_at, done + 1)
    http = HTTPClient(read_timeout=600.0)

    def written(doc_id: str) -> None:
        nonlocal done
        done += 1
        say("ACK", doc_id)
        if done == pause_at:
            say("PAUSED")
            # Frozen here, event loop and all, with the other documents' requests in flight at the proxy,
            # until the parent's SIGKILL: the kill lands before the job could finish.
            sys.stdin.read()
            os._exit(1)  # stdin closed: the demo is gone

    async def rollout(document: DocumentLike, rollout_idx: int, headers: dict[str, str]) -> dict[str, Any]:
        body = {
            "model": options.model,
            "messages": [{"role": "user", "content": document.text}],
            "max_tokens": 24,
            "temperature": 0.8,
        }
        raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
        async with http.request(
            "POST",
            proxy + "/v1/chat/completions",
            headers=[*raw, (b"content-type", b"application/json")],
            body=orjson.dumps(body),
        ) as answer:
            data = await answer.read()
        if answer.status != 200:
            raise RuntimeError(f"the proxy answered {answer.status}: {data[:200]!r}")
        say((answer.header(b"x-cache") or b"MISS").decode(), document.id, rollout_idx)
        choice = orjson.loads(data)["choices"][0]
        return {"text": choice["message"]["content"], "finish_reason": choice["finish_reason"]}

    try:
        await run_job(
            demo_documents(options.documents),
            rollout,
            base_url=proxy,
            rollouts_per_document=options.rollouts,
            concurrency=options.concurrency,
            records_per_chunk=options.records_per_chunk,
            on_written=written,
            progress=False,
        )
    finally:
        await http.close()
    say("DONE")


# ------------------------------------------------------------- the parent


def wait_until_up(url: str, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{proc.args!r} exited with {proc.returncode}; see its error above")
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"{url} did not answer within {timeout:g} s")


def inferproxy(*args: str, silent: bool = False) -> subprocess.Popen[bytes]:
    """`inferproxy ARGS` as a process; its errors still reach the terminal unless `silent`."""
    return subprocess.Popen(
        [sys.executable, "-m", "app.cli", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL if silent else None,
    )


def prepare_workdir(workdir: Path) -> None:
    """Start from a clean demo dir; refuse to clear a dir the demo did not create, or a file."""
    from app.checkpoints.output import FolderError, check_folder

    try:
        check_folder(str(workdir), "--workdir")
    except FolderError as exc:
        raise SystemExit(f"inferproxy demo: {exc}") from None
    if workdir.exists() and any(workdir.iterdir()) and not (workdir / MARKER).exists():
        raise SystemExit(
            f"inferproxy demo: {workdir} is not empty and was not created by `inferproxy demo`: pick another --workdir"
        )
    for name in ("checkpoints", "output"):
        shutil.rmtree(workdir / name, ignore_errors=True)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / MARKER).touch()


class Proxy:
    """`inferproxy serve` for the demo, restartable on the same port and folders."""

    def __init__(self, options: DemoOptions, upstream: str) -> None:
        self.port = restartable_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [
            "serve",
            f"--port={self.port}",
            f"--upstream={upstream}",
            f"--checkpoints-dir={options.workdir / 'checkpoints'}",
            f"--output={options.workdir / 'output'}",
            f"--records-per-chunk={options.records_per_chunk}",
            "--log-level=warning",
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = inferproxy(*self.args)
        wait_until_up(self.url + "/healthz", self.proc)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=60)


def job_command(options: DemoOptions, proxy_url: str, pause_at: int | None) -> list[str]:
    return [
        sys.executable,
        "-m",
        "app.cli",
        "demo-job",
        f"--proxy={proxy_url}",
        f"--model={options.model}",
        f"--documents={options.documents}",
        f"--rollouts={options.rollouts}",
        f"--records-per-chunk={options.records_per_chunk}",
        f"--concurrency={options.concurrency}",
        *([f"--pause-at={pause_at}"] if pause_at is not None else []),
    ]


def kill_moments(options: DemoOptions, rng: random.Random) -> list[int]:
    """Documents done at each kill: increasing, `concurrency` apart, the last before the final document.

    A killed job may leave up to `concurrency - 1` more documents done (in flight
    at the proxy when it stopped), so a next kill that far on still finds the
    restarted job short of it, and short of the end. Each kill is drawn from its
    own share of the documents, so that they spread over the job.
    """
    kills, spacing = options.kills, options.concurrency
    slack = options.documents - 2 - (kills - 1) * spacing
    if kills and slack < 0:
        raise SystemExit(
            f"inferproxy demo: {options.documents} documents are too few to kill the job {times(kills)} at "
            f"--concurrency {spacing} (a killed job may leave up to that many documents done with it): give at "
            f"least --documents {options.documents - slack}, or fewer --kills, or a lower --concurrency"
        )
    return [1 + int(slack * (i + rng.random()) / kills) + i * spacing for i in range(kills)]


def run_once(options: DemoOptions, proxy: Proxy, pause_at: int | None, kill_proxy: bool) -> RunReport:
    report = RunReport()
    job = subprocess.Popen(
        job_command(options, proxy.url, pause_at), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
    )
    assert job.stdout is not None
    assert job.stdin is not None
    done = False
    for line in job.stdout:
        event, *args = line.split()
        if event == "RESUME":
            report.skipped = int(args[0]) + int(args[1])
        elif event == "MISS":
            report.generated += 1
        elif event in ("HIT", "COALESCED"):
            report.replayed += 1
        elif event == "ACK":
            report.written += 1
        elif event == "PAUSED":
            job.send_signal(signal.SIGKILL)
            report.killed = "job"
            if kill_proxy:
                proxy.kill()
                report.killed = "job and proxy"
            break
        elif event == "DONE":
            done = True
    job.stdout.close()
    job.stdin.close()
    code = job.wait()
    if not report.killed and (code != 0 or not done):
        raise SystemExit(f"the demo job failed (exit code {code}); see its error above")
    return report


def verify_output(options: DemoOptions) -> tuple[int, int]:
    """Every document exactly once, each with all its rollouts; returns (documents, files)."""
    seen: dict[str, int] = {}
    files = sorted(p for p in (options.workdir / "output").glob("*.jsonl"))
    for path in files:
        # By b"\n" only: str.splitlines() also splits at U+2028 and U+0085, which JSON leaves unescaped.
        for line in path.read_bytes().split(b"\n"):
            if not line:
                continue
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


def check_upstream_answers(root: str) -> None:
    """Stop at once, in one line, on an upstream that does not answer (else the job fails deep inside)."""
    try:
        with urllib.request.urlopen(root + "/v1/models", timeout=10):
            pass
    except urllib.error.HTTPError:
        pass  # it answers (an API key may be needed for /v1/models): the job will tell more
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise SystemExit(
            f"inferproxy demo: the upstream {root} does not answer ({reason}): start it, "
            "fix --upstream, or leave --upstream out to use the built-in fake one"
        ) from None


@contextlib.contextmanager
def upstream_server(options: DemoOptions) -> Iterator[str]:
    if options.upstream:
        root = options.upstream.rstrip("/").removesuffix("/v1")
        check_upstream_answers(root)
        yield root
        return
    port = restartable_port()
    proc = inferproxy(
        "fake-upstream", f"--port={port}", f"--latency-ms={options.latency_ms}", f"--model={options.model}", silent=True
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_up(url + "/v1/models", proc)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def run_demo(options: DemoOptions, moments: list[int]) -> DemoReport:
    report = DemoReport()
    start = time.monotonic()
    with upstream_server(options) as upstream:
        proxy = Proxy(options, upstream)
        proxy.start()
        try:
            for run in range(options.kills + 1):
                pause_at = moments[run] if run < options.kills else None
                kill_proxy = options.kill_proxy == "always" or (options.kill_proxy == "alternate" and run % 2 == 1)
                result = run_once(options, proxy, pause_at, kill_proxy)
                report.runs.append(result)
                print(describe_run(run + 1, result), flush=True)
                if not result.killed:
                    break
                if proxy.proc is not None and proxy.proc.poll() is not None:
                    proxy.start()
        finally:
            proxy.stop()
        if not options.upstream:
            with urllib.request.urlopen(upstream + "/_fake/stats", timeout=5) as answer:
                report.upstream_generations = json.loads(answer.read())["generations"]
    report.seconds = time.monotonic() - start
    return report


def describe_run(number: int, run: RunReport) -> str:
    start = "started fresh" if number == 1 else f"resumed, skipping {run.skipped} documents already done"
    end = f"killed ({run.killed}) with SIGKILL" if run.killed else "finished"
    return (
        f"  run {number}: {start}; the job got {run.generated} fresh answers and {run.replayed} from the "
        f"cache, {run.written} documents acknowledged; {end}"
    )


def banner(options: DemoOptions) -> str:
    """The first line: what the demo is about to do."""
    where = options.upstream or "the built-in fake upstream"
    kills = (
        f"the job is killed {times(options.kills)} with SIGKILL ({PROXY_KILLS[options.kill_proxy]}) and restarted"
        if options.kills
        else "the job runs once, never killed"
    )
    return (
        f"inferproxy demo: {options.documents} documents x {options.rollouts} rollouts through inferproxy serve "
        f"and {where}, chunks of {options.records_per_chunk}; {kills}"
    )


def times(n: int) -> str:
    """`once`, `2 times`: how often, as a person says it."""
    return "once" if n == 1 else f"{n} times"


def main(options: DemoOptions) -> int:
    moments = kill_moments(options, random.Random(options.seed))
    prepare_workdir(options.workdir)  # a refusal is the only line printed, as for the other bad inputs
    print(banner(options), flush=True)
    report = run_demo(options, moments)
    documents, files = verify_output(options)
    replayed = sum(run.replayed for run in report.runs)
    print(f"documents published:   {documents}, each exactly once with its {options.rollouts} rollouts (checked)")
    print(f"chunks published:      {files} output files")
    print(f"generations computed:  {describe_generations(options, report)}")
    print(f"generations replayed:  {replayed} answered from the proxy's cache instead of recomputed")
    print(f"time:                  {report.seconds:.1f} s")
    print(f"output:                {options.workdir / 'output'}")
    return 0


def describe_generations(options: DemoOptions, report: DemoReport) -> str:
    """What the upstream computed, as far as it can be known.

    The built-in fake upstream counts its generations. Another upstream does
    not say: the job's fresh answers undercount them (what was in flight at a
    kill is computed all the same, and comes back later from the cache), so
    only a lower bound is known: each needed generation was computed once,
    and each fresh answer the job got was one.
    """
    needed = options.documents * options.rollouts
    generated = report.upstream_generations
    if generated is not None:
        return f"{generated} by the upstream for {needed} needed ({generated - needed} lost at kills)"
    seen = sum(run.generated for run in report.runs)
    return (
        f"at least {max(needed, seen)} by the upstream for {needed} needed (it does not count them for the demo, "
        f"so what the kills cost is not known)"
    )


def job_main(options: DemoOptions) -> int:
    asyncio.run(run_demo_job(options))
    return 0
