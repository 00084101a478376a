"""The checkpoint service's write path and resume, against datatrove's CheckpointManager.

    python bench/bench_documents.py [--duration 8]

Measured in one run:
- documents/s through `POST /documents` to `inferproxy serve` (fsync "always": each answer
  after its documents are fsynced), with wrk: single-document posts at concurrency 64, and
  batches of 100 documents; chunks of 1,000;
- the baseline: datatrove's `CheckpointManager.write_document` in-process (no fsync, no HTTP),
  64 concurrent writers, the same documents, a real datatrove JsonlWriter as its output;
- resume: a checkpoint dir of 100 open chunks x 1,000 documents (100k documents): the time
  from starting `inferproxy serve` on it to its first `/resume` answer, and the time of the
  same `parse_existing_checkpoints` in-process for datatrove.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).parent))
from bench_proxy import free_port, inferproxy, wait_until_up, wrk

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


def make_open_chunks(root: Path, chunks: int = 100, per_chunk: int = 1000) -> None:
    rank_dir = root / "00000"
    rank_dir.mkdir(parents=True)
    for c in range(chunks):
        lines = b"".join(
            orjson.dumps(
                {"text": TEXT, "id": f"c{c}-{i}", "media": [], "metadata": {}}, option=orjson.OPT_APPEND_NEWLINE
            )
            for i in range(per_chunk)
        )
        (rank_dir / f"chunk_{c:05d}.jsonl").write_bytes(lines)


def serve_resume_seconds(checkpoints: Path, output: Path, records_per_chunk: int) -> tuple[float, int]:
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
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/resume", timeout=60) as answer:
            processed = len(orjson.loads(answer.read())["processed_ids"])
        return time.monotonic() - start, processed
    finally:
        proc.terminate()
        proc.wait(timeout=60)


async def datatrove_resume_seconds(checkpoints: Path, output: Path, records_per_chunk: int) -> float:
    from datatrove.pipeline.inference.checkpointing import CheckpointManager
    from datatrove.pipeline.writers import JsonlWriter

    start = time.monotonic()
    cm = CheckpointManager(str(checkpoints), records_per_chunk)
    with JsonlWriter(str(output), output_filename="${rank}_chunk_${chunk_index}.jsonl", compression=None) as ctx:
        await cm.parse_existing_checkpoints(0, ctx)
    return time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=int, default=8)
    args = parser.parse_args()
    from loguru import logger

    logger.remove()
    d = args.duration
    data = Path(tempfile.mkdtemp(prefix="bench-documents-"))
    try:
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
                result = wrk(f"http://127.0.0.1:{port}/documents", script, connections=64, duration=d)
                rates[name] = result["rps"] * per_request
        make_open_chunks(data / "resume")
        shutil.copytree(data / "resume", data / "resume-dt")
        ours, processed = serve_resume_seconds(data / "resume", data / "resume-out", 2000)
        theirs = asyncio.run(datatrove_resume_seconds(data / "resume-dt", data / "resume-dt-out", 2000))
    finally:
        shutil.rmtree(data, ignore_errors=True)

    print(f"# bench_documents: Python {platform.python_version()}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}")
    print(f"wrk -t1 -c64 -d{d}s; chunks of 1,000; fsync always")
    print()
    print("| measure | documents/s | ratio to datatrove in-process | target |")
    print("| --- | ---: | ---: | ---: |")
    print(f"| datatrove write_document, in-process, 64 writers | {baseline:,.0f} | 1.0x | |")
    for name, label, target in (
        ("single", "POST /documents, 1 document, 64 concurrent", 2),
        ("batch", "POST /documents, batches of 100, 64 concurrent", 10),
    ):
        ratio = rates[name] / baseline
        print(f"| {label} | {rates[name]:,.0f} | {ratio:.1f}x | >= {target}x {'ok' if ratio >= target else 'MISSED'} |")
    print()
    print("| resume of 100 open chunks x 1,000 documents | seconds | target |")
    print("| --- | ---: | ---: |")
    verdict = "ok" if ours < 5 else "MISSED"
    print(f"| inferproxy serve: start to first /resume answer ({processed:,} ids) | {ours:.2f} | < 5 s {verdict} |")
    print(f"| datatrove parse_existing_checkpoints, in-process | {theirs:.2f} | |")


if __name__ == "__main__":
    main()
