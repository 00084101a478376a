"""A soak run: steady mixed load on `inferproxy serve` for minutes or an hour, watching for drift.

    python bench/soak.py [--long] [--duration S] [--rate OPS] [--json PATH]

Starts `inferproxy fake-upstream` and `inferproxy serve` in front of it as real processes on
loopback ports (bench_proxy's helpers), then drives the proxy at a fixed rate of operations, paced
by a token bucket: open loop, so a slow answer does not slow the load down; an operation that finds
`MAX_IN_FLIGHT` still running is shed and counted. Four ranks, each a job (rank 0 one long job whose
checkpoints stay open all along; ranks 1-3 end a job every third chunk or so), and the operations:

- generations, each a new document of a rank at its next input position: `miss` (chat or
  completions, expects MISS), `stream` and `stream_usage` (SSE, without and with
  `stream_options.include_usage`, expects MISS and `data: [DONE]`), `coalesced` (three identical
  requests at once, the upstream taking 100 ms: expects one MISS, the others COALESCED), `disconnect`
  (a slow stream the client drops after two pieces);
- `hit`: a generation whose document is not written yet, asked for again: expects HIT and the first
  answer's bytes (unless the document is being written meanwhile, or the rank's files went);
- `document`: `POST /documents` of the rank's oldest generations once `HOLD_S` old (1 to 8 of
  one chunk), or of a new document when none is; chunks of `records_per_chunk` publish when full;
  a job's last chunk is partial and completed with `POST /chunks/{i}/complete` (`complete`), which
  removes the rank's files (the next job on the rank makes them again);
- `forward`: `GET /v1/models` or `POST /tokenize`, forwarded uncached; `resume`: `GET /resume`;
- `task`: a whole job on a rank of its own, never used again (a datatrove task): resume, a
  generation, its document, its chunk completed. A proxy lives through thousands of ranks.

Ranks 0 and 1 work all the time; ranks 2 and 3 take turns resting for `--rest-s`, longer than the
proxy's `rank_idle_s`, so that their caches and checkpoints are released and reopened. Every
`--interval` seconds a sample: the proxy's RSS (VmRSS, and RssAnon), open descriptors
(/proc/<pid>/fd), threads, CPU, requests/s, p50/p99 latency per kind, and its `/stats`; RSS and
descriptors are read every second. At the end a verdict (`verdict()` and the constants above it
define "flat" and "drift"), a Markdown table of the samples thinned to ~20 rows for
bench/README.md, and the raw samples as JSON (`--json`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import itertools
import json
import os
import platform
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import orjson
from bench_proxy import cpu_seconds, inferproxy, wait_until_up
from ports import free_port

from app.http.client import HTTPClient, HTTPClientError

RANKS = 4
RESTING = (2, 3)  # ranks that rest in turns, long enough to be released
TASK_RANKS_FROM = 1000  # each `task` is a short job on a rank of its own, numbered from here
#: operation -> weight. Generations make ~30 documents per 100 operations; `document` writes 1-8 each,
#: so every generation is written HOLD_S after it, and the rest are documents without a generation.
MIX = {
    "hit": 28,
    "miss": 14,
    "stream": 6,
    "stream_usage": 6,
    "coalesced": 2,
    "disconnect": 2,
    "document": 34,
    "forward": 6,
    "resume": 2,
    "task": 0.5,
}
GENERATIONS = frozenset({"miss", "stream", "stream_usage", "coalesced", "disconnect"})
KINDS = (*MIX, "complete")  # latency is kept per kind; `complete` follows the document that ends a partial chunk
HOLD_S = 2.0  # a generation is replayed (hit) for this long before its document is written
MAX_IN_FLIGHT = 256
PROBE_EVERY_S = 1.0
TABLE_ROWS = 20


@dataclass
class Doc:
    rank: int
    id: str
    chunk: int
    path: str
    body: bytes
    epoch: int  # the rank's files' generation it was stored in (see Rank.epoch)
    generated_at: float = 0.0
    answer: bytes = b""  # digest of the first answer, which a hit must replay
    hittable: bool = False
    writing: bool = False


@dataclass
class Rank:
    """A job's view of one rank: positions handed out, chunks written, generations not yet written."""

    number: int
    records_per_chunk: int
    rng: random.Random
    partial_share: float  # of its chunks, the share that is a job's last (partial, completed by the job)
    chunk: int = 0  # the chunk new positions go to
    handed: int = 0  # positions handed out in it
    planned: int = 0  # its size: records_per_chunk, or fewer for a partial chunk the job completes
    partial: dict[int, int] = field(default_factory=dict)  # partial chunk -> its size
    written: Counter[int] = field(default_factory=Counter)
    done_through: int = -1  # every chunk up to this one is complete, as far as the job knows
    epoch: int = 0  # +1 each time a complete removed the rank's files (and its cache)
    completing: bool = False
    pending: deque[Doc] = field(default_factory=deque)  # generated, not yet written
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # documents and completes, one at a time
    ids: Iterator[int] = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        self.planned = self.plan()

    def plan(self) -> int:
        """The next chunk's size: full, or a partial one the job completes (`partial_share` of them)."""
        if self.rng.random() >= self.partial_share:
            return self.records_per_chunk
        return self.rng.randint(1, self.records_per_chunk - 1)

    @property
    def ending(self) -> bool:
        """Its job's last, partial chunk is handed out: no new document until it is completed."""
        return bool(self.partial)

    def ready(self, now: float) -> bool:
        """A generation HOLD_S old waits to be written."""
        return bool(self.pending) and self.pending[0].generated_at <= now - HOLD_S

    def replayable(self) -> list[Doc]:
        return [doc for doc in self.pending if doc.hittable and not doc.writing and doc.epoch == self.epoch]

    def new_doc(self, path: str, payload: dict[str, Any]) -> Doc:
        """The rank's next document, at its next input position."""
        assert not self.ending, "a job writes nothing past its last chunk"
        number = next(self.ids)
        doc_id = f"r{self.number}-d{number}"
        chunk = self.chunk
        self.handed += 1
        if self.handed == self.planned:
            if self.planned < self.records_per_chunk:
                self.partial[chunk] = self.planned
            self.chunk, self.handed, self.planned = chunk + 1, 0, self.plan()
        body = orjson.dumps({"model": "fake-model", **payload, "seed": number})
        return Doc(self.number, doc_id, chunk, path, body, self.epoch)


