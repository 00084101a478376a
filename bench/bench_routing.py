"""Routing across replicas on real vLLM: affinity vs least-inflight, measured in one run.

    make install-vllm
    .venv-vllm/bin/python bench/bench_routing.py [--documents 200] [--rollouts 4] [--concurrency 32]

Two vLLM replicas (the CPU build, the tiny model of tests/vllm/tiny_model.py, `--max-model-len 512`,
automatic prefix caching) behind one `inferproxy serve`, started once per routing mode with fresh
checkpoints. For each mode, `--documents` documents of `--rollouts` rollouts each are sent with X-Doc-Id
and X-Rollout-Idx, `--concurrency` requests at a time, as datatrove's InferenceRunner sends them: that
many generations over the rollouts documents in flight, each sending all of its rollouts at once
(`--arrival queue`: every rollout queued in order and sent as soon as a slot frees). Each
document's prompt is `--prompt-tokens` words (one token each), most of the context. The
modes' documents differ (prompts drawn from the mode's own seed), so that what one mode left in the
engines' prefix caches serves none of the other's.

Per mode: each replica's `vllm:prefix_cache_queries_total` and `vllm:prefix_cache_hits_total` (tokens;
vLLM caches whole 128-token blocks) read from its /metrics before and after, their hit rate; the
requests each replica served and its spill-overs (the proxy's /stats); requests/s and the time to
finish. Modes alternate (`--rounds`), so that neither has the machine's quieter minutes to itself.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ports import free_port  # noqa: E402

from tests.vllm import tiny_model  # noqa: E402
from tests.vllm.server import MODEL, VLLM  # noqa: E402

MAX_MODEL_LEN = 512
QUERIES, HITS = "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"
WORDS = tiny_model.TEXT.split()


class Replica(VLLM):
    """tests/vllm's vLLM with the context this benchmark fills, prefix caching asked for explicitly."""

    def __init__(self, model_dir: Path, port: int, log: Path) -> None:
        super().__init__(model_dir, port, log, (f"--max-model-len={MAX_MODEL_LEN}", "--enable-prefix-caching"))

    def counters(self) -> tuple[float, float]:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        found = {QUERIES: 0.0, HITS: 0.0}
        for line in text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in found:
                found[name] += float(line.rsplit(" ", 1)[1])
        return found[QUERIES], found[HITS]


@contextlib.contextmanager
def proxy(replicas: list[Replica], routing: str, data: Path, load_bound: float | None, logs: Path) -> Iterator[str]:
    port = free_port()
    args = [sys.executable, "-m", "app.cli", "serve", f"--port={port}", f"--routing={routing}"]
    if load_bound is not None:
        args.append(f"--affinity-load-bound={load_bound:g}")
    args += [f"--upstream={r.url}" for r in replicas]
    args += [f"--checkpoints-dir={data / 'checkpoints'}", f"--output={data / 'output'}", "--log-level=warning"]
    with (logs / "proxy.log").open("ab") as log:
        proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"the proxy did not start: {(logs / 'proxy.log').read_text()[-2000:]}")
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@dataclass
class Result:
    routing: str
    seconds: float
    requests: int
    #: per replica: (queries, hits) over the run, requests served, spill-overs
    queries: list[float]
    hits: list[float]
    served: list[int]
    spilled: list[int]

    @property
    def hit_rate(self) -> float:
        return sum(self.hits) / sum(self.queries) if sum(self.queries) else 0.0


def prompt(seed: str, tokens: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(tokens))


