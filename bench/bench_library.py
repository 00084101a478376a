"""inferproxy's library vs datatrove's, on the same workload, in the same run.

    python bench/bench_library.py [--entries 100000] [--datatrove-stores 5000] [--docs 10000]

Measures (ratios are ours / datatrove's):
- cache stores/s: store_result() calls until flush() returns (everything durable);
- cache lookups/s: get_cached_response() hits on a table of `--entries` rows;
- write_document docs/s with 64 concurrent writers, ours with fsync "always",
  datatrove's as it is (no fsync): once with a real datatrove JsonlWriter as
  the output (the same ~30 us per document for both, which caps the ratio),
  once with an output writer that does nothing (the checkpointing alone).
datatrove commits each stored row on its own (~750/s), so it stores a smaller
sample (`--datatrove-stores`); a rate is a rate.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import tempfile
import time
from collections.abc import Callable
from typing import Any

from datatrove.data import Document
from datatrove.pipeline.inference.checkpointing import CheckpointManager as DatatroveCheckpointManager
from datatrove.pipeline.inference.checkpointing import RequestCache as DatatroveRequestCache
from datatrove.pipeline.writers import JsonlWriter

from app.checkpoints import CheckpointManager, RequestCache

RESULT = {
    "text": "The weather in Tokyo is mild today, with light wind from the east. " * 4,
    "finish_reason": "stop",
    "usage": {"prompt_tokens": 31, "completion_tokens": 72, "total_tokens": 103},
}


def key(i: int) -> tuple[str, str]:
    return f"doc-{i}", f"{i:032x}"


async def stores(cache: Any, n: int) -> float:
    start = time.perf_counter()
    for i in range(n):
        doc_id, h = key(i)
        await cache.store_result(i // 1000, doc_id, 0, RESULT, payload_hash=h)
    await cache.flush()
    return n / (time.perf_counter() - start)


async def lookups(cache: Any, n: int, entries: int) -> float:
    rng = random.Random(0)
    picks = [key(rng.randrange(entries)) for _ in range(n)]
    start = time.perf_counter()
    for doc_id, h in picks:
        result, _ = await cache.get_cached_response(doc_id, 0, payload_hash=h)
        assert result is not None
    return n / (time.perf_counter() - start)


async def bench_cache(entries: int, datatrove_stores: int, n_lookups: int) -> dict[str, float]:
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        ours = RequestCache(os.path.join(tmp, "ours"))
        await ours.initialize(0)
        out["ours_store"] = await stores(ours, entries)
        await ours.close()

        theirs = DatatroveRequestCache(os.path.join(tmp, "theirs"))
        await theirs.initialize(0)
        out["theirs_store"] = await stores(theirs, datatrove_stores)
        await theirs.close()

        # both look up in the same 100k-row file, written by ours above
        for name, cls in (("ours", RequestCache), ("theirs", DatatroveRequestCache)):
            cache = cls(os.path.join(tmp, "ours"))
            await cache.initialize(0)
            out[f"{name}_lookup"] = await lookups(cache, n_lookups, entries)
            await cache.close()
    return out


class NullWriter:
    """An output writer that drops everything: what remains is the checkpointing's own cost."""

    def write(self, document: Any, rank: int = 0, **kwargs: Any) -> None:
        pass

    def close_file(self, original_name: str) -> None:
        pass

    def _get_output_filename(self, document: Any, rank: int | str = 0, chunk_index: int | None = None) -> str:
        return f"{rank}_{chunk_index}"

    def __enter__(self) -> NullWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


async def write_documents(make: Callable[[str], Any], n_docs: int, *, jsonl: bool, writers: int = 64) -> float:
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        cm = make(os.path.join(tmp, "checkpoints"))
        docs = [Document(text=f"document {i} " + "lorem ipsum " * 40, id=f"doc-{i}") for i in range(n_docs)]
        for doc in docs:
            doc.metadata["rollout_results"] = [RESULT]
        gen = cm.chunk_index_gen()
        plan = [(doc, next(gen)) for doc in docs]
        queue: asyncio.Queue[tuple[Document, int]] = asyncio.Queue()
        for item in plan:
            queue.put_nowait(item)
        out = os.path.join(tmp, "output")
        template = "${rank}_chunk_${chunk_index}.jsonl"
        with JsonlWriter(out, output_filename=template, compression=None) if jsonl else NullWriter() as ctx:

            async def writer() -> None:
                while not queue.empty():
                    doc, chunk_index = queue.get_nowait()
                    await cm.write_document(doc, 0, chunk_index, ctx)

            start = time.perf_counter()
            await asyncio.gather(*(writer() for _ in range(writers)))
            elapsed = time.perf_counter() - start
        return n_docs / elapsed


async def best_of(runs: int, make: Callable[[str], Any], n_docs: int, *, jsonl: bool) -> float:
    """The best rate of a few runs: on a shared machine, noise only ever slows a run down."""
    return max([await write_documents(make, n_docs, jsonl=jsonl) for _ in range(runs)])


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--datatrove-stores", type=int, default=5_000)
    parser.add_argument("--lookups", type=int, default=50_000)
    parser.add_argument("--docs", type=int, default=10_000)
    parser.add_argument("--records-per-chunk", type=int, default=1_000)
    args = parser.parse_args()

    import logging

    from loguru import logger as loguru_logger

    loguru_logger.remove()  # datatrove logs every chunk file it creates
    logging.disable(logging.INFO)

    cache = await bench_cache(args.entries, args.datatrove_stores, args.lookups)
    rpc = args.records_per_chunk
    docs: dict[tuple[str, bool], float] = {}
    for jsonl in (True, False):
        docs["ours", jsonl] = await best_of(2, lambda d: CheckpointManager(d, rpc), args.docs, jsonl=jsonl)
        docs["theirs", jsonl] = await best_of(2, lambda d: DatatroveCheckpointManager(d, rpc), args.docs, jsonl=jsonl)

    rows = [
        ("cache stores/s (until flushed)", cache["ours_store"], cache["theirs_store"], 30),
        (f"cache lookups/s ({args.entries:,} entries)", cache["ours_lookup"], cache["theirs_lookup"], 5),
        ("write_document docs/s, 64 writers, JsonlWriter output", docs["ours", True], docs["theirs", True], 5),
        ("write_document docs/s, 64 writers, no output", docs["ours", False], docs["theirs", False], 5),
    ]
    print(f"# bench_library: {platform.python_version()} on {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}")
    print("| measure | inferproxy | datatrove | ratio | target |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, ours, theirs, target in rows:
        ratio = ours / theirs
        verdict = "ok" if ratio >= target else "MISSED"
        print(f"| {name} | {ours:,.0f} | {theirs:,.0f} | {ratio:.1f}x | >= {target}x {verdict} |")


if __name__ == "__main__":
    asyncio.run(main())
