"""The proxy vs the upstream it stands in front of, and vs nginx, measured in one run with wrk.

    python bench/bench_proxy.py [--duration 8] [--connections 64]

Starts `inferproxy fake-upstream` (the baseline) and `inferproxy serve` in front of
it as real processes on loopback ports, then with wrk (Debian package `wrk`):

- requests/s of the upstream alone (a fake generation), for answers of 16 and of 256 tokens;
- requests/s of the proxy on misses (a new X-Doc-Id per request: forwarded and stored);
- requests/s of the proxy on hits: the documents the miss run stored, asked for again
  in the same order, as a restarted job does (one point query each, no warm key);
- CPU µs per request of the measured server for each of those runs: utime + stime of its
  process (its threads and children included) from /proc/<pid>/stat just before and after
  the wrk run, divided by the requests wrk completed; for the proxy per hit and per miss,
  and the upstream's own per generated answer;
- nginx as a caching reverse proxy for POST in front of the same upstream, the off-the-shelf
  anchor (Debian package `nginx`: `apt-get install -y nginx`; its rows are skipped with the
  reason printed when it is absent): the same miss and hit runs, its req/s and CPU µs per
  request (master and worker processes), and the proxy's CPU µs over nginx's;
- p50/p99 latency added on a miss, at concurrency 1 and 64, with the upstream taking 20 ms
  per answer: the proxy's latency minus the upstream's own, each measured directly;
- the route table: `/v1/chat/completions` as the raw ASGI route it is vs as a FastAPI route
  (bench/fastapi_v1.py), two proxies in front of one upstream, their miss runs alternated three
  times: the CPU µs per miss FastAPI's per-request machinery adds (issue 19's threshold: 15 µs);
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
import json
import os
import platform
import pwd
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path

from ports import free_port


def body(max_tokens: int) -> str:
    return (
        '{"model":"fake-model","messages":[{"role":"user","content":"Tell me about caching."}],'
        f'"max_tokens":{max_tokens}}}'
    )


BODY = body(16)
ANSWER_SIZES = (16, 256)  # tokens per answer: a short one, and a typical synthetic-data one
SETTLE = 0.5  # s after a wrk run before the CPU is read: past the proxy's group-commit window
NGINX_INSTALL = "apt-get install -y nginx"


def miss_script(payload: str, prefix: str = "bench") -> str:
    """A new document per request: <prefix>-2, <prefix>-3, ... (a run of its own prefix never hits).

    <prefix>-1 is never sent: see hit_script.
    """
    return f"""
wrk.method = "POST"
wrk.body = '{payload}'
counter = 0
request = function()
  counter = counter + 1
  return wrk.format(nil, nil, {{["Content-Type"] = "application/json", ["X-Doc-Id"] = "{prefix}-" .. counter}}, nil)
end
"""


def stored_by(miss_run: Mapping[str, float], connections: int) -> int:
    """How many documents, from bench-2 on, the miss run surely had answered, hence stored.

    wrk calls `request()` once before it opens any connection, in the same Lua state, to
    check the script, and never sends that request: the counter's first value (bench-1) is
    lost, and the documents sent are bench-2, bench-3, ... in the order they were issued
    (replaying bench-1 was the "only 316116 of 316117 were hits" flake). wrk keeps one request
    in flight per connection (no pipelining), so when it stops at most `connections` requests
    are unanswered, each the last one issued on its connection, i.e. among the last
    `connections` issued when no connection stalled (a stall would be a wrk timeout, which
    `wrk()` rejects). `requests` answered plus those make the issued ones, so bench-2 ..
    bench-(requests - connections + 1) were all answered. The hit run then checks that every
    request it made was a hit.
    """
    stored = int(miss_run["requests"]) - connections
    if stored <= 0:
        raise RuntimeError(f"the miss run stored too few documents to replay: {miss_run['requests']:.0f}")
    return stored


def hit_script(payload: str, stored: int) -> str:
    """Replays the documents bench-2 .. bench-<stored + 1> that the miss run stored, round and round."""
    return f"""
wrk.method = "POST"
wrk.body = '{payload}'
counter = 0
request = function()
  counter = counter % {stored} + 1
  return wrk.format(nil, nil, {{["Content-Type"] = "application/json", ["X-Doc-Id"] = "bench-" .. (counter + 1)}}, nil)
