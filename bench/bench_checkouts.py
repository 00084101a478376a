"""Two checkouts of inferproxy side by side: CPU µs per hit and per miss of each, in one run.

    git worktree add /tmp/old <commit>
    python bench/bench_checkouts.py /tmp/old [--duration 8] [--rounds 3]

For a change that should cost nothing (issue 19's restructuring: "CPU per hit and per miss within
the run's noise"): `inferproxy serve` from this checkout and from OLD, each in front of one
`inferproxy fake-upstream` of its own (of this checkout), measured with bench_proxy.py's wrk runs.
Each proxy first stores the documents of one miss run; then, `--rounds` times, alternated, a hit run
replaying them and a miss run of new documents on each. The median of the rounds is reported, with
every round, so that the noise between rounds shows beside the difference between checkouts.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from bench_proxy import ANSWER_SIZES, body, hit_script, inferproxy, miss_script, serve, stored_by, wait_until_up, wrk
from ports import free_port

HERE = Path(__file__).resolve().parent.parent


def revision(checkout: Path) -> str:
    out = subprocess.run(["git", "-C", str(checkout), "log", "-1", "--format=%h %s"], capture_output=True, text=True)
    return out.stdout.strip()[:90] or str(checkout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("old", type=Path, help="the other checkout (a git worktree of an older commit)")
    parser.add_argument("--duration", type=int, default=8, help="seconds per wrk run")
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is needed: apt-get install wrk")
    if not (args.old / "app" / "cli.py").exists():
        raise SystemExit(f"{args.old} is not a checkout of inferproxy (no app/cli.py): git worktree add it first")
    checkouts = {"new": HERE, "old": args.old.resolve()}
    payload = body(ANSWER_SIZES[0])
    run = {"connections": args.connections, "duration": args.duration}
    data = Path(tempfile.mkdtemp(prefix="bench-checkouts-"))
    results: dict[str, list[dict[str, float]]] = {}
    try:
        with contextlib.ExitStack() as stack:
            proxies: dict[str, tuple[str, int, int]] = {}
            for name, checkout in checkouts.items():
                up = free_port()
                up_pid = stack.enter_context(inferproxy("fake-upstream", f"--port={up}"))
                wait_until_up(f"http://127.0.0.1:{up}/v1/models")
                url, px_pid = serve(stack, up, data / name, "--log-level=warning", checkout=checkout)
                proxies[name] = (url, px_pid, up_pid)
            stored = {}
            for name, (url, pid, _) in proxies.items():
                stored[name] = stored_by(
                    wrk(url, miss_script(payload), **run, cpu_of={"server": pid}), args.connections
                )
            for round_ in range(args.rounds):
                for name, (url, pid, _) in proxies.items():
                    hit = wrk(url, hit_script(payload, stored[name]), **run, cpu_of={"server": pid})
                    miss = wrk(url, miss_script(payload, f"round{round_}"), **run, cpu_of={"server": pid})
                    results.setdefault(f"{name}_hit", []).append(hit)
                    results.setdefault(f"{name}_miss", []).append(miss)
    finally:
        shutil.rmtree(data, ignore_errors=True)

    print(f"# bench_checkouts: Python {platform.python_version()}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}")
    print(f"wrk -t1 -c{args.connections} -d{args.duration}s, {ANSWER_SIZES[0]}-token answers, {args.rounds} rounds")
    print(f"new: {revision(HERE)}")
    print(f"old: {revision(checkouts['old'])}")
    print()
    print(
        "| checkout | CPU µs per hit, rounds | median | hits req/s | CPU µs per miss, rounds | median | misses req/s |"
    )
    print("| --- | --- | ---: | ---: | --- | ---: | ---: |")
    medians: dict[str, float] = {}
    for name in checkouts:
        cells = []
        for kind in ("hit", "miss"):
            runs = results[f"{name}_{kind}"]
            cpu = sorted(r["cpu_us_server"] for r in runs)
            rps = sorted(r["rps"] for r in runs)
            medians[f"{name}_{kind}"] = cpu[len(cpu) // 2]
            listed = " / ".join(f"{r['cpu_us_server']:.1f}" for r in runs)
            cells.append(f"{listed} | {cpu[len(cpu) // 2]:.1f} | {rps[len(rps) // 2]:,.0f}")
        print(f"| {name} | {cells[0]} | {cells[1]} |")
    hit = medians["new_hit"] - medians["old_hit"]
    miss = medians["new_miss"] - medians["old_miss"]
    print(f"| new - old | | {hit:+.1f} | | | {miss:+.1f} | |")


if __name__ == "__main__":
    main()
