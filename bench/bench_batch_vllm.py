"""One batch file on real vLLM: `inferproxy run-batch` in front of vLLM's API server against vLLM's own
run-batch, in wall time and in generations paid when each is killed half way and run again (issue 20 (b)).

    make install-vllm
    PYTHONPATH=$PWD .venv-vllm/bin/python bench/bench_batch_vllm.py [--lines 2000] [--max-tokens 128] [--rounds 2]

The vLLM is the CPU build with the tiny model of tests/vllm/tiny_model.py (`--max-model-len 512`, float32,
`--enforce-eager`, the engine at the default niceness on both sides). The input: `--lines` chat-completion
lines, each a prompt of `--prompt-words` words (one token each) drawn from its own seed, `--max-tokens`
generated with `ignore_eos` (every line costs the same).

Ours: `python -m vllm.entrypoints.openai.api_server` started afresh (tests/vllm/server.py's `VLLM`, timed up
to healthy and its one warm-up generation), then `inferproxy run-batch -i IN -o OUT --upstream URL` (its
defaults), timed from its start to its exit. vLLM's: `python -m vllm.entrypoints.openai.run_batch -i IN
-o OUT` with the same engine flags (its `vllm` command fails in the CPU build), timed from its start to its
exit: its engine's start is in it. The ratio is vLLM's time over ours, with our server's start and without
(a server usually runs already). The two alternate, each round with fresh state and new prompts.

Killed half way: ours with the API server running, `inferproxy run-batch` SIGKILLed once the server's
`vllm:request_success_total` has grown by half the lines, then the same command run to its end; generations
paid are that counter's growth over both runs (plus `vllm:generation_tokens_total`'s growth over
`--max-tokens`, which counts what the kill cut off too). vLLM's run-batch started with `--enable-metrics`
(its Prometheus port), SIGKILLed (its process group: front end, engine core and worker) once its own
`vllm:request_success_total` reaches half the lines, then run to its end without it: it writes its output
only at the end, so a kill keeps nothing; generations paid are the counter's last reading before the kill
plus the rerun's answered lines. Every output is checked: each custom_id exactly once, every line a 200.
Then the first line of each output, compared key by key.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import resource
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ports import free_port  # noqa: E402

from tests.vllm import tiny_model  # noqa: E402
from tests.vllm.server import MODEL, VLLM, engine_args, kill_group, metric, spawn  # noqa: E402

MAX_MODEL_LEN = 512
CHAT = "/v1/chat/completions"
SUCCESS, TOKENS = "vllm:request_success_total", "vllm:generation_tokens_total"
WORDS = tiny_model.TEXT.split()
POLL_S = 0.2


def write_input(path: Path, seed: str, args: argparse.Namespace) -> None:
    with path.open("wb") as f:
        for i in range(args.lines):
            rng = random.Random(f"{seed}-{i}")
            prompt = " ".join(rng.choice(WORDS) for _ in range(args.prompt_words))
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": args.max_tokens,
                "ignore_eos": True,
            }
            f.write(orjson.dumps({"custom_id": f"{seed}-{i}", "method": "POST", "url": CHAT, "body": body}) + b"\n")


def check_output(path: Path, lines: int) -> list[dict[str, Any]]:
    """Every custom_id of the input exactly once, every line a 200 with no error."""
    answers = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    counts = collections.Counter(a["custom_id"] for a in answers)
    twice = [cid for cid, n in counts.items() if n > 1]
    assert not twice, f"{path}: custom_ids more than once: {twice[:5]}"
    assert len(counts) == lines, f"{path}: {len(counts)} custom_ids of {lines}"
    bad = [a for a in answers if a["response"]["status_code"] != 200 or a["error"] is not None]
    assert not bad, f"{path}: {len(bad)} lines not answered: {bad[0]}"
    return answers


def ours_command(url: str, inp: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "app.cli", "run-batch", "-i", str(inp), "-o", str(out), f"--upstream={url}"]


def vllm_args(model: Path, inp: Path, out: Path, metrics_port: int | None = None) -> list[str]:
    args = ["-i", str(inp), "-o", str(out), *engine_args(model), f"--max-model-len={MAX_MODEL_LEN}"]
    if metrics_port is not None:
        args += ["--enable-metrics", "--host=127.0.0.1", f"--port={metrics_port}"]
    return args


def run(command: list[str], log: Path) -> tuple[float, float]:
    """Seconds from the start of `command` to its exit, which must be 0, and its CPU seconds (user + system)."""
    started, cpu = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
    with log.open("ab") as out:
        code = subprocess.run(command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT).returncode
    seconds, after = time.monotonic() - started, resource.getrusage(resource.RUSAGE_CHILDREN)
    assert code == 0, f"{command[:4]} exited {code}: see {log}"
    return seconds, after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime


def run_vllm(model: Path, inp: Path, out: Path, log: Path) -> float:
    """vLLM's run-batch to its end, in its own process group (killed whole if anything goes wrong)."""
    started = time.monotonic()
    proc = spawn("vllm.entrypoints.openai.run_batch", vllm_args(model, inp, out), log)
    try:
        code = proc.wait(timeout=3600)
    finally:
        kill_group(proc)
    assert code == 0, f"vLLM's run-batch exited {code}: see {log}"
    return time.monotonic() - started