end
"""


def get_json(url: str) -> dict[str, object]:
    with urllib.request.urlopen(url, timeout=5) as answer:
        result: dict[str, object] = json.load(answer)
    return result


def serve(
    stack: contextlib.ExitStack,
    upstream_port: int,
    checkpoints: Path,
    *flags: str,
    log: Path | None = None,
    entry: list[str] | None = None,
    checkout: Path | None = None,
) -> tuple[str, int]:
    """`inferproxy serve` in front of the upstream on `upstream_port`, up, stopped with `stack`: the URL of
    its `/v1/chat/completions` and its pid (`inferproxy` has `log`, `entry` and `checkout`)."""
    port = free_port()
    command = (
        "serve",
        f"--port={port}",
        f"--upstream=http://127.0.0.1:{upstream_port}",
        f"--checkpoints-dir={checkpoints}",
    )
    pid = stack.enter_context(inferproxy(*command, *flags, log=log, entry=entry, checkout=checkout))
    wait_until_up(f"http://127.0.0.1:{port}/v1/models")
    return f"http://127.0.0.1:{port}/v1/chat/completions", pid


def measure_metrics_cost(
    results: dict[str, dict[str, float]],
    upstream_port: int,
    up_pid: int,
    data: Path,
    *,
    connections: int,
    duration: int,
) -> None:
    """The hit path's CPU with the counters on and off (`--no-metrics`): two proxies in front of one
    upstream, at the default log level (hits logged 1 in 100), their hit runs alternated three times."""
    payload, path = body(ANSWER_SIZES[0]), "/v1/chat/completions"
    upstream = f"http://127.0.0.1:{upstream_port}{path}"
    with contextlib.ExitStack() as stack:
        urls: dict[str, tuple[str, int]] = {}
        for name, flags in (("on", []), ("off", ["--no-metrics"])):
            log = data / f"metrics-{name}.log"  # a request line per miss, as a user's log file gets
            urls[name] = serve(stack, upstream_port, data / f"metrics-{name}", *flags, log=log)
        run = {"connections": connections, "duration": duration}
        stored = {}
        for name, (url, pid) in urls.items():
            miss = wrk(url, miss_script(payload), **run, cpu_of={"server": pid, "upstream": up_pid})
            results[f"metrics_{name}_miss"] = miss
            stored[name] = stored_by(miss, connections)
        for round_ in range(3):
            for name, (url, pid) in urls.items():
                generated = upstream_requests(upstream)
                hit = wrk(url, hit_script(payload, stored[name]), **run, cpu_of={"server": pid})
                if (forwarded := upstream_requests(upstream) - generated) != 0:
                    raise RuntimeError(f"metrics {name}: {forwarded} hit-run requests went upstream")
                results[f"metrics_{name}_hit_{round_}"] = hit


ROUTE_KINDS = {"raw": ["-m", "app.cli"], "fastapi": [str(Path(__file__).with_name("fastapi_v1.py"))]}


def measure_routes_cost(
    results: dict[str, dict[str, float]],
    upstream_port: int,
    up_pid: int,
    data: Path,
    *,
    connections: int,
    duration: int,
) -> None:
    """Misses on `/v1/chat/completions` as a raw ASGI route and as a FastAPI route: two proxies in front of
    one upstream, their miss runs alternated three times (each a new set of documents)."""
    payload = body(ANSWER_SIZES[0])
    with contextlib.ExitStack() as stack:
        urls: dict[str, tuple[str, int]] = {}
        for name, entry in ROUTE_KINDS.items():
            urls[name] = serve(stack, upstream_port, data / f"routes-{name}", "--log-level=warning", entry=entry)
        run = {"connections": connections, "duration": duration}
        for round_ in range(3):
            for name, (url, pid) in urls.items():
                script = miss_script(payload, f"routes{round_}")
                results[f"routes_{name}_{round_}"] = wrk(url, script, **run, cpu_of={"server": pid, "upstream": up_pid})


def proxy_stats(url: str) -> dict[str, int]:
    counts: dict[str, int] = get_json(url.split("/v1/")[0] + "/stats")["requests"]  # type: ignore[assignment]
    return {"hit": 0, **counts}


def upstream_requests(url: str) -> int:
    """Requests the fake upstream has answered, from its /_fake/stats."""
    return int(get_json(url.split("/v1/")[0] + "/_fake/stats")["requests"])  # type: ignore[call-overload]


def wait_until_up(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(url)


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, float]:
    """(ppid, CPU seconds) of one process: utime + stime of all its threads, plus cutime + cstime
    of its children already waited for, from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        data = f.read()
    fields = data[data.rindex(b")") + 2 :].split()  # after "pid (comm) ": the name may hold spaces
    # fields[0] is stat's field 3 (state): ppid is field 4, utime 14, stime 15, cutime 16, cstime 17
    return int(fields[1]), sum(int(x) for x in fields[11:15]) / CLOCK_TICKS