class Recorder:
    """What the operations did since the last sample."""

    def __init__(self) -> None:
        self.latencies: dict[str, list[float]] = {kind: [] for kind in KINDS}
        self.errors: Counter[str] = Counter()
        self.unexpected: Counter[str] = Counter()
        self.requests = 0
        self.shed = 0
        self.lag = 0.0  # the most this process's event loop woke late, seconds
        self.examples: list[str] = []  # the first errors and surprises, for the report

    def done(self, kind: str, seconds: float, requests: int = 1) -> None:
        self.latencies[kind].append(seconds)
        self.requests += requests

    def error(self, kind: str, what: str) -> None:
        self.errors[kind] += 1
        if len(self.examples) < 20:
            self.examples.append(f"{kind}: {what}")

    def surprise(self, kind: str, what: str) -> None:
        self.unexpected[kind] += 1
        if len(self.examples) < 20:
            self.examples.append(f"{kind} (unexpected): {what}")


class Load:
    """The ranks' jobs against one proxy: `operation(kind, rank)` runs one, recording into `self.rec`."""

    def __init__(self, proxy: str, records_per_chunk: int, seed: int) -> None:
        self.proxy = proxy
        self.rng = random.Random(seed)
        # Rank 0 is one long job (its checkpoints stay open all along); the others end a job every third chunk.
        self.ranks = [
            Rank(r, records_per_chunk, random.Random(seed + r + 1), 0.0 if r == 0 else 1 / 3) for r in range(RANKS)
        ]
        # One client (its own keep-alive connections) per rank, as each rank is a worker of its own.
        self.clients = [HTTPClient(max_idle=8, read_timeout=60.0) for _ in range(RANKS + 1)]  # the last: tasks'
        self.task_ranks = itertools.count(TASK_RANKS_FROM)
        self.rec = Recorder()
        self.totals: Counter[str] = Counter()  # over the whole run: coverage of what the run exercised

    async def request(
        self, rank: int, method: str, path: str, body: bytes = b"", **headers: str
    ) -> tuple[int, dict[bytes, bytes], bytes]:
        head = [(b"x-rank", str(rank).encode())] + [
            (k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()
        ]
        if body:
            head.append((b"content-type", b"application/json"))
        async with self.clients[min(rank, RANKS)].request(method, self.proxy + path, headers=head, body=body) as answer:
            data = await answer.read()
            return answer.status, dict(answer.headers), data

    async def generate(self, doc: Doc) -> tuple[str, bytes]:
        """One generation request for `doc` (its X-Cache and body), checked to be whole."""
        status, headers, data = await self.request(
            doc.rank, "POST", doc.path, doc.body, x_doc_id=doc.id, x_chunk_index=str(doc.chunk)
        )
        if status != 200:
            raise RuntimeError(f"{doc.path} for {doc.id}: {status} {data[:200]!r}")
        if b'"stream":true' in doc.body and not data.endswith(b"data: [DONE]\n\n"):
            raise RuntimeError(f"the stream for {doc.id} did not end with data: [DONE]")
        return headers.get(b"x-cache", b"").decode(), data

    def new_generation(self, rank: Rank, kind: str) -> Doc:
        n = rank.handed
        prompt = f"Write about document {n} of rank {rank.number}."
        if kind == "miss" and n % 3 == 2:
            return rank.new_doc("/v1/completions", {"prompt": prompt, "max_tokens": 16})
        payload: dict[str, Any] = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 16}
        if kind in ("stream", "stream_usage", "disconnect"):
            payload["stream"] = True
        if kind == "stream_usage":
            payload["stream_options"] = {"include_usage": True}
        if kind == "coalesced":
            payload["fake_upstream"] = {"latency_ms": 100}
        if kind == "disconnect":
            payload["fake_upstream"] = {"chunk_delay_ms": 20}
        return rank.new_doc("/v1/chat/completions", payload)

    def pick(self, kind: str, elapsed: float, rest_s: float) -> tuple[str, Rank]:
        """A rank for an operation of `kind`, among those working now; `forward` where none can take it
        (every working rank ending its job, say)."""
        working = self.active(elapsed, rest_s)
        now = time.monotonic()
        if kind == "hit":
            fits = [r for r in working if r.replayable()]
        elif kind == "document":
            fits = [r for r in working if not r.ending or r.ready(now)]
        elif kind in GENERATIONS:
            fits = [r for r in working if not r.ending]
        else:
            fits = working
        if not fits:
            return "forward", self.rng.choice(working)
        return kind, self.rng.choice(fits)

    async def operation(self, kind: str, rank: Rank) -> None:
        if (kind == "hit" and not rank.replayable()) or (kind in GENERATIONS and rank.ending):
            self.totals["skipped (changed since picked)"] += 1
            return
        started = time.perf_counter()
        requests = 1
        try:
            if kind in GENERATIONS:
                requests = await self.generation(kind, rank)
            elif kind == "hit":
                await self.hit(rank)
            elif kind == "document":
                await self.write(rank)
            elif kind == "forward":
                if rank.rng.random() < 0.5:
                    status, _, data = await self.request(rank.number, "GET", "/v1/models")
                else:
                    prompt = orjson.dumps({"model": "fake-model", "prompt": "how many tokens is this"})
                    status, _, data = await self.request(rank.number, "POST", "/tokenize", prompt)
                if status != 200:
                    raise RuntimeError(f"forwarded: {status} {data[:200]!r}")
            elif kind == "resume":
                status, _, data = await self.request(rank.number, "GET", "/resume")
                if status != 200:
                    raise RuntimeError(f"/resume: {status} {data[:200]!r}")
            elif kind == "task":
                requests = await self.task()
        except Exception as exc:
            self.rec.error(kind, f"{type(exc).__name__}: {exc}")
            return
        self.rec.done(kind, time.perf_counter() - started, requests)
        self.totals[kind] += 1

    async def generation(self, kind: str, rank: Rank) -> int:
        """A new document's generation; it is then written HOLD_S later (whatever happened), and replayed
        until then if its answer is known. Returns the requests made."""
        doc = self.new_generation(rank, kind)
        answer: bytes | None = None
        try:
            if kind == "coalesced":
                answers = await asyncio.gather(*(self.generate(doc) for _ in range(3)))
                states = sorted(state for state, _ in answers)
                # A request the client or the machine delayed past the first one's 100 ms finds it stored: HIT.
                if states.count("MISS") != 1 or not set(states) <= {"MISS", "COALESCED", "HIT"}:
                    self.rec.surprise(kind, f"{doc.id}: three identical requests answered {states}")
                elif len({data for _, data in answers}) != 1:
                    self.rec.surprise(kind, f"{doc.id}: three identical requests got different answers")
                else:
                    answer = answers[0][1]
                self.totals["coalesced answers"] += states.count("COALESCED")
                return 3
            if kind == "disconnect":
                await self.disconnect(doc)  # whether the proxy kept the answer is its business
                return 1
            state, data = await self.generate(doc)
            if state != "MISS":
                self.rec.surprise(kind, f"{doc.id} answered {state}, not MISS")
            answer = data
            return 1
        finally:
            doc.generated_at = time.monotonic()
            if answer is not None:
                doc.answer, doc.hittable = digest(answer), True
            rank.pending.append(doc)

    async def task(self) -> int:
        """A job on a new rank from start to end (a datatrove task): resume, one generation, its document,
        its chunk completed: the rank's files are made and removed, and the rank released. Returns the requests."""
        rank = next(self.task_ranks)
        doc_id = f"t{rank}"
        status, _, data = await self.request(rank, "GET", "/resume")
        if status != 200 or orjson.loads(data)["docs_to_skip"] != 0:
            raise RuntimeError(f"/resume of the new rank {rank}: {status} {data[:200]!r}")
        body = orjson.dumps({"model": "fake-model", "messages": [{"role": "user", "content": doc_id}], "max_tokens": 8})
        status, headers, data = await self.request(
            rank, "POST", "/v1/chat/completions", body, x_doc_id=doc_id, x_chunk_index="0"
        )
        if status != 200 or headers.get(b"x-cache") != b"MISS":
            raise RuntimeError(f"generation on the new rank {rank}: {status} {headers.get(b'x-cache')!r}")
        document = orjson.dumps({"id": doc_id, "text": data.decode()})
        status, _, data = await self.request(rank, "POST", "/documents", document, x_chunk_index="0")
        if status != 200:
            raise RuntimeError(f"/documents on the new rank {rank}: {status} {data[:200]!r}")
        status, _, data = await self.request(rank, "POST", "/chunks/0/complete")
        if status != 200 or orjson.loads(data)["last_chunk_index"] != 0:
            raise RuntimeError(f"/chunks/0/complete on the new rank {rank}: {status} {data[:200]!r}")
        return 4

    async def hit(self, rank: Rank) -> None:
        """A generation not yet written, asked for again: HIT, with the first answer's bytes."""
        doc = rank.rng.choice(rank.replayable())
        state, data = await self.generate(doc)
        if doc.writing or rank.completing or doc.epoch != rank.epoch:
            return  # its document written meanwhile (a racing request may then have stored a new answer)
        if state != "HIT":
            self.rec.surprise("hit", f"{doc.id} answered {state}, not HIT")
        elif digest(data) != doc.answer:
            self.rec.surprise("hit", f"{doc.id}: the replay differs from the first answer")

    async def disconnect(self, doc: Doc) -> None:
        """A slow stream dropped by the client after two pieces of it."""
        head = [
            (b"x-rank", str(doc.rank).encode()),
            (b"x-doc-id", doc.id.encode()),
            (b"x-chunk-index", str(doc.chunk).encode()),
            (b"content-type", b"application/json"),
        ]
        client = self.clients[doc.rank]
        async with client.request("POST", self.proxy + doc.path, headers=head, body=doc.body) as answer:
            if answer.status != 200:
                raise RuntimeError(f"disconnect {doc.id}: {answer.status}")
            pieces = 0
            async for _ in answer.iter_chunks():
                pieces += 1
                if pieces == 2:
                    break
            answer.abort()

    async def write(self, rank: Rank) -> None:
        """`POST /documents` of the oldest generations HOLD_S old (one chunk's, 1-8 of them) or of a new
        document; then the completes the job owes (a partial chunk written whole after every earlier one)."""
        async with rank.lock:
            ready = time.monotonic() - HOLD_S
            batch: list[Doc] = []
            limit = rank.rng.choice((1, 1, 2, 4, 8))
            for doc in rank.pending:
                if doc.generated_at > ready or len(batch) == limit or (batch and doc.chunk != batch[0].chunk):
                    break
                batch.append(doc)
            if not batch and rank.ending:
                return  # its last generations are not HOLD_S old yet (pick() saw one that was: written since)
            if not batch:
                batch = [rank.new_doc("/v1/chat/completions", {"messages": []})]
            for doc in batch:
                doc.writing = True
            documents = [
                {"id": doc.id, "text": f"the text of {doc.id}", "metadata": {"rank": rank.number}} for doc in batch
            ]
            try:
                status, _, data = await self.request(
                    rank.number, "POST", "/documents", orjson.dumps(documents), x_chunk_index=str(batch[0].chunk)
                )
                if status != 200:
                    raise RuntimeError(f"/documents of {len(batch)} in chunk {batch[0].chunk}: {status} {data[:200]!r}")
            except BaseException:
                for doc in batch:
                    doc.writing = False  # written again by a later `document`
                raise
            for doc in batch:
                with contextlib.suppress(ValueError):
                    rank.pending.remove(doc)
            rank.written[batch[0].chunk] += len(batch)
            self.totals["documents written"] += len(batch)
            await self.complete_owed(rank)

    async def complete_owed(self, rank: Rank) -> None:
        """Advance `done_through` over the chunks written whole, completing the partial ones."""
        while True:
            chunk = rank.done_through + 1
            size = rank.partial.get(chunk, rank.records_per_chunk)
            if rank.written[chunk] < size or (chunk == rank.chunk and chunk not in rank.partial):
                return
            if chunk in rank.partial:
                started = time.perf_counter()
                rank.completing = True
                try:
                    status, _, data = await self.request(rank.number, "POST", f"/chunks/{chunk}/complete")
                finally:
                    rank.completing = False
                if status != 200:
                    raise RuntimeError(f"/chunks/{chunk}/complete: {status} {data[:200]!r}")
                if orjson.loads(data)["last_chunk_index"] == chunk:
                    rank.epoch += 1  # its files, cache included, are gone
                    self.totals["rank files removed"] += 1
                self.rec.done("complete", time.perf_counter() - started)
                self.totals["complete"] += 1
            else:
                self.totals["full chunks"] += 1
            del rank.written[chunk]
            rank.partial.pop(chunk, None)
            rank.done_through = chunk

    def active(self, elapsed: float, rest_s: float) -> list[Rank]:
        """The ranks working now: 0 and 1 always, 2 and 3 each resting every other `rest_s`, in turns."""
        turn = int(elapsed // rest_s) % 2
        return [r for r in self.ranks if r.number not in RESTING or RESTING[turn] != r.number]

    async def close(self) -> None:
        for client in self.clients:
            await client.close()


def digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


async def pace(rate: float, seconds: float, launch: Callable[[float], None]) -> None:
    """Call `launch(elapsed)` `rate` times a second for `seconds`: a token bucket refilled at `rate`
    and holding at most a second's worth, so a stalled loop catches up at most one second."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    tokens, last = 0.0, start
    while (now := loop.time()) - start < seconds:
        tokens = min(tokens + (now - last) * rate, rate)
        last = now
        while tokens >= 1:
            tokens -= 1
            launch(now - start)
        await asyncio.sleep(0.005)


class Probe(NamedTuple):
    """The proxy process at one moment: `t` seconds after the start; memory in KiB (anon: its heap and
    other private memory, what a leak grows; the rest of VmRSS is mapped files)."""

    t: float
    rss: int
    anon: int
    fds: int
    threads: int


def read_proc(pid: int, t: float) -> Probe:
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "RssAnon", "Threads"):
                fields[name] = int(value.split()[0])
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    return Probe(t, fields["VmRSS"], fields["RssAnon"], fds, fields["Threads"])


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run(args: argparse.Namespace, proxy_pid: int, upstream_pid: int, proxy: str) -> dict[str, Any]:
    """The load and the samples: `{"samples": [...], "probes": [Probe, ...], "totals": {...}}`."""
    load = Load(proxy, args.records_per_chunk, args.seed)
    mix = MIX if args.tasks else {**MIX, "task": 0.0}
    kinds, weights = list(mix), list(mix.values())
    in_flight: set[asyncio.Task[None]] = set()
    samples: list[dict[str, Any]] = []
    probes: list[Probe] = []
    started = time.monotonic()

    def cpu_used() -> dict[str, float]:
        """CPU seconds so far of the proxy, the upstream and this process (without them, its children)."""
        return {"proxy": cpu_seconds(proxy_pid), "upstream": cpu_seconds(upstream_pid), "load": time.process_time()}

    def launch(elapsed: float) -> None:
        if len(in_flight) >= MAX_IN_FLIGHT:
            load.rec.shed += 1
            return
        kind, rank = load.pick(load.rng.choices(kinds, weights)[0], elapsed, args.rest_s)
        task = asyncio.create_task(load.operation(kind, rank))
        in_flight.add(task)
        task.add_done_callback(in_flight.discard)

    async def probe() -> None:
        while True:
            before = time.monotonic()
            probes.append(read_proc(proxy_pid, round(before - started, 2)))
            await asyncio.sleep(PROBE_EVERY_S)
            # How late this loop woke: a stalled load generator (or machine) shows here, not in the proxy.
            load.rec.lag = max(load.rec.lag, time.monotonic() - before - PROBE_EVERY_S)

    async def sample_stats() -> bytes:
        """`/stats`; a failed fetch is an error of the run (judged as any other), not its end: tried again."""
        for _ in range(2):
            try:
                return (await load.request(0, "GET", "/stats"))[2]
            except HTTPClientError as exc:
                load.rec.error("stats", f"GET /stats: {exc!r}")
        return (await load.request(0, "GET", "/stats"))[2]

    async def sample(end: float) -> None:
        """A sample at the end of each interval, the last one at `end` (seconds after the start)."""
        cpu = cpu_used()
        last = started
        for at in itertools.count(args.interval, args.interval):
            await asyncio.sleep(started + at - time.monotonic())
            now = time.monotonic()
            rec, load.rec = load.rec, Recorder()
            used = cpu_used()
            stats = await sample_stats()
            samples.append(summary(rec, now - started, now - last, probes, {n: used[n] - cpu[n] for n in used}, stats))
            cpu, last = used, now
            print(progress(samples[-1]), file=sys.stderr, flush=True)
            if at >= end:
                return

    prober = asyncio.create_task(probe())
    sampler = asyncio.create_task(sample(args.duration))
    try:
        await pace(args.rate, args.duration, launch)
        await sampler
        await asyncio.gather(*in_flight)
    finally:
        prober.cancel()
        sampler.cancel()
        await load.close()
    return {"samples": samples, "probes": [p for p in probes if p.t <= args.duration], "totals": dict(load.totals)}


def summary(
    rec: Recorder, t: float, span: float, probes: list[Probe], cpu: dict[str, float], stats: bytes
) -> dict[str, Any]:
    """One sample: the interval `span` seconds long ending at `t`."""
    mine = [p for p in probes if t - span < p.t <= t] or probes[-1:]
    totals = orjson.loads(stats)
    forgotten = totals.get("forgotten", {})  # ranks past max_tracked_ranks, added up
    return {
        "t": round(t, 1),
        "requests_per_s": round(rec.requests / span, 1),
        "shed": rec.shed,
        "load_lag_ms": ms(rec.lag),
        "rss_mib": round(statistics.fmean(p.rss for p in mine) / 1024, 2),
        "rss_mib_max": round(max(p.rss for p in mine) / 1024, 2),
        "anon_mib": round(statistics.fmean(p.anon for p in mine) / 1024, 2),
        "fds": round(statistics.fmean(p.fds for p in mine), 1),
        "fds_max": max(p.fds for p in mine),
        "threads": max(p.threads for p in mine),
        "cpu_percent": {name: round(seconds * 100 / span, 1) for name, seconds in cpu.items()},
        "load_avg_1m": os.getloadavg()[0],
        "cpu_pressure": cpu_pressure(),
        "latency_ms": {
            kind: {"n": len(values), "p50": ms(quantile(values, 0.5)), "p99": ms(quantile(values, 0.99))}
            for kind, values in rec.latencies.items()
        },
        "errors": dict(rec.errors),
        "unexpected": dict(rec.unexpected),
        "examples": rec.examples,
        "stats": {
            "hit_ratio": totals["totals"]["hit_ratio"],
            "documents": totals["totals"]["documents"],
            "hits": totals["totals"]["hits"],
            "misses": totals["totals"]["misses"],
            "coalesced": totals["totals"]["coalesced"],
            "in_flight": totals["in_flight"],
            "owned_ranks": totals["owned_ranks"],
            "ranks_listed": len(totals["ranks"]),
            "ranks_forgotten": forgotten.get("ranks", 0),
            "chunks_published": sum(r.get("chunks_published", 0) for r in totals["ranks"])
            + forgotten.get("chunks_published", 0),
            "bytes": len(stats),
        },
    }


def cpu_pressure() -> float | None:
    """The share of the last 10 s in which some runnable task waited for a CPU (Linux PSI), if known:
    on a shared machine, what the latencies suffer from besides the proxy."""
    try:
        with open("/proc/pressure/cpu") as f:
            return float(f.readline().split()[1].removeprefix("avg10=")) / 100
    except (OSError, IndexError, ValueError):
        return None


def progress(s: dict[str, Any]) -> str:
    return (
        f"soak: t={s['t']:>6.0f}s {s['requests_per_s']:>6.0f} req/s rss={s['rss_mib']} MiB (anon {s['anon_mib']})"
        f" fds={s['fds']} threads={s['threads']}"
        f" cpu proxy {s['cpu_percent']['proxy']}% load {s['cpu_percent']['load']}%"
        f" errors={sum(s['errors'].values())} unexpected={sum(s['unexpected'].values())} shed={s['shed']}"
        f" lag={s['load_lag_ms']} ms"
    )


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


# -- the verdict ----------------------------------------------------------------------------

#: "Flat" (a leak only grows): over the second half of the run after the warm-up, the least-squares line
#: through the per-second readings rises by at most FIT_RISE of the half's mean (descriptors: by at most
#: FIT_RISE_FDS), and the last sample's mean is at most LAST_ABOVE (descriptors: LAST_ABOVE_FDS) above
#: the first sample's after the warm-up. Memory is RssAnon, the process's private memory: the rest of
#: VmRSS is mapped files (libraries), which the kernel drops and reads again as the machine needs.
#: Descriptors move with the ranks open and the connections in use at the moment (~7 a rank), hence
#: their wider margin.
FIT_RISE = 0.01
#: Memory is judged only when this much of the run follows its own warm-up (`--memory-warmup`).
MEMORY_JUDGED_FROM_S = 1800.0
#: Memory's warm-up in the long mode: a fresh proxy's private memory climbs until what it keeps bounded
#: is full (the counters of `max_tracked_ranks` ranks, at a new rank a second ~17 minutes; SQLite's
#: page caches; Python's and malloc's free lists at their working size). It took ~14 minutes under this
#: load with the heap's arenas capped (bench/README.md, "Soak"); judged from 5 minutes, that climb,
#: which stops, fails "last at most LAST_ABOVE above the first" however flat the rest of the hour is.
MEMORY_WARMUP_LONG_S = 1200.0
FIT_RISE_FDS = 2.0
LAST_ABOVE = 0.05
LAST_ABOVE_FDS = 0.10
#: "No drift": per kind, the last third of the run after the warm-up against its first third: the median
#: of the third's samples' p50s at most DRIFT_P50 times the first third's (plus DRIFT_FLOOR_MS), and the
#: median of their p99s at most DRIFT_P99 times (plus 5 DRIFT_FLOOR_MS): medians, because a sample's p99
#: is a few requests, which a stall of the shared machine delays. Kinds with fewer than DRIFT_MIN_N
#: requests in either third are not judged.
DRIFT_P50 = 1.5
DRIFT_P99 = 2.0
DRIFT_FLOOR_MS = 1.0
DRIFT_MIN_N = 30


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y over x."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0


def median_of(samples: list[dict[str, Any]], kind: str, quantile: str) -> float:
    """The median over `samples` (those with requests of `kind`) of their `quantile` ("p50", "p99")."""
    values: list[float] = [s["latency_ms"][kind][quantile] for s in samples if s["latency_ms"][kind]["n"]]
    return statistics.median(values)


def flatness(
    name: str,
    unit: str,
    probes: list[tuple[float, float]],
    samples: list[float],
    *,
    rise_limit: float,
    above: float,
    requests_per_s: float,
) -> dict[str, Any]:
    """Whether one resource stayed flat (see FIT_RISE): `probes` are (t, value) after the warm-up,
    `samples` the samples' means after it."""
    half = probes[len(probes) // 2 :]
    per_s = slope(half)
    span = half[-1][0] - half[0][0]
    first, last = samples[0], samples[-1]
    return {
        "name": name,
        "unit": unit,
        "first": first,
        "last": last,
        "change": (last - first) / first,
        "above_limit": above,
        "slope_per_h": per_s * 3600,
        "slope_per_request": per_s / requests_per_s,
        "fit_rise": per_s * span,
        "fit_rise_limit": rise_limit,
        "half_span_s": span,
        "flat": per_s * span <= rise_limit and last <= first * (1 + above),
    }


def verdict(result: dict[str, Any], warmup: float, memory_warmup: float | None = None) -> dict[str, Any]:
    """The run judged after `warmup` s, its memory after `memory_warmup` s (default: `warmup`)."""
    memory_warmup = warmup if memory_warmup is None else max(warmup, memory_warmup)
    samples = [s for s in result["samples"] if s["t"] > warmup]
    probes = [p for p in result["probes"] if p.t > warmup]
    if len(samples) < 3 or len(probes) < 10:
        raise SystemExit("soak: too short after the warm-up to judge: run longer, or lower --warmup")
    memory_samples = [s for s in samples if s["t"] > memory_warmup]
    memory_probes = [p for p in probes if p.t > memory_warmup]
    # A run that ends within memory's warm-up (`--long --duration 1200`) is still judged on the rest, and
    # saved: its memory is shown from the general warm-up, not judged.
    memory_short = len(memory_samples) < 3 or len(memory_probes) < 10
    if memory_short:
        memory_warmup, memory_samples, memory_probes = warmup, samples, probes
    rate = statistics.fmean(s["requests_per_s"] for s in samples)
    anon = [(p.t, p.anon / 1024) for p in memory_probes]
    half_mean = statistics.fmean(y for _, y in anon[len(anon) // 2 :])
    memory = flatness(
        "Memory (RssAnon)",
        "MiB",
        anon,
        [s["anon_mib"] for s in memory_samples],
        rise_limit=FIT_RISE * half_mean,
        above=LAST_ABOVE,
        requests_per_s=rate,
    )
    descriptors = flatness(
        "descriptors",
        "",
        [(p.t, float(p.fds)) for p in probes],
        [s["fds"] for s in samples],
        rise_limit=FIT_RISE_FDS,
        above=LAST_ABOVE_FDS,
        requests_per_s=rate,
    )
    third = len(samples) // 3
    early, late = samples[:third], samples[-third:]
    latency = {}
    for kind in KINDS:
        counts = [sum(s["latency_ms"][kind]["n"] for s in part) for part in (early, late)]
        if min(counts) < DRIFT_MIN_N:
            latency[kind] = {"judged": False, "n": counts}
            continue
        b50, a50 = (median_of(part, kind, "p50") for part in (early, late))
        b99, a99 = (median_of(part, kind, "p99") for part in (early, late))
        drift = a50 > DRIFT_P50 * b50 + DRIFT_FLOOR_MS or a99 > DRIFT_P99 * b99 + 5 * DRIFT_FLOOR_MS
        latency[kind] = {"judged": True, "n": counts, "before": (b50, b99), "after": (a50, a99), "drift": drift}
    errors = sum(sum(s["errors"].values()) for s in result["samples"])
    unexpected = sum(sum(s["unexpected"].values()) for s in result["samples"])
    shed = sum(s["shed"] for s in result["samples"])
    memory["judged"] = not memory_short and memory_probes[-1].t - memory_probes[0].t >= MEMORY_JUDGED_FROM_S
    memory["warmup"] = memory_warmup
    # For the record: the climb the memory warm-up leaves out, from the end of the general one.
    memory["since_warmup"] = (samples[0]["anon_mib"], memory_samples[0]["anon_mib"], samples[-1]["anon_mib"])
    descriptors["judged"] = True
    ok = (
        (memory["flat"] or not memory["judged"])
        and descriptors["flat"]
        and not any(v.get("drift") for v in latency.values())
        and errors == 0
        and unexpected == 0
    )
    return {
        "ok": ok,
        "memory": memory,
        "descriptors": descriptors,
        "latency": latency,
        "errors": errors,
        "unexpected": unexpected,
        "shed": shed,
    }


# -- the report -----------------------------------------------------------------------------

TABLE_KINDS = ("hit", "miss", "stream", "document")


def judgement(resource: dict[str, Any]) -> str:
    if not resource["judged"]:
        return f"not judged in a run this short (under {MEMORY_JUDGED_FROM_S / 60:.0f} minutes after the warm-up)"
    return "flat" if resource["flat"] else "NOT FLAT"


def thinned(samples: list[dict[str, Any]], rows: int = TABLE_ROWS) -> list[dict[str, Any]]:
    """About `rows` samples, evenly spread, the first and last included."""
    if len(samples) <= rows:
        return samples
    step = (len(samples) - 1) / (rows - 1)
    return [samples[round(i * step)] for i in range(rows)]


def cell(latency: dict[str, Any]) -> str:
    return "" if not latency["n"] else f"{latency['p50']:.1f} / {latency['p99']:.1f}"


def report(args: argparse.Namespace, result: dict[str, Any], judged: dict[str, Any]) -> str:
    proxy_log = result["proxy_log"]
    per_s = args.rate * MIX["task"] / sum(MIX.values())
    tasks = f"a new rank (`task`) {per_s:.1f} times a second" if vars(args).get("tasks", True) else "no new ranks"
    loads = [s["load_avg_1m"] for s in result["samples"]]
    pressures = [s["cpu_pressure"] for s in result["samples"] if s.get("cpu_pressure") is not None]
    pressure = f", CPU pressure {min(pressures):.0%} to {max(pressures):.0%}" if pressures else ""
    lines = [
        f"{result.get('date', '')}, Python {platform.python_version()}, {os.cpu_count()} cores,"
        f" {'--long' if args.long else 'short'} mode: {args.duration:.0f} s at {args.rate:g} operations/s"
        f" ({args.warmup:.0f} s warm-up), a sample every {args.interval:g} s, rank_idle_s {args.rank_idle_s:g},"
        f" records_per_chunk {args.records_per_chunk}, {tasks}. The machine: 1-minute load average {min(loads):.1f} to"
        f" {max(loads):.1f}{pressure} (PSI: the share of time some task waited for a CPU)",
        "",
        "| t (s) | req/s | RSS / anon MiB | fds | threads | proxy CPU % | "
        + " | ".join(f"{k} p50 / p99 ms" for k in TABLE_KINDS)
        + " | hit ratio | documents | owned ranks | load avg |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | "
        + " | ".join("---:" for _ in TABLE_KINDS)
        + " | ---: | ---: | --- | ---: |",
    ]
    for s in thinned(result["samples"]):
        stats = s["stats"]
        lines.append(
            f"| {s['t']:.0f} | {s['requests_per_s']:.0f} | {s['rss_mib']:.1f} / {s['anon_mib']:.1f} | {s['fds']:.0f}"
            f" | {s['threads']}"
            f" | {s['cpu_percent']['proxy']:.0f} | "
            + " | ".join(cell(s["latency_ms"][k]) for k in TABLE_KINDS)
            + f" | {stats['hit_ratio']} | {stats['documents']:,} | {','.join(map(str, stats['owned_ranks']))}"
            f" | {s['load_avg_1m']:.1f} |"
        )
    lines += [
        "",
        "| kind | requests | errors | unexpected | median p50 / p99 ms, first third | last third | drift |",
    ]
    lines.append("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for kind in KINDS:
        n = sum(s["latency_ms"][kind]["n"] for s in result["samples"])
        errors = sum(s["errors"].get(kind, 0) for s in result["samples"])
        unexpected = sum(s["unexpected"].get(kind, 0) for s in result["samples"])
        lat = judged["latency"][kind]
        if lat["judged"]:
            b, a = lat["before"], lat["after"]
            cells = f"{b[0]:.1f} / {b[1]:.1f} | {a[0]:.1f} / {a[1]:.1f} | {'DRIFT' if lat['drift'] else 'none'}"
        else:
            cells = f" | | too few to judge ({lat['n'][0]}, {lat['n'][1]})"
        lines.append(f"| {kind} | {n:,} | {errors} | {unexpected} | {cells} |")
    lines.append("")
    for resource in (judged["memory"], judged["descriptors"]):
        unit = f" {resource['unit']}" if resource["unit"] else ""
        warmup = resource.get("warmup", args.warmup)
        lines.append(
            f"- **{resource['name']}: {judgement(resource)}**. First sample after the"
            f" {warmup:.0f} s warm-up {resource['first']:.1f}{unit}, last {resource['last']:.1f}{unit}"
            f" ({resource['change']:+.1%},"
            f" limit +{resource['above_limit']:.0%}); second half: least-squares slope"
            f" {resource['slope_per_h']:+.2f}{unit}/h, a rise of {resource['fit_rise']:+.2f}{unit} over its"
            f" {resource['half_span_s']:.0f} s (limit {resource['fit_rise_limit']:.2f}{unit})"
            + (f", {resource['slope_per_request'] * 2**20:+.1f} bytes per request." if unit == "MiB" else ".")
        )
    memory = judged["memory"]
    if memory["warmup"] > args.warmup:
        at_warmup, at_memory_warmup, last_anon = memory["since_warmup"]
        lines.append(
            f"  Before its warm-up, from the end of the general one ({args.warmup:.0f} s): {at_warmup:.1f} MiB,"
            f" then {at_memory_warmup:.1f} at {memory['warmup']:.0f} s, {last_anon:.1f} at the end"
            f" ({last_anon / at_warmup - 1:+.1%} over the whole run after {args.warmup:.0f} s)."
        )
    drifted = [k for k, v in judged["latency"].items() if v.get("drift")]
    lines.append(
        f"- **Latency: {'drift in ' + ', '.join(drifted) if drifted else 'no drift'}** (last third against the"
        f" first, the medians of their samples' p50 and p99: p50 at most {DRIFT_P50}x + {DRIFT_FLOOR_MS:g} ms,"
        f" p99 at most {DRIFT_P99}x + {5 * DRIFT_FLOOR_MS:g} ms)."
    )
    lines.append(
        f"- **Errors {judged['errors']}, unexpected answers {judged['unexpected']}**; proxy log:"
        f" {proxy_log['errors']} ERROR lines, {proxy_log['tracebacks']} tracebacks. Operations shed (not judged:"
        f" {MAX_IN_FLIGHT} running at once means the proxy or the machine stalled, which the p99s show):"
        f" {judged['shed']}; this process's event loop woke at most"
        f" {max(s['load_lag_ms'] for s in result['samples']):.0f} ms late."
    )
    totals = result["totals"]
    last = result["samples"][-1]["stats"]
    lines.append(
        f"- Covered: {totals.get('documents written', 0):,} documents written, {last['chunks_published']:,} chunks"
        f" published, {totals.get('complete', 0):,} partial chunks completed ({totals.get('rank files removed', 0):,}"
        f" removing the rank's files), ranks released when idle {proxy_log['released']:,} times"
        f" ({proxy_log['released_ranks']}), {totals.get('coalesced answers', 0):,} coalesced answers,"
        f" {totals.get('disconnect', 0):,} streams dropped mid-way by the client, {totals.get('forward', 0):,}"
        f" forwarded requests; hit ratio {last['hit_ratio']}."
    )
    passed = "flat, no drift" if judged["memory"]["judged"] else "descriptors flat, no drift (memory not judged)"
    lines.append(f"- **Verdict: {passed if judged['ok'] else 'FAILED'}**.")
    examples = [e for s in result["samples"] for e in s["examples"]][:10]
    if examples:
        lines += ["", "First errors and surprises:", ""] + [f"- {e}" for e in examples]
    return "\n".join(lines)


def read_proxy_log(path: Path) -> dict[str, Any]:
    """What the proxy's log says of the run: idle releases (which ranks), errors, tracebacks."""
    released: Counter[str] = Counter()
    errors = tracebacks = 0
    with open(path, errors="replace") as f:
        for line in f:
            if " released ranks " in line:
                for rank in line.split("released ranks [", 1)[1].split("]", 1)[0].split(","):
                    released[rank.strip()] += 1
            elif " ERROR " in line:
                errors += 1
            elif line.startswith("Traceback"):
                tracebacks += 1
    shown = ", ".join(f"rank {r} {n}x" for r, n in sorted(released.items()))
    return {
        "released": sum(released.values()),
        "released_ranks": shown or "none",
        "errors": errors,
        "tracebacks": tracebacks,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--long", action="store_true", help="an hour (default: 3 minutes)")
    parser.add_argument("--duration", type=float, help="seconds of load (default: 180, or 3600 with --long)")
    parser.add_argument("--interval", type=float, help="seconds per sample (default: 10, or 30 with --long)")
    parser.add_argument(
        "--warmup", type=float, help="seconds left out of the verdict (default: 30, or 300 with --long)"
    )
    parser.add_argument(
        "--memory-warmup",
        type=float,
        help=f"seconds left out of the memory verdict (default: --warmup, or {MEMORY_WARMUP_LONG_S:.0f} with --long)",
    )
    parser.add_argument("--rate", type=float, default=200.0, help="operations per second")
    parser.add_argument("--rank-idle-s", type=float, default=2.0, help="the proxy's rank_idle_s")
    parser.add_argument("--rest-s", type=float, default=5.0, help="ranks 2 and 3 rest this long in turns")
    parser.add_argument("--records-per-chunk", type=int, default=40)
    parser.add_argument("--upstream-latency-ms", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--tasks",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="short jobs on new ranks (`task`); without them the proxy sees the 4 ranks only",
    )
    parser.add_argument("--json", type=Path, help="write the samples and the verdict here")
    parser.add_argument("--keep", action="store_true", help="keep the data directory (checkpoints, output, proxy log)")
    parser.add_argument(
        "--from-json", type=Path, help="run nothing: judge and report again the run saved in this file (--json)"
    )
    args = parser.parse_args()
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        warmup = args.warmup
        memory_warmup = args.memory_warmup
        vars(args).update({k: v for k, v in saved["settings"].items() if k not in ("json", "from_json")})
        args.warmup = saved["settings"]["warmup"] if warmup is None else warmup
        if memory_warmup is not None:
            args.memory_warmup = memory_warmup
        result = {**saved, "probes": [Probe(*p) for p in saved["probes"]]}
    else:
        args.duration = args.duration or (3600.0 if args.long else 180.0)
        args.interval = args.interval or (30.0 if args.long else 10.0)
        args.warmup = args.warmup if args.warmup is not None else (300.0 if args.long else 30.0)
        if args.rest_s <= args.rank_idle_s + 1:
            parser.error(
                f"--rest-s ({args.rest_s:g}) must exceed --rank-idle-s ({args.rank_idle_s:g}) by more than 1 s,"
                " so that a resting rank is released"
            )
        result = soak(args)
    if args.memory_warmup is None:  # neither given nor saved (a run saved before --memory-warmup existed)
        args.memory_warmup = MEMORY_WARMUP_LONG_S if args.long else args.warmup
    judged = verdict(result, args.warmup, args.memory_warmup)
    print(report(args, result, judged))
    if args.json:
        settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        saved = {"settings": settings, "probe_fields": Probe._fields, **result, "verdict": judged}
        args.json.write_text(json.dumps(saved, indent=1))
    sys.exit(0 if judged["ok"] else 1)


def soak(args: argparse.Namespace) -> dict[str, Any]:
    """The servers started, the load run, the servers stopped: `run()`'s result, the date and the proxy's log."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stopped: the servers are stopped too
    data = Path(tempfile.mkdtemp(prefix="soak-"))
    up_port, px_port = free_port(), free_port()
    proxy = f"http://127.0.0.1:{px_port}"
    try:
        with contextlib.ExitStack() as stack:
            up_pid = stack.enter_context(
                inferproxy("fake-upstream", f"--port={up_port}", f"--latency-ms={args.upstream_latency_ms:g}")
            )
            px_pid = stack.enter_context(
                inferproxy(
                    "serve",
                    f"--port={px_port}",
                    f"--upstream=http://127.0.0.1:{up_port}",
                    f"--checkpoints-dir={data}/checkpoints",
                    f"--output={data}/output",
                    f"--records-per-chunk={args.records_per_chunk}",
                    f"--rank-idle-s={args.rank_idle_s:g}",
                    log=data / "proxy.log",
                )
            )
            wait_until_up(f"http://127.0.0.1:{up_port}/v1/models")
            wait_until_up(f"{proxy}/healthz")
            print(f"soak: {args.duration:.0f} s at {args.rate:g} operations/s, data in {data}", file=sys.stderr)
            date = time.strftime("%Y-%m-%d")
            result = asyncio.run(run(args, px_pid, up_pid, proxy))
        return {"date": date, **result, "proxy_log": read_proxy_log(data / "proxy.log")}
    finally:
        if not args.keep:
            shutil.rmtree(data, ignore_errors=True)


if __name__ == "__main__":
    main()