def new_server(model: Path, log: Path) -> tuple[VLLM, float]:
    server = VLLM(model, free_port(), log, (f"--max-model-len={MAX_MODEL_LEN}",), nice_engine=False)
    started = time.monotonic()
    server.start()
    return server, time.monotonic() - started


@dataclass
class Timed:
    side: str
    round: int
    seconds: float
    start_s: float = 0.0  # ours: the API server's start (to healthy, and its warm-up)
    generations: float = 0.0  # ours: at the server
    cpu_s: float = 0.0  # ours: inferproxy run-batch's CPU time
    batch_s: float = 0.0  # vLLM's: its batch alone, without its engine's start (its progress bar's time, in whole s)


def time_ours(model: Path, work: Path, round_: int, args: argparse.Namespace) -> Timed:
    inp, out = work / f"ours-{round_}.jsonl", work / f"ours-{round_}.out.jsonl"
    write_input(inp, f"ours-{round_}", args)
    server, start_s = new_server(model, work / f"vllm-serve-{round_}.log")
    try:
        before = server.generations()
        seconds, cpu_s = run(ours_command(server.url, inp, out), work / f"ours-{round_}.log")
        generations = server.generations() - before
    finally:
        server.kill()
    check_output(out, args.lines)
    return Timed("ours", round_, seconds, start_s, generations, cpu_s)


def time_vllm(model: Path, work: Path, round_: int, args: argparse.Namespace) -> Timed:
    inp, out = work / f"vllm-{round_}.jsonl", work / f"vllm-{round_}.out.jsonl"
    write_input(inp, f"vllm-{round_}", args)
    log = work / f"vllm-run-batch-{round_}.log"
    seconds = run_vllm(model, inp, out, log)
    check_output(out, args.lines)
    return Timed("vllm", round_, seconds, batch_s=progress_seconds(log))


def progress_seconds(log: Path) -> float:
    """The elapsed time of vLLM's run-batch's last progress line (`... | 2000/2000 [01:02<00:00, ...]`)."""
    bars = [line for line in log.read_text(errors="replace").splitlines() if line.startswith("Running batch:")]
    minutes, seconds = bars[-1].split("[", 1)[1].split("<", 1)[0].split(":")[-2:]
    return int(minutes) * 60 + int(seconds)


@dataclass
class Killed:
    side: str
    at_kill: float  # lines the upstream had finished when the first run was killed
    generations: float  # finished generations paid over both runs
    token_lines: float  # tokens generated over both runs, in lines' worth (--max-tokens each)
    first_s: float
    rerun_s: float