async def send_all(url: str, work: list[tuple[str, str]], args: argparse.Namespace) -> None:
    """Every document in order, `concurrency // rollouts` at a time, each sending its rollouts at once, as
    datatrove's InferenceRunner does (`max_concurrent_documents`, `asyncio.gather` of the rollouts); or, with
    `--arrival queue`, every rollout in order, `concurrency` at a time. A failed request stops the run."""
    queue = list(reversed(work))
    # Idle connections given up before the proxy closes them (its keep_alive_s, 5 s): one reused as it closes
    # would be a ReadError for a request never sent.
    limits = httpx.Limits(
        max_connections=args.concurrency, max_keepalive_connections=args.concurrency, keepalive_expiry=2.0
    )
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=limits) as client:

        async def rollout(doc_id: str, index: int, text: str) -> None:
            body = {"model": MODEL, "prompt": text, "max_tokens": args.max_tokens, "temperature": 1.0}
            headers = {"X-Doc-Id": doc_id, "X-Rollout-Idx": str(index)}
            answer = await client.post("/v1/completions", json={**body, "ignore_eos": True}, headers=headers)
            if answer.status_code != 200:
                raise RuntimeError(f"{doc_id}/{index}: {answer.status_code} {answer.text[:300]}")

        async def documents() -> None:
            while queue:
                doc_id, text = queue.pop()
                await asyncio.gather(*(rollout(doc_id, index, text) for index in range(args.rollouts)))

        rollouts = [(doc_id, index, text) for doc_id, text in reversed(queue) for index in range(args.rollouts)]
        rollouts.reverse()

        async def one_by_one() -> None:
            while rollouts:
                await rollout(*rollouts.pop())

        if args.arrival == "queue":
            await asyncio.gather(*(one_by_one() for _ in range(args.concurrency)))
        else:
            await asyncio.gather(*(documents() for _ in range(max(1, args.concurrency // args.rollouts))))


def run_mode(replicas: list[Replica], routing: str, round_: int, args: argparse.Namespace, logs: Path) -> Result:
    seed = f"{routing}-{round_}"
    work = [(f"{seed}-doc-{d}", prompt(f"{seed}-{d}", args.prompt_tokens)) for d in range(args.documents)]
    with (
        tempfile.TemporaryDirectory(prefix="bench-routing-") as tmp,
        proxy(replicas, routing, Path(tmp), args.load_bound, logs) as url,
    ):
        before = [r.counters() for r in replicas]
        started = time.monotonic()
        asyncio.run(send_all(url, work, args))
        seconds = time.monotonic() - started
        after = [r.counters() for r in replicas]
        stats = httpx.get(url + "/stats", timeout=10).json()
    by_url = {u["url"]: u for u in stats["upstreams"]}
    ups = [by_url[r.url] for r in replicas]
    return Result(
        routing,
        seconds,
        len(work) * args.rollouts,
        [a[0] - b[0] for a, b in zip(after, before, strict=True)],
        [a[1] - b[1] for a, b in zip(after, before, strict=True)],
        [u["requests"] for u in ups],
        [u["spilled"] for u in ups],
    )


def table(results: list[Result]) -> str:
    lines = [
        "| round | routing | hit rate | queries r0 / r1 | hits r0 / r1 | requests r0 / r1 | spilled r0 / r1 "
        "| requests/s | time to finish |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for index, r in enumerate(results):
        lines.append(
            f"| {index // 2 + 1} | {r.routing} | {r.hit_rate:.1%} | {r.queries[0]:,.0f} / {r.queries[1]:,.0f} "
            f"| {r.hits[0]:,.0f} / {r.hits[1]:,.0f} | {r.served[0]} / {r.served[1]} | {r.spilled[0]} / {r.spilled[1]} "
            f"| {r.requests / r.seconds:.2f} | {r.seconds:.1f} s |"
        )
    return "\n".join(lines)


def summary(results: list[Result]) -> str:
    def total(mode: str) -> tuple[float, float]:
        mine = [r for r in results if r.routing == mode]
        hits, queries = sum(sum(r.hits) for r in mine), sum(sum(r.queries) for r in mine)
        return (hits / queries if queries else 0.0), sum(r.seconds for r in mine)

    (affine_rate, affine_s), (least_rate, least_s) = total("affinity"), total("least-inflight")
    ratio = affine_rate / least_rate if least_rate else float("inf")
    return (
        f"hit rate: affinity {affine_rate:.1%}, least-inflight {least_rate:.1%}: {ratio:.2f}x (target >= 1.4x); "
        f"time to finish: affinity {affine_s:.1f} s, least-inflight {least_s:.1f} s: "
        f"{least_s / affine_s:.2f}x as fast (target >= 1x)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--documents", type=int, default=200)
    parser.add_argument("--rollouts", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=440, help="words of each document's prompt")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=1, help="least-inflight then affinity, this many times")
    parser.add_argument("--load-bound", type=float, default=None, help="affinity_load_bound (default: the proxy's)")
    parser.add_argument(
        "--arrival",
        choices=["document", "queue"],
        default="document",
        help="a document's rollouts sent at once, as datatrove does (concurrency / rollouts documents in flight); "
        "or every rollout queued, in order, and sent as soon as one of the concurrency slots frees",
    )
    args = parser.parse_args()
    assert args.prompt_tokens + args.max_tokens + 2 <= MAX_MODEL_LEN, "the prompt and answer must fit the context"
    model = tiny_model.model_dir()
    logs = Path(tempfile.mkdtemp(prefix="bench-routing-logs-"))
    replicas = [Replica(model, free_port(), logs / f"vllm-{i}.log") for i in range(2)]
    print(f"{' '.join(sys.argv)}: {vars(args)}", flush=True)
    print(f"starting two vLLM replicas (logs in {logs})", flush=True)
    try:
        threads = [threading.Thread(target=r.start) for r in replicas]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if not all(r.healthy() for r in replicas):
            raise SystemExit(f"a replica did not start: see {logs}")
        results: list[Result] = []
        for round_ in range(args.rounds):
            for routing in ("least-inflight", "affinity"):
                result = run_mode(replicas, routing, round_, args, logs)
                results.append(result)
                print(
                    f"round {round_ + 1} {routing}: hit rate {result.hit_rate:.1%}, "
                    f"{result.requests / result.seconds:.2f} requests/s, {result.seconds:.1f} s",
                    flush=True,
                )
        print()
        print(table(results))
        print()
        print(summary(results))
    finally:
        for replica in replicas:
            replica.kill()


if __name__ == "__main__":
    main()