def cpu_seconds(pid: int) -> float:
    """CPU time of `pid` and of every process descending from it, living or waited for.

    A child that exits and is waited for during a measurement moves its time from its own
    entry into its parent's cutime/cstime, so before/after differences stay right.
    """
    stats: dict[int, tuple[int, float]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError):
                stats[int(entry)] = _stat(int(entry))
    children: dict[int, list[int]] = {}
    for child, (parent, _) in stats.items():
        children.setdefault(parent, []).append(child)
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += stats[p][1] if p in stats else 0.0
        todo.extend(children.get(p, ()))
    return total


@contextlib.contextmanager
def inferproxy(
    *args: str, log: Path | None = None, entry: list[str] | None = None, checkout: Path | None = None
) -> Iterator[int]:
    """A server process (`entry`: the command after the interpreter, `-m app.cli` by default; `checkout`:
    another checkout of the repo whose `app` it runs); its log (stderr) goes to `log` if given."""
    stderr = open(log, "wb") if log is not None else None  # noqa: SIM115 (closed below, with the process)
    command = [sys.executable, *(entry or ["-m", "app.cli"]), *args]
    env = None if checkout is None else {**os.environ, "PYTHONPATH": str(checkout)}
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, cwd=checkout, env=env)
    try:
        yield proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        if stderr is not None:
            stderr.close()


def wrk(url: str, script: str, *, connections: int, duration: int, cpu_of: Mapping[str, int]) -> dict[str, float]:
    """One wrk run: req/s, requests done, p50/p99 ms, and `cpu_us_<name>`, the CPU µs per request
    of each process of `cpu_of` (name -> pid, descendants included) over the run and SETTLE
    seconds after it (work a server defers, such as the proxy's group commits, is counted)."""
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(script)
    try:
        before = {name: cpu_seconds(pid) for name, pid in cpu_of.items()}
        out = subprocess.run(
            ["wrk", "-t1", f"-c{connections}", f"-d{duration}s", "--latency", "-s", f.name, url],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        time.sleep(SETTLE)
        after = {name: cpu_seconds(pid) for name, pid in cpu_of.items()}
    finally:
        os.unlink(f.name)
    if "Non-2xx" in out:
        raise RuntimeError(f"wrk saw failed requests:\n{out}")
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    if errors and any(int(n) for n in errors.groups()):
        raise RuntimeError(f"wrk saw socket errors:\n{out}")
    result = {"rps": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))}  # type: ignore[union-attr]
    result["requests"] = float(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    for pct in ("50", "99"):
        value, unit = re.search(rf"^\s+{pct}%\s+([\d.]+)(us|ms|s)\s*$", out, re.MULTILINE).groups()  # type: ignore[union-attr]
        result[f"p{pct}_ms"] = float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]
    for name in cpu_of:
        result[f"cpu_us_{name}"] = (after[name] - before[name]) * 1e6 / result["requests"]
    return result