def wait_for(read: Any, target: float, proc: subprocess.Popen[bytes], log: Path) -> float:
    """Poll `read()` until it reaches `target`; the last reading. A process that exits first is an error."""
    while True:
        try:
            value = float(read())
        except httpx.HTTPError:
            value = 0.0  # not up yet
        if value >= target:
            return value
        assert proc.poll() is None, f"exited {proc.returncode} before half way: see {log}"
        time.sleep(POLL_S)


def kill_ours(model: Path, work: Path, args: argparse.Namespace) -> Killed:
    inp, out = work / "ours-killed.jsonl", work / "ours-killed.out.jsonl"
    write_input(inp, "ours-killed", args)
    log = work / "ours-killed.log"
    server, _ = new_server(model, work / "vllm-serve-killed.log")
    try:
        before, tokens_before = server.generations(), server.metric(TOKENS)
        started = time.monotonic()
        with log.open("ab") as out_log:
            proc = subprocess.Popen(
                ours_command(server.url, inp, out), stdout=out_log, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            wait_for(lambda: server.generations() - before, args.lines / 2, proc, log)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                kill_group(proc)
        first_s = time.monotonic() - started
        time.sleep(2)  # what the kill cut off ends at the engine (aborted: not a success)
        at_kill = server.generations() - before
        assert not out.exists(), "the output was written before the kill"
        rerun_s, _ = run(ours_command(server.url, inp, out), log)
        generations = server.generations() - before
        token_lines = (server.metric(TOKENS) - tokens_before) / args.max_tokens
    finally:
        server.kill()
    check_output(out, args.lines)
    return Killed("ours", at_kill, generations, token_lines, first_s, rerun_s)


def kill_vllm(model: Path, work: Path, args: argparse.Namespace) -> Killed:
    inp, out = work / "vllm-killed.jsonl", work / "vllm-killed.out.jsonl"
    write_input(inp, "vllm-killed", args)
    log = work / "vllm-killed.log"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    proc = spawn("vllm.entrypoints.openai.run_batch", vllm_args(model, inp, out, port), log)
    tokens = 0.0
    try:

        def successes() -> float:
            nonlocal tokens
            tokens = metric(url, TOKENS)
            return metric(url, SUCCESS)

        at_kill = wait_for(successes, args.lines / 2, proc, log)
    finally:
        kill_group(proc)
    first_s = time.monotonic() - started
    assert not out.exists(), "vLLM's run-batch wrote its output before the kill"
    rerun_s = run_vllm(model, inp, out, log)
    answers = check_output(out, args.lines)
    return Killed("vllm", at_kill, at_kill + len(answers), tokens / args.max_tokens + len(answers), first_s, rerun_s)


def shape(value: Any) -> Any:
    """A JSON value's keys and types, recursively (a list by its first item)."""
    if isinstance(value, dict):
        return {key: shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return type(value).__name__


def differences(ours: Any, theirs: Any, where: str = "") -> list[str]:
    if isinstance(ours, dict) and isinstance(theirs, dict):
        found = [f"{where}.{k}: only in ours ({ours[k]})" for k in ours if k not in theirs]
        found += [f"{where}.{k}: only in vLLM's ({theirs[k]})" for k in theirs if k not in ours]
        for key in (k for k in ours if k in theirs):
            found += differences(ours[key], theirs[key], f"{where}.{key}")
        if [k for k in ours if k in theirs] != [k for k in theirs if k in ours]:
            found.append(f"{where}: keys in another order: ours {list(ours)}, vLLM's {list(theirs)}")
        return found
    if isinstance(ours, list) and isinstance(theirs, list) and ours and theirs:
        return differences(ours[0], theirs[0], f"{where}[0]")
    return [] if ours == theirs else [f"{where}: ours {ours}, vLLM's {theirs}"]


def compare_formats(model: Path, work: Path, args: argparse.Namespace) -> None:
    """One line answered and one refused (its prompt over the context: a 400 from vLLM) through each side,
    their output lines printed and compared key by key."""
    inp = work / "formats.jsonl"
    write_input(inp, "formats", argparse.Namespace(**{**vars(args), "lines": 2}))
    lines = inp.read_bytes().splitlines()
    refused = orjson.loads(lines[1])
    refused["body"]["messages"][0]["content"] = " ".join(["the"] * (MAX_MODEL_LEN + 10))
    inp.write_bytes(lines[0] + b"\n" + orjson.dumps(refused) + b"\n")
    ours_out, vllm_out = work / "formats-ours.out.jsonl", work / "formats-vllm.out.jsonl"
    server, _ = new_server(model, work / "vllm-serve-formats.log")
    try:
        run(ours_command(server.url, inp, ours_out), work / "formats-ours.log")
    finally:
        server.kill()
    run_vllm(model, inp, vllm_out, work / "formats-vllm.log")
    for ours_line, vllm_line in zip(
        ours_out.read_bytes().splitlines(), vllm_out.read_bytes().splitlines(), strict=True
    ):
        ours, theirs = orjson.loads(ours_line), orjson.loads(vllm_line)
        print("\nours:  ", ours_line.decode()[:700])
        print("vLLM's:", vllm_line.decode()[:700])
        found = differences(shape(ours), shape(theirs))
        print("differences (keys and types):", *(found or ["none"]), sep="\n  ", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=2000)
    parser.add_argument("--prompt-words", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="ours and vLLM's, alternating, this many times")
    parser.add_argument("--no-kill", action="store_true", help="only the wall times")
    args = parser.parse_args()
    assert args.prompt_words + args.max_tokens + 8 <= MAX_MODEL_LEN, "the prompt and answer must fit the context"
    model = tiny_model.model_dir()
    work = Path(tempfile.mkdtemp(prefix="bench-batch-vllm-"))
    print(f"{' '.join(sys.argv)}: {vars(args)}; files and logs in {work}", flush=True)
    timed: list[Timed] = []
    for round_ in range(args.rounds):
        sides = (time_ours, time_vllm) if round_ % 2 == 0 else (time_vllm, time_ours)
        for side in sides:
            result = side(model, work, round_, args)
            timed.append(result)
            line = f"round {round_ + 1} {result.side}: {result.seconds:.1f} s"
            if result.side == "ours":
                line += (
                    f", server start {result.start_s:.1f} s, {result.generations:.0f} generations, "
                    f"run-batch's CPU {result.cpu_s:.1f} s"
                )
            else:
                line += f", its batch alone {result.batch_s:.0f} s (the rest its engine's start)"
            print(line, flush=True)
    ours = [t for t in timed if t.side == "ours"]
    theirs = [t for t in timed if t.side == "vllm"]
    run_s, start_s, vllm_s = sum(t.seconds for t in ours), sum(t.start_s for t in ours), sum(t.seconds for t in theirs)
    print(
        f"\n{args.lines} lines, {args.rounds} rounds: vLLM's run-batch {vllm_s / args.rounds:.1f} s a run; ours "
        f"{run_s / args.rounds:.1f} s with the server running ({vllm_s / run_s:.2f}x), "
        f"{(run_s + start_s) / args.rounds:.1f} s with its start ({vllm_s / (run_s + start_s):.2f}x); target >= 0.9x"
    )
    if not args.no_kill:
        print()
        for kill in (kill_ours, kill_vllm):
            killed = kill(model, work, args)
            print(
                f"{killed.side} killed half way: {killed.at_kill:.0f} lines done at the kill ({killed.first_s:.1f} s), "
                f"rerun {killed.rerun_s:.1f} s; generations paid {killed.generations:.0f} "
                f"({killed.generations / args.lines:.3f}x the lines), tokens generated {killed.token_lines:.0f} lines' "
                f"worth ({killed.token_lines / args.lines:.3f}x); target for ours <= 1.05x",
                flush=True,
            )
    compare_formats(model, work, args)


if __name__ == "__main__":
    main()
