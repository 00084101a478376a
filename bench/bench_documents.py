"""The checkpoint service's write path and resume, against datatrove's CheckpointManager; resume and
cache hits at scale.

    python bench/bench_documents.py [--duration 8] [--parts writes,resume,cache]
        [--open-documents 100000,1000000] [--cached-answers 1000000,10000000]
        [--hit-entries 10000,1000000,10000000]

Measured in one run:
- writes: documents/s through `POST /documents` to `inferproxy serve` (fsync "always": each answer
  after its documents are fsynced), with wrk: single-document posts at concurrency 64, and
  batches of 100 documents; chunks of 1,000. The baseline: datatrove's
  `CheckpointManager.write_document` in-process (no fsync, no HTTP), 64 concurrent writers, the
  same documents, a real datatrove JsonlWriter as its output;
- resume: checkpoint dirs of open chunks of 1,000 documents (100k and 1M documents): the time from
  starting `inferproxy serve` on one to its first `/resume` answer, and the serve process's peak
  RSS (VmHWM); datatrove's `parse_existing_checkpoints` in-process at 100k for comparison;
- cache: rank-0 cache files of 10k, 1M and 10M answers (written straight into SQLite): start to
  first `/resume` and peak RSS as above, and the CPU per cache hit in-process (`profile_hit.py`'s
  harness) and per lookup, for three ways of picking the documents (`hit_documents`).
The data goes under the current directory (10M answers take ~2.7 GB).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import platform
import random
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import orjson

from app.http.connection import HTTPConnection
from app.service.app import create_server
from app.service.settings import Settings
from app.store.cache import DB_FILENAME, apply_migrations
from app.store.hashing import payload_hash

sys.path.insert(0, str(Path(__file__).parent))
from bench_proxy import cpu_seconds, inferproxy, wait_until_up, wrk
from ports import free_port
from profile_hit import ANSWER, CountingTransport
from profile_hit import BODY as HIT_BODY

TEXT = "lorem ipsum " * 45  # ~540 bytes, like a document with its rollouts

SINGLE = f"""
wrk.method = "POST"
counter = 0
request = function()
  local i = counter
  counter = counter + 1
  local body = '{{"id":"d-' .. i .. '","text":"{TEXT}"}}'
  local headers = {{["Content-Type"] = "application/json", ["X-Chunk-Index"] = tostring(math.floor(i / 1000))}}
  return wrk.format(nil, nil, headers, body)
