"""The Batch API against the fake upstream: a batch's lines/s beside the upstream's own rate, the proxy's
CPU per line, and its memory on a large batch; measured in one run.

    .venv/bin/python bench/bench_batch.py [--lines 100000] [--concurrency 64] [--rounds 2] [--latency-ms 0]
                                          [--rss-lines 1000000]

`inferproxy fake-upstream` runs in its own process, answering after `--latency-ms` (0: as fast as it can, so
that the proxy's CPU is what bounds the batch; an LLM's answer takes seconds). Its own rate is what one
process of the proxy's own HTTP client (`app.http.client`, keep-alive, the fastest client here) gets from it
sending the same lines' bodies straight to it, `--concurrency` at a time. A batch's rate is the same lines
through a real `inferproxy serve` (`--max-inflight-per-upstream` = `--concurrency`): the file uploaded to
`/v1/files`, the batch created, polled until `completed`; timed from the create to `completed` (validation,
every line answered, fsynced, and the output file written). The two alternate (`--rounds`), so that neither
gets the machine's quieter minutes. CPU per line: the proxy process's user + system time over the batch,
divided by its lines. Then one batch of `--rss-lines` lines, the proxy's peak RSS (VmHWM) read at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ports import free_port  # noqa: E402

from app.http.client import HTTPClient  # noqa: E402

CHAT = "/v1/chat/completions"
TICKS = os.sysconf("SC_CLK_TCK")


def body(i: int) -> dict[str, object]:
    return {"model": "fake-model", "messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": 16}


def write_input(path: Path, lines: int, seed: str) -> None:
    with path.open("wb") as f:
        for i in range(lines):
            request = {"custom_id": f"{seed}-{i}", "method": "POST", "url": CHAT, "body": body(i)}
            f.write(orjson.dumps(request) + b"\n")


@contextlib.contextmanager
def started(*args: str, url: str, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "app.cli", *args], stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(url, timeout=2)
                break
            except httpx.HTTPError:
                assert proc.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, f"{args[0]} did not start"
                time.sleep(0.1)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


async def direct(upstream: str, lines: int, concurrency: int) -> float:
    """Lines/s of the same bodies sent straight to the upstream."""
    client = HTTPClient(connect_timeout=10, read_timeout=300)
    bodies = iter(range(lines))
    headers = [(b"content-type", b"application/json")]

    async def worker() -> None:
        for i in bodies:
            async with client.request("POST", upstream + CHAT, headers=headers, body=orjson.dumps(body(i))) as answer:
                await answer.read()
                assert answer.status == 200, answer.status

    started_at = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started_at
    await client.close()
    return lines / elapsed


def run_batch(proxy: str, pid: int, path: Path, lines: int) -> tuple[float, float]:
    """Lines/s of one batch through the proxy, and the proxy's CPU µs per line meanwhile."""
    with httpx.Client(base_url=proxy, timeout=600) as client, path.open("rb") as f:
        uploaded = client.post("/v1/files", files={"file": ("input.jsonl", f)}, data={"purpose": "batch"})
        uploaded.raise_for_status()
        cpu_before = cpu_seconds(pid)
        started_at = time.perf_counter()
        batch = client.post("/v1/batches", json={"input_file_id": uploaded.json()["id"], "endpoint": CHAT}).json()
        while batch["status"] not in ("completed", "failed", "expired", "cancelled"):
            time.sleep(0.2)
            batch = client.get(f"/v1/batches/{batch['id']}").json()
        elapsed = time.perf_counter() - started_at
        cpu = cpu_seconds(pid) - cpu_before
    assert batch["status"] == "completed", batch
    assert batch["request_counts"]["completed"] == lines, batch["request_counts"]
    return lines / elapsed, cpu / lines * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=100_000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--latency-ms", type=float, default=0.0, help="the fake upstream's time per answer")
    parser.add_argument("--rss-lines", type=int, default=1_000_000, help="0: no memory run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-batch-") as tmp:
        work = Path(tmp)
        up_port, proxy_port = free_port(), free_port()
        upstream, proxy = f"http://127.0.0.1:{up_port}", f"http://127.0.0.1:{proxy_port}"
        serve = [
            "serve",
            f"--port={proxy_port}",
            f"--upstream={upstream}",
            f"--checkpoints-dir={work / 'checkpoints'}",
            f"--output={work / 'output'}",
            f"--max-inflight-per-upstream={args.concurrency}",
            "--log-level=warning",
        ]
        fake = ("fake-upstream", f"--port={up_port}", f"--latency-ms={args.latency_ms:g}")
        with started(*fake, url=upstream + "/v1/models", log=work / "upstream.log"):
            own, through, cpu = [], [], []
            with started(*serve, url=proxy + "/healthz", log=work / "proxy.log") as proc:
                for round_ in range(args.rounds):
                    own.append(asyncio.run(direct(upstream, args.lines, args.concurrency)))
                    path = work / f"input-{round_}.jsonl"
                    write_input(path, args.lines, f"r{round_}")  # new ids and bodies: nothing from the cache
                    rate, per_line = run_batch(proxy, proc.pid, path, args.lines)
                    through.append(rate)
                    cpu.append(per_line)
                    print(
                        f"round {round_ + 1}: upstream's own {own[-1]:.0f} lines/s, batch {rate:.0f} lines/s "
                        f"({rate / own[-1]:.2f}x), proxy CPU {per_line:.0f} us/line",
                        flush=True,
                    )
            print(
                f"{args.lines} lines, {args.concurrency} at a time: upstream's own {statistics.median(own):.0f} "
                f"lines/s, batch {statistics.median(through):.0f} lines/s, ratio "
                f"{statistics.median(t / o for t, o in zip(through, own, strict=True)):.2f}x, proxy CPU "
                f"{statistics.median(cpu):.0f} us/line"
            )
            if args.rss_lines:
                with started(*serve, url=proxy + "/healthz", log=work / "proxy-rss.log") as proc:
                    path = work / "input-rss.jsonl"
                    write_input(path, args.rss_lines, "rss")
                    rate, per_line = run_batch(proxy, proc.pid, path, args.rss_lines)
                    print(
                        f"{args.rss_lines} lines: {rate:.0f} lines/s, proxy CPU {per_line:.0f} us/line, "
                        f"peak RSS {peak_rss_mib(proc.pid):.0f} MiB",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
