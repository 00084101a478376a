"""A batch job built on app.checkpoints.manager, run as a real process by the kill -9 tests.

usage: python library_job.py CHECKPOINTS OUTPUT N_DOCS RECORDS_PER_CHUNK CONCURRENCY

Prints one line per event, flushed at once, for the parent to read:
RESUME <docs_to_skip> <json list of processed ids>, GEN <id> (a fresh generation),
HIT <id> (replayed from the cache), ACK <id> (write_document returned), DONE.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys

from datatrove.data import Document
from datatrove.pipeline.writers import JsonlWriter

from app.checkpoints import CheckpointManager, RequestCache


def say(*parts: object) -> None:
    sys.stdout.write(" ".join(str(p) for p in parts) + "\n")
    sys.stdout.flush()


async def main(checkpoints: str, output: str, n_docs: int, records_per_chunk: int, concurrency: int) -> None:
    cache = RequestCache(checkpoints, flush_interval_ms=5)
    await cache.initialize(0)
    cm = CheckpointManager(checkpoints, records_per_chunk, request_cache=cache)
    docs = [Document(text=f"document {i}", id=f"doc-{i}") for i in range(n_docs)]
    done = False
    try:
        with JsonlWriter(output, output_filename="${rank}_chunk_${chunk_index}.jsonl", compression=None) as ctx:
            skip, processed = await cm.parse_existing_checkpoints(0, ctx)
            say("RESUME", skip, json.dumps(sorted(processed)))
            semaphore = asyncio.Semaphore(concurrency)

            async def rollout(doc: Document, chunk_index: int) -> None:
                async with semaphore:
                    key = cache.prepare_payload({"prompt": doc.text})
                    result, _ = await cache.get_cached_response(doc.id, 0, payload_hash=key)
                    if result is None:
                        await asyncio.sleep(random.uniform(0.001, 0.005))  # the GPU at work
                        result = {"text": f"answer to {doc.text}"}
                        await cache.store_result(chunk_index, doc.id, 0, result, payload_hash=key)
                        say("GEN", doc.id)
                    else:
                        say("HIT", doc.id)
                    doc.metadata["rollout_results"] = [result]
                    await cm.write_document(doc, 0, chunk_index, ctx)
                    await cache.mark_document_complete(doc.id)
                    say("ACK", doc.id)

            todo, last_chunk = cm.remaining(docs, skip, processed)
            await asyncio.gather(*(rollout(doc, chunk_index) for doc, chunk_index in todo))
            await cm.cleanup_last_chunk(0, last_chunk)
            done = True
    finally:
        await cache.close(delete_file=done)
    say("DONE")


if __name__ == "__main__":
    ckpt, out, n, rpc, conc = sys.argv[1:6]
    asyncio.run(main(ckpt, out, int(n), int(rpc), int(conc)))