end
"""

BATCH = f"""
wrk.method = "POST"
counter = 0
request = function()
  local b = counter
  counter = counter + 1
  local docs = {{}}
  for j = 0, 99 do
    docs[#docs + 1] = '{{"id":"d-' .. (b * 100 + j) .. '","text":"{TEXT}"}}'
  end
  local body = "[" .. table.concat(docs, ",") .. "]"
  local headers = {{["Content-Type"] = "application/json", ["X-Chunk-Index"] = tostring(math.floor(b / 10))}}
  return wrk.format(nil, nil, headers, body)
end
"""


async def datatrove_write_rate(n_docs: int) -> float:
    from datatrove.data import Document
    from datatrove.pipeline.inference.checkpointing import CheckpointManager
    from datatrove.pipeline.writers import JsonlWriter

    with tempfile.TemporaryDirectory(dir=".") as tmp:
        cm = CheckpointManager(os.path.join(tmp, "ckpt"), 1000)
        queue: asyncio.Queue[tuple[Document, int]] = asyncio.Queue()
        for i in range(n_docs):
            queue.put_nowait((Document(text=TEXT, id=f"d-{i}"), i // 1000))
        with JsonlWriter(
            os.path.join(tmp, "out"), output_filename="${rank}_chunk_${chunk_index}.jsonl", compression=None
        ) as ctx:

            async def writer() -> None:
                while not queue.empty():
                    doc, chunk = queue.get_nowait()
                    await cm.write_document(doc, 0, chunk, ctx)

            start = time.perf_counter()
            await asyncio.gather(*(writer() for _ in range(64)))
            return n_docs / (time.perf_counter() - start)


def make_open_chunks(root: Path, documents: int, per_chunk: int = 1000) -> None:
    """`documents` documents of ~560 bytes in open chunk files of `per_chunk` each, rank 0."""
    rank_dir = root / "00000"
    rank_dir.mkdir(parents=True)
    for c in range(-(-documents // per_chunk)):
        lines = b"".join(
            orjson.dumps(
                {"text": TEXT, "id": f"c{c}-{i}", "media": [], "metadata": {}}, option=orjson.OPT_APPEND_NEWLINE
            )
            for i in range(min(per_chunk, documents - c * per_chunk))
        )
        (rank_dir / f"chunk_{c:05d}.jsonl").write_bytes(lines)


def make_cache(root: Path, entries: int) -> None:
    """A rank-0 cache file of `entries` answers, one a document, written straight into SQLite in big
    transactions (ids in key order, so the primary key index only appends): ~270 bytes an entry on disk."""
    rank_dir = root / "00000"
    rank_dir.mkdir(parents=True)
    conn = sqlite3.connect(rank_dir / DB_FILENAME, isolation_level=None)
    conn.execute("PRAGMA journal_mode=OFF")  # a file built for the benchmark: no rollback needed
    conn.execute("PRAGMA synchronous=OFF")
    conn.execute("PRAGMA cache_size=-262144")
    apply_migrations(conn)
    digest = payload_hash(orjson.loads(HIT_BODY))
    # The rows are generated inside SQLite (no Python per row), in key order, so every index only appends.
    insert = (
        "WITH RECURSIVE n(i) AS (SELECT ?1 UNION ALL SELECT i + 1 FROM n WHERE i + 1 < ?2) "
        "INSERT INTO request_cache (chunk_index, doc_id, rollout_idx, payload_hash, result, status_code, "
        "content_type) SELECT i / 1000, printf('bench-%08d', i), 0, ?3, ?4, 200, 'application/json' FROM n"
    )
    step = 1_000_000
    for start in range(0, entries, step):
        conn.execute("BEGIN")
        conn.execute(insert, (start, min(entries, start + step), digest, ANSWER))
        conn.execute("COMMIT")
    conn.close()


def hit_doc(i: int) -> str:
    return f"bench-{i:08d}"


def vm_hwm_mib(pid: int) -> float:
    """The process's peak resident memory (VmHWM), MiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM in /proc/{pid}/status")


def serve_resume(checkpoints: Path, output: Path, records_per_chunk: int) -> tuple[float, float, int, float]:
    """(seconds from starting `inferproxy serve` to its first /resume answer, the CPU seconds the server
    used meanwhile, the processed ids listed, its peak RSS in MiB)."""
    port = free_port()
    start = time.monotonic()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "app.cli",
            "serve",
            f"--port={port}",
            "--upstream=http://127.0.0.1:9",
            f"--checkpoints-dir={checkpoints}",
            f"--output={output}",
            f"--records-per-chunk={records_per_chunk}",
            "--log-level=warning",
        ],
        stdout=subprocess.DEVNULL,
    )
    try:
        wait_until_up(f"http://127.0.0.1:{port}/healthz", timeout=120)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/resume", timeout=600) as answer:
            processed = len(orjson.loads(answer.read())["processed_ids"])
        seconds = time.monotonic() - start
        return seconds, cpu_seconds(proc.pid), processed, vm_hwm_mib(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


#: How the hits of `hit_costs` pick their documents among the cache's `entries`.
PATTERNS = ("in order", "latest", "anywhere")
#: The documents asked for, whatever the cache's size (the smallest cache measured holds that many): the
#: same work at every size, so what changes is only what the cache holds besides.
HIT_DOCUMENTS = 10_000


def hit_documents(pattern: str, entries: int, rng: random.Random) -> list[int]:
    """The documents a run of hits asks for, as each kind of client asks them:

    - "in order": a script run again from the start, its documents in the order first asked (consecutive
      ones from a random place);
    - "latest": a restarted job's replay, the documents of its open chunks, the newest answers (checkpoints
      drop a published chunk's answers, so those are all a chunked job's cache holds), in random order;
    - "anywhere": the worst case no replay makes, drawn at random from the whole cache.
    """
    count = min(entries, HIT_DOCUMENTS)
    if pattern == "in order":
        first = rng.randrange(entries - count + 1)
        return list(range(first, first + count))
    if pattern == "latest":
        return rng.sample(range(entries - count, entries), count)
    return [rng.randrange(entries) for _ in range(count)]


def hit_costs(checkpoints: Path, entries: int, requests: int = 200_000) -> dict[str, tuple[float, float]]:
    """Per pattern of `PATTERNS`: the CPU µs of a cache hit in-process (`profile_hit.py`'s harness), and of
    the cache's own lookup (`RequestCache.get_response`) alone."""
    import uvloop

    return uvloop.run(_hit_costs(checkpoints, entries, requests))


async def _hit_costs(checkpoints: Path, entries: int, requests: int) -> dict[str, tuple[float, float]]:
    settings = Settings(
        checkpoints_dir=checkpoints, upstream=["http://127.0.0.1:9"], rank_idle_s=0, port=0, records_per_chunk=2000
    )
    server = create_server(settings)
    await server.start()
    services = server.app.services  # type: ignore[attr-defined]
    cache = await services.caches.get(0)
    digest = payload_hash(orjson.loads(HIT_BODY))
    rng = random.Random(0)
    costs = {}
    for pattern in PATTERNS:
        docs = hit_documents(pattern, entries, rng)
        costs[pattern] = (await _app_hits(server, services, docs, requests), _lookups(cache, docs, digest))
    await server.shutdown()
    return costs


async def _app_hits(server: Any, services: Any, docs: list[int], requests: int) -> float:
    """CPU µs a hit through the whole app, `requests` hits cycling through `docs` after one warm-up pass."""
    batch = 32  # requests per read, as wrk's 64 connections deliver them
    docs = docs[: len(docs) // batch * batch]  # whole reads only
    reads = [b"".join(hit_request(doc) for doc in docs[i : i + batch]) for i in range(0, len(docs), batch)]
    conn = HTTPConnection(server)
    conn.connection_made(CountingTransport())
    for data in reads:  # warm up: every document once
        conn.data_received(data)
        await asyncio.sleep(0)
    hits_before = services.metrics.rank(0).hits
    start = time.process_time()
    done = 0
    while done < requests:
        conn.data_received(reads[(done // batch) % len(reads)])
        await asyncio.sleep(0)
        done += batch
    cost = (time.process_time() - start) / done * 1e6
    hits = services.metrics.rank(0).hits - hits_before
    assert hits == done, f"{hits} hits of {done} requests"
    conn.connection_lost(None)
    return cost


def _lookups(cache: Any, docs: list[int], digest: str) -> float:
    """CPU µs of `get_response` for a stored answer, the best of three passes over `docs`."""
    ids = [hit_doc(doc) for doc in docs]
    best = float("inf")
    for _ in range(3):
        start = time.process_time()
        found = sum(cache.get_response(doc_id, 0, digest) is not None for doc_id in ids)
        best = min(best, (time.process_time() - start) / len(ids) * 1e6)
        assert found == len(ids), f"{found} of {len(ids)} found"
    return best


def hit_request(doc: int) -> bytes:
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8080\r\nContent-Type: application/json\r\n"
        b"X-Doc-Id: %b\r\nContent-Length: %d\r\n\r\n%b" % (hit_doc(doc).encode(), len(HIT_BODY), HIT_BODY)
    )


async def datatrove_resume_seconds(checkpoints: Path, output: Path, records_per_chunk: int) -> float:
    from datatrove.pipeline.inference.checkpointing import CheckpointManager
    from datatrove.pipeline.writers import JsonlWriter

    start = time.monotonic()
    cm = CheckpointManager(str(checkpoints), records_per_chunk)
    with JsonlWriter(str(output), output_filename="${rank}_chunk_${chunk_index}.jsonl", compression=None) as ctx:
        await cm.parse_existing_checkpoints(0, ctx)
    return time.monotonic() - start


def sizes(text: str) -> list[int]:
    return [int(n) for n in text.split(",") if n]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=int, default=8)
    parser.add_argument("--parts", default="writes,resume,cache", help="which parts to run, comma-separated")
    parser.add_argument("--open-documents", type=sizes, default=[100_000, 1_000_000])
    parser.add_argument("--cached-answers", type=sizes, default=[1_000_000, 10_000_000])
    parser.add_argument("--hit-entries", type=sizes, default=[10_000, 1_000_000, 10_000_000])
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    import datatrove.pipeline.inference.checkpointing  # noqa: F401 (adds its log sink on import: removed next)
    from loguru import logger

    logger.remove()
    logging.disable(logging.WARNING)  # the in-process server's warnings about the unreachable upstream
    d = args.duration
    data = Path(tempfile.mkdtemp(prefix="bench-documents-", dir="."))
    print(f"# bench_documents: Python {platform.python_version()}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}")
    try:
        if "writes" in parts:
            print(write_rates(data, d))
        if "resume" in parts:
            print(open_chunk_resumes(data, args.open_documents))
        if "cache" in parts:
            print(cache_resumes_and_hits(data, args.cached_answers, args.hit_entries))
    finally:
        shutil.rmtree(data, ignore_errors=True)


def write_rates(data: Path, d: int) -> str:
    baseline = asyncio.run(datatrove_write_rate(10_000))
    rates = {}
    for name, script, per_request in (("single", SINGLE, 1), ("batch", BATCH, 100)):
        port = free_port()
        with inferproxy(
            "serve",
            f"--port={port}",
            "--upstream=http://127.0.0.1:9",
            f"--checkpoints-dir={data}/{name}",
            f"--output={data}/{name}-out",
            "--records-per-chunk=1000",
            "--log-level=warning",
        ):
            wait_until_up(f"http://127.0.0.1:{port}/healthz")
            result = wrk(f"http://127.0.0.1:{port}/documents", script, connections=64, duration=d, cpu_of={})
            rates[name] = result["rps"] * per_request
    lines = [
        f"wrk -t1 -c64 -d{d}s; chunks of 1,000; fsync always",
        "",
        "| measure | documents/s | ratio to datatrove in-process | target |",
        "| --- | ---: | ---: | ---: |",
        f"| datatrove write_document, in-process, 64 writers | {baseline:,.0f} | 1.0x | |",
    ]
    for name, label, target in (
        ("single", "POST /documents, 1 document, 64 concurrent", 2),
        ("batch", "POST /documents, batches of 100, 64 concurrent", 10),
    ):
        ratio = rates[name] / baseline
        verdict = "ok" if ratio >= target else "MISSED"
        lines.append(f"| {label} | {rates[name]:,.0f} | {ratio:.1f}x | >= {target}x {verdict} |")
    return "\n".join(lines) + "\n"


def open_chunk_resumes(data: Path, counts: list[int]) -> str:
    lines = [
        "| resume of open chunks of 1,000 documents (records_per_chunk 2,000) | seconds | server CPU s "
        "| peak RSS MiB | target |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for documents in counts:
        where = data / f"open-{documents}"
        make_open_chunks(where, documents)
        os.sync()  # the files' write-back must not overlap the measurement
        if documents <= 100_000:  # datatrove holds every document in memory at once: 1M takes minutes
            shutil.copytree(where, data / "open-dt")
            theirs = asyncio.run(datatrove_resume_seconds(data / "open-dt", data / "open-dt-out", 2000))
            shutil.rmtree(data / "open-dt")
            lines.append(
                f"| datatrove parse_existing_checkpoints, in-process, {documents:,} documents | {theirs:.2f} | | | |"
            )
        seconds, cpu, processed, rss = serve_resume(where, data / f"open-{documents}-out", 2000)
        assert processed == documents, f"/resume listed {processed} ids of {documents}"
        verdict = "ok" if seconds < 2 and rss < 200 else "MISSED"
        target = f"< 2 s, < 200 MiB {verdict}" if documents >= 1_000_000 else ""
        lines.append(
            f"| inferproxy serve: start to first /resume answer, {documents:,} documents | {seconds:.2f} | {cpu:.2f} "
            f"| {rss:.0f} | {target} |"
        )
        shutil.rmtree(where)
    return "\n".join(lines) + "\n"


def cache_resumes_and_hits(data: Path, answers: list[int], hit_entries: list[int]) -> str:
    resumes = [
        "| cache of N answers (one a document) | build s | file MiB | serve: start to /resume s | server CPU s "
        "| peak RSS MiB |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    hits = [
        "| entries | "
        + " | ".join(f"CPU µs a hit, {p}" for p in PATTERNS)
        + " | "
        + " | ".join(f"µs a lookup, {p}" for p in PATTERNS)
        + " |",
        "| ---: |" + " ---: |" * 2 * len(PATTERNS),
    ]
    for entries in sorted(set(answers) | set(hit_entries)):
        where = data / f"cache-{entries}"
        free = shutil.disk_usage(data).free
        if free < entries * 400:
            raise SystemExit(
                f"{entries:,} cache entries need ~{entries * 300 / 2**30:.1f} GiB, {free / 2**30:.1f} free"
            )
        started = time.monotonic()
        make_cache(where, entries)
        build = time.monotonic() - started
        os.sync()
        size = sum(f.stat().st_size for f in (where / "00000").iterdir()) / 2**20
        if entries in answers:
            seconds, cpu, _, rss = serve_resume(where, data / "cache-out", 2000)
            resumes.append(f"| {entries:,} | {build:.1f} | {size:,.0f} | {seconds:.2f} | {cpu:.2f} | {rss:.0f} |")
        if entries in hit_entries:
            costs = hit_costs(where, entries)
            hits.append(
                f"| {entries:,} | "
                + " | ".join(f"{costs[p][0]:.2f}" for p in PATTERNS)
                + " | "
                + " | ".join(f"{costs[p][1]:.2f}" for p in PATTERNS)
                + " |"
            )
        shutil.rmtree(where)
    return "\n".join(resumes) + "\n\n" + "\n".join(hits) + "\n"


if __name__ == "__main__":
    main()
