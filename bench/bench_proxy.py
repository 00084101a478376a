"""The proxy vs the upstream it stands in front of, measured in one run with wrk.

    python bench/bench_proxy.py [--duration 8] [--connections 64]

Starts `inferproxy fake-upstream` (the baseline) and `inferproxy serve` in front of
it as real processes on loopback ports, then with wrk (Debian package `wrk`):

- requests/s of the upstream alone (a fake generation), for answers of 16 and of 256 tokens;
- requests/s of the proxy on misses (a new X-Doc-Id per request: forwarded and stored);
- requests/s of the proxy on hits: the documents the miss run stored, asked for again
  in the same order, as a restarted job does (one point query each, no warm key);
- p50/p99 latency added on a miss, at concurrency 1 and 64, with the upstream taking 20 ms
  per answer: the proxy's latency minus the upstream's own, each measured directly;
- the upstream client alone: requests/s that app.http.client, aiohttp and httpx achieve
  against the upstream at 64 concurrent requests (why the pool uses app.http.client).

wrk and the servers share the machine's cores, as they would a GPU node's CPU. Every run,
the upstream's own included, uses the same wrk script (a Lua function building each request
with its own X-Doc-Id, which the upstream ignores), so the load generator does the same work
per request whichever server it measures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from app.demo import free_port


def body(max_tokens: int) -> str:
    return (
        '{"model":"fake-model","messages":[{"role":"user","content":"Tell me about caching."}],'
        f'"max_tokens":{max_tokens}}}'
    )


BODY = body(16)
ANSWER_SIZES = (16, 256)  # tokens per answer: a short one, and a typical synthetic-data one


def miss_script(payload: str, prefix: str = "bench") -> str:
    """A new document per request: <prefix>-1, <prefix>-2, ... (a run of its own prefix never hits)."""
    return f"""
wrk.method = "POST"
wrk.body = '{payload}'
counter = 0
request = function()
  counter = counter + 1
  return wrk.format(nil, nil, {{["Content-Type"] = "application/json", ["X-Doc-Id"] = "{prefix}-" .. counter}}, nil)
end
"""


def hit_script(payload: str, stored: int) -> str:
    """Replays the documents bench-1 .. bench-<stored> that the miss run stored, round and round."""
    return f"""
wrk.method = "POST"
wrk.body = '{payload}'
counter = 0
request = function()
  counter = counter % {stored} + 1
  return wrk.format(nil, nil, {{["Content-Type"] = "application/json", ["X-Doc-Id"] = "bench-" .. counter}}, nil)