NGINX_CONF = """\
daemon off;
master_process on;
worker_processes 1;
{user}
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;

events {{
    worker_connections 1024;
}}

http {{
    access_log off;
    sendfile off;                   # nginx's default; Debian's "on" costs ~4 µs more per small cached hit
    keepalive_timeout 75s;
    keepalive_requests 1000000;     # wrk's connections stay open, as with the proxy
    client_body_buffer_size 64k;    # the whole body in memory, so that $request_body is set
    client_max_body_size 64k;
    client_body_temp_path {tmp}/client_body;
    proxy_temp_path {tmp}/proxy_temp;
    fastcgi_temp_path {tmp}/fastcgi_temp;
    uwsgi_temp_path {tmp}/uwsgi_temp;
    scgi_temp_path {tmp}/scgi_temp;
    proxy_cache_path {tmp}/cache levels=1:2 keys_zone=bench:128m inactive=1h use_temp_path=off;

    upstream fake_upstream {{
        server 127.0.0.1:{upstream_port};
        keepalive 64;
        keepalive_requests 1000000;
    }}

    server {{
        listen 127.0.0.1:{port};

        location = /_nginx/up {{
            return 200 "up\\n";
        }}

        location / {{
            proxy_pass http://fake_upstream;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_cache bench;
            proxy_cache_methods POST;
            proxy_cache_key "$request_uri|$http_x_doc_id|$request_body";
            proxy_cache_valid 200 1h;
            add_header X-Cache-Status $upstream_cache_status;
        }}
    }}
}}
"""


def nginx_version() -> str:
    out = subprocess.run(["nginx", "-v"], capture_output=True, text=True).stderr
    return out.strip().split("/")[-1]


@contextlib.contextmanager
def nginx(port: int, upstream_port: int, under: str) -> Iterator[int]:
    """nginx caching POSTs in front of the upstream, its config, logs and cache in a new directory
    in `under`: (its pid)."""
    tmp = Path(tempfile.mkdtemp(prefix="bench-nginx-", dir=under))
    # As root, nginx's worker would switch to the compiled-in user, who cannot enter this directory.
    user = f"user {pwd.getpwuid(os.geteuid()).pw_name};" if os.geteuid() == 0 else ""
    (tmp / "nginx.conf").write_text(NGINX_CONF.format(user=user, tmp=tmp, port=port, upstream_port=upstream_port))
    command = ["nginx", "-p", str(tmp), "-c", "nginx.conf", "-e", str(tmp / "error.log")]
    with open(tmp / "stderr.log", "wb") as stderr:
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        try:
            wait_until_up(f"http://127.0.0.1:{port}/_nginx/up", timeout=10)
        except TimeoutError:
            proc.kill()
            proc.wait()
            logs = (tmp / "stderr.log", tmp / "error.log")
            said = "".join(log.read_text(errors="replace") for log in logs if log.exists())
            raise RuntimeError(f"nginx did not start: {said}") from None
        yield proc.pid
    finally:
        if proc.poll() is None:
            proc.terminate()  # SIGTERM: fast shutdown of the master and its workers
            proc.wait(timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)


def cache_status(url: str, doc: str, payload: str) -> str:
    request = urllib.request.Request(
        url, data=payload.encode(), headers={"Content-Type": "application/json", "X-Doc-Id": doc}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=5) as answer:
        answer.read()
        return str(answer.headers.get("X-Cache-Status") or answer.headers.get("X-Cache"))