end
"""


def proxy_stats(url: str) -> dict[str, int]:
    import json
    import urllib.request

    with urllib.request.urlopen(url.split("/v1/")[0] + "/stats", timeout=5) as answer:
        counts: dict[str, int] = json.load(answer)["requests"]
    return {"hit": 0, **counts}


def wait_until_up(url: str, timeout: float = 30.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(url)


@contextlib.contextmanager
def inferproxy(*args: str) -> Iterator[None]:
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", *args], stdout=subprocess.DEVNULL)
    try:
        yield
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def wrk(url: str, script: str, *, connections: int, duration: int) -> dict[str, float]:
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(script)
    try:
        out = subprocess.run(
            ["wrk", "-t1", f"-c{connections}", f"-d{duration}s", "--latency", "-s", f.name, url],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    finally:
        os.unlink(f.name)
    if "Non-2xx" in out:
        raise RuntimeError(f"wrk saw failed requests:\n{out}")
    result = {"rps": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))}  # type: ignore[union-attr]
    result["requests"] = float(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    for pct in ("50", "99"):
        value, unit = re.search(rf"^\s+{pct}%\s+([\d.]+)(us|ms|s)\s*$", out, re.MULTILINE).groups()  # type: ignore[union-attr]
        result[f"p{pct}_ms"] = float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]
    return result


async def client_rate(kind: str, url: str, seconds: float, concurrency: int = 64) -> float:
    done = 0
    deadline = time.monotonic() + seconds
    headers = {"content-type": "application/json"}
    if kind == "inferproxy":
        from app.http.client import HTTPClient

        client = HTTPClient()
        raw_headers = [(b"content-type", b"application/json")]
        body = BODY.encode()

        async def worker() -> None:
            nonlocal done
            while time.monotonic() < deadline:
                async with client.request("POST", url, headers=raw_headers, body=body) as response:
                    await response.read()
                done += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        await client.close()
    elif kind == "aiohttp":
        import aiohttp

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

            async def worker() -> None:
                nonlocal done
                while time.monotonic() < deadline:
                    async with session.post(url, data=BODY, headers=headers) as r:
                        await r.read()
                    done += 1

            await asyncio.gather(*(worker() for _ in range(concurrency)))
    else:
        import httpx

        limits = httpx.Limits(max_connections=concurrency)
        async with httpx.AsyncClient(limits=limits) as client:

            async def worker() -> None:
                nonlocal done
                while time.monotonic() < deadline:
                    (await client.post(url, content=BODY, headers=headers)).read()
                    done += 1

            await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=int, default=8, help="seconds per wrk run")
    parser.add_argument("--connections", type=int, default=64)
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is needed: apt-get install wrk")
    d, c = args.duration, args.connections
    data = Path(tempfile.mkdtemp(prefix="bench-proxy-"))
    ports = [free_port() for _ in range(2 + 2 * len(ANSWER_SIZES))]
    slow_up, slow_px = ports[0], ports[1]
    path = "/v1/chat/completions"
    results: dict[str, dict[str, float]] = {}
    servers = [
        ("fake-upstream", f"--port={slow_up}", "--latency-ms=20"),
        ("serve", f"--port={slow_px}", f"--upstream=http://127.0.0.1:{slow_up}", f"--checkpoints-dir={data}/slow"),
    ]
    for i, _ in enumerate(ANSWER_SIZES):
        up, px = ports[2 + 2 * i], ports[3 + 2 * i]
        servers.append(("fake-upstream", f"--port={up}"))
        servers.append(("serve", f"--port={px}", f"--upstream=http://127.0.0.1:{up}", f"--checkpoints-dir={data}/{i}"))
    try:
        with contextlib.ExitStack() as stack:
            for args_ in servers:
                stack.enter_context(inferproxy(*args_, *(["--log-level=warning"] if args_[0] == "serve" else [])))
            for port in ports:
                wait_until_up(f"http://127.0.0.1:{port}/v1/models")
            for i, tokens in enumerate(ANSWER_SIZES):
                payload = body(tokens)
                upstream = f"http://127.0.0.1:{ports[2 + 2 * i]}{path}"
                proxy = f"http://127.0.0.1:{ports[3 + 2 * i]}{path}"
                results[f"upstream_{tokens}"] = wrk(upstream, miss_script(payload), connections=c, duration=d)
                results[f"miss_{tokens}"] = wrk(proxy, miss_script(payload), connections=c, duration=d)
                time.sleep(0.5)  # past the group-commit window: every answer is in SQLite, not in memory
                stored = int(results[f"miss_{tokens}"]["requests"]) - c  # the last few may not have finished
                hits_before = proxy_stats(proxy)["hit"]
                results[f"hit_{tokens}"] = wrk(proxy, hit_script(payload, stored), connections=c, duration=d)
                served = proxy_stats(proxy)["hit"] - hits_before
                if served < results[f"hit_{tokens}"]["requests"]:  # every request of the run must be a HIT
                    raise RuntimeError(f"only {served} of {results[f'hit_{tokens}']['requests']:.0f} were hits")
            slow_upstream, slow_proxy = f"http://127.0.0.1:{slow_up}{path}", f"http://127.0.0.1:{slow_px}{path}"
            for conns in (1, 64):
                results[f"slow_upstream_{conns}"] = wrk(slow_upstream, miss_script(BODY), connections=conns, duration=d)
                results[f"slow_miss_{conns}"] = wrk(
                    slow_proxy, miss_script(BODY, f"slow{conns}"), connections=conns, duration=d
                )
            first_upstream = f"http://127.0.0.1:{ports[2]}{path}"
            rates = {
                kind: asyncio.run(client_rate(kind, first_upstream, d / 2))
                for kind in ("inferproxy", "aiohttp", "httpx")
            }
    finally:
        shutil.rmtree(data, ignore_errors=True)

    report(results, rates, connections=c, duration=d)


def report(results: dict[str, dict[str, float]], rates: dict[str, float], *, connections: int, duration: int) -> None:
    when = time.strftime("%Y-%m-%d")
    print(f"# bench_proxy: Python {platform.python_version()}, {os.cpu_count()} cores, {when}")
    print(f"wrk -t1 -c{connections} -d{duration}s; hits replay every document the miss run stored")
    print()
    print("| answer | upstream alone req/s | proxy hits req/s (ratio) | proxy misses req/s (ratio) |")
    print("| --- | ---: | ---: | ---: |")
    for tokens in ANSWER_SIZES:
        base = results[f"upstream_{tokens}"]["rps"]
        cells = []
        for name, target in (("hit", 1.0), ("miss", 0.35)):
            rps = results[f"{name}_{tokens}"]["rps"]
            verdict = "ok" if rps / base >= target else "below"
            cells.append(f"{rps:,.0f} ({rps / base:.2f}x, target {target}x: {verdict})")
        print(f"| {tokens} tokens | {base:,.0f} | {cells[0]} | {cells[1]} |")
    print()
    print("| miss latency, upstream at 20 ms | upstream p50 / p99 | proxy p50 / p99 | added p50 / p99 | target |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for conns in (1, 64):
        u, p = results[f"slow_upstream_{conns}"], results[f"slow_miss_{conns}"]
        added50, added99 = p["p50_ms"] - u["p50_ms"], p["p99_ms"] - u["p99_ms"]
        target = ("<= 1 ms p50 " + ("ok" if added50 <= 1.0 else "MISSED")) if conns == 1 else ""
        upstream_ms = f"{u['p50_ms']:.2f} / {u['p99_ms']:.2f} ms"
        proxy_ms = f"{p['p50_ms']:.2f} / {p['p99_ms']:.2f} ms"
        print(f"| concurrency {conns} | {upstream_ms} | {proxy_ms} | {added50:+.2f} / {added99:+.2f} ms | {target} |")
    print()
    print("| upstream client alone, 64 concurrent | requests/s | ratio to upstream |")
    print("| --- | ---: | ---: |")
    base = results[f"upstream_{ANSWER_SIZES[0]}"]["rps"]
    for kind, rate in rates.items():
        print(f"| {kind} | {rate:,.0f} | {rate / base:.2f}x |")


if __name__ == "__main__":
    main()