def measure_nginx(
    results: dict[str, dict[str, float]],
    tokens: int,
    upstream: str,
    up_pid: int,
    *,
    connections: int,
    duration: int,
    under: str,
) -> None:
    """nginx's miss and hit runs in front of `upstream`, with the proxy's scripts; checks its hits were hits."""
    payload, path = body(tokens), "/v1/chat/completions"
    port = free_port()
    with nginx(port, int(upstream.split(":")[-1].split("/")[0]), under) as pid:
        url = f"http://127.0.0.1:{port}{path}"
        cpu_of = {"server": pid, "upstream": up_pid}
        miss = wrk(url, miss_script(payload), connections=connections, duration=duration, cpu_of=cpu_of)
        stored = stored_by(miss, connections)
        generated = upstream_requests(upstream)
        hit = wrk(url, hit_script(payload, stored), connections=connections, duration=duration, cpu_of=cpu_of)
        if (forwarded := upstream_requests(upstream) - generated) != 0:
            raise RuntimeError(f"nginx forwarded {forwarded} of {hit['requests']:.0f} hit-run requests upstream")
        for doc in ("bench-2", f"bench-{stored + 1}"):  # the first and the last document replayed
            if (status := cache_status(url, doc, payload)) != "HIT":
                raise RuntimeError(f"nginx answered {doc} with X-Cache-Status {status}, not HIT")
        results[f"nginx_miss_{tokens}"], results[f"nginx_hit_{tokens}"] = miss, hit


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
    parser.add_argument("--routes-only", action="store_true", help="only the route table's rows (raw vs FastAPI)")
    parser.add_argument(
        "--nginx-dir",
        default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir(),
        help="where nginx's temporary directory (config, logs, its cache: a file per answer) is made;"
        " tmpfs by default, nginx at its fastest",
    )
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is needed: apt-get install wrk")
    nginx_missing = None if shutil.which("nginx") else f"nginx is not installed (to measure it: {NGINX_INSTALL})"
    if nginx_missing:
        print(f"bench_proxy: skipping the nginx rows: {nginx_missing}", file=sys.stderr)
    d, c = args.duration, args.connections
    data = Path(tempfile.mkdtemp(prefix="bench-proxy-"))
    if args.routes_only:
        results_only: dict[str, dict[str, float]] = {}
        try:
            port = free_port()
            with inferproxy("fake-upstream", f"--port={port}") as up_pid:
                wait_until_up(f"http://127.0.0.1:{port}/v1/models")
                measure_routes_cost(results_only, port, up_pid, data, connections=c, duration=d)
        finally:
            shutil.rmtree(data, ignore_errors=True)
        report_routes(results_only)
        return
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
            pids = [
                stack.enter_context(inferproxy(*args_, *(["--log-level=warning"] if args_[0] == "serve" else [])))
                for args_ in servers
            ]
            for port in ports:
                wait_until_up(f"http://127.0.0.1:{port}/v1/models")
            for i, tokens in enumerate(ANSWER_SIZES):
                payload = body(tokens)
                upstream = f"http://127.0.0.1:{ports[2 + 2 * i]}{path}"
                proxy = f"http://127.0.0.1:{ports[3 + 2 * i]}{path}"
                up_pid, px_pid = pids[2 + 2 * i], pids[3 + 2 * i]
                run = {"connections": c, "duration": d}
                results[f"upstream_{tokens}"] = wrk(upstream, miss_script(payload), **run, cpu_of={"server": up_pid})
                cpu_of = {"server": px_pid, "upstream": up_pid}
                results[f"miss_{tokens}"] = wrk(proxy, miss_script(payload), **run, cpu_of=cpu_of)
                stored = stored_by(results[f"miss_{tokens}"], c)  # wrk() waited past the group-commit window
                hits_before = proxy_stats(proxy)["hit"]
                results[f"hit_{tokens}"] = wrk(proxy, hit_script(payload, stored), **run, cpu_of=cpu_of)
                served = proxy_stats(proxy)["hit"] - hits_before
                if served < results[f"hit_{tokens}"]["requests"]:  # every request of the run must be a HIT
                    raise RuntimeError(f"only {served} of {results[f'hit_{tokens}']['requests']:.0f} were hits")
                if not nginx_missing:
                    measure_nginx(results, tokens, upstream, up_pid, connections=c, duration=d, under=args.nginx_dir)
            slow_upstream, slow_proxy = f"http://127.0.0.1:{slow_up}{path}", f"http://127.0.0.1:{slow_px}{path}"
            for conns in (1, 64):
                run = {"connections": conns, "duration": d}
                results[f"slow_upstream_{conns}"] = wrk(slow_upstream, miss_script(BODY), **run, cpu_of={})
                results[f"slow_miss_{conns}"] = wrk(slow_proxy, miss_script(BODY, f"slow{conns}"), **run, cpu_of={})
            measure_metrics_cost(results, ports[2], pids[2], data, connections=c, duration=d)
            measure_routes_cost(results, ports[2], pids[2], data, connections=c, duration=d)
            first_upstream = f"http://127.0.0.1:{ports[2]}{path}"
            rates = {
                kind: asyncio.run(client_rate(kind, first_upstream, d / 2))
                for kind in ("inferproxy", "aiohttp", "httpx")
            }
    finally:
        shutil.rmtree(data, ignore_errors=True)

    report(results, rates, connections=c, duration=d, nginx_missing=nginx_missing)


def report(
    results: dict[str, dict[str, float]],
    rates: dict[str, float],
    *,
    connections: int,
    duration: int,
    nginx_missing: str | None,
) -> None:
    when = time.strftime("%Y-%m-%d")
    nginx_name = f"nginx {nginx_version()}" if not nginx_missing else "nginx"
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
    print("CPU µs per request: the measured server's utime + stime (threads and children included) over the run")
    print()
    print(
        "| answer | server | hits req/s | CPU µs per hit | misses req/s | CPU µs per miss | upstream CPU µs per miss |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for tokens in ANSWER_SIZES:
        up = results[f"upstream_{tokens}"]
        print(f"| {tokens} tokens | upstream alone | | | {up['rps']:,.0f} | {up['cpu_us_server']:.1f} | |")
        rows = [("inferproxy serve", "")] + ([] if nginx_missing else [(nginx_name, "nginx_")])
        for name, prefix in rows:
            hit, miss = results[f"{prefix}hit_{tokens}"], results[f"{prefix}miss_{tokens}"]
            print(
                f"| {tokens} tokens | {name} | {hit['rps']:,.0f} | {hit['cpu_us_server']:.1f} | {miss['rps']:,.0f}"
                f" | {miss['cpu_us_server']:.1f} | {miss['cpu_us_upstream']:.1f} |"
            )
        if nginx_missing:
            print(f"| {tokens} tokens | nginx | skipped: {nginx_missing} | | | | |")
        else:
            hit, miss = results[f"hit_{tokens}"], results[f"miss_{tokens}"]
            nhit, nmiss = results[f"nginx_hit_{tokens}"], results[f"nginx_miss_{tokens}"]
            print(
                f"| {tokens} tokens | proxy / nginx | {hit['rps'] / nhit['rps']:.2f}x"
                f" | {hit['cpu_us_server'] / nhit['cpu_us_server']:.2f}x | {miss['rps'] / nmiss['rps']:.2f}x"
                f" | {miss['cpu_us_server'] / nmiss['cpu_us_server']:.2f}x | |"
            )
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
    print(f"Counting on and off ({ANSWER_SIZES[0]} tokens, log level info, three hit runs each, alternated):")
    print()
    print("| counters | CPU µs per hit, runs | median | hits req/s, median | CPU µs per miss |")
    print("| --- | --- | ---: | ---: | ---: |")
    for name in ("on", "off"):
        runs = [results[f"metrics_{name}_hit_{i}"] for i in range(3)]
        cpu = sorted(r["cpu_us_server"] for r in runs)
        rps = sorted(r["rps"] for r in runs)
        listed = " / ".join(f"{r['cpu_us_server']:.1f}" for r in runs)
        miss = results[f"metrics_{name}_miss"]["cpu_us_server"]
        label = "on (default)" if name == "on" else "off (--no-metrics)"
        print(f"| {label} | {listed} | {cpu[1]:.1f} | {rps[1]:,.0f} | {miss:.1f} |")
    report_routes(results)
    print()
    print("| upstream client alone, 64 concurrent | requests/s | ratio to upstream |")
    print("| --- | ---: | ---: |")
    base = results[f"upstream_{ANSWER_SIZES[0]}"]["rps"]
    for kind, rate in rates.items():
        print(f"| {kind} | {rate:,.0f} | {rate / base:.2f}x |")


def report_routes(results: dict[str, dict[str, float]]) -> None:
    print()
    print(f"The route table ({ANSWER_SIZES[0]} tokens, misses, three runs each, alternated):")
    print()
    print("| /v1/chat/completions as | CPU µs per miss, runs | median | misses req/s, median |")
    print("| --- | --- | ---: | ---: |")
    medians = {}
    for name in ROUTE_KINDS:
        runs = [results[f"routes_{name}_{i}"] for i in range(3)]
        cpu = sorted(r["cpu_us_server"] for r in runs)
        rps = sorted(r["rps"] for r in runs)
        medians[name] = cpu[1]
        listed = " / ".join(f"{r['cpu_us_server']:.1f}" for r in runs)
        label = "a raw ASGI route (as served)" if name == "raw" else "a FastAPI route (bench/fastapi_v1.py)"
        print(f"| {label} | {listed} | {cpu[1]:.1f} | {rps[1]:,.0f} |")
    added = medians["fastapi"] - medians["raw"]
    verdict = "raw routes kept" if added > 15 else "within it: FastAPI would do"
    print(f"| FastAPI adds | | {added:+.1f} | (threshold 15 µs: {verdict}) |")


if __name__ == "__main__":
    main()
