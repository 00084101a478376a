"""datatrove's own checkpoint tests (tests/pipeline/inference/test_inference.py and
tests/pipeline/text/test_request_cache.py), ported with our classes swapped in for
theirs and a real datatrove JsonlWriter as the output. Scenarios that go through
datatrove's InferenceRunner are replayed here with the calls the runner makes."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import pytest
from datatrove.data import Document
from datatrove.pipeline.writers import JsonlWriter

from app.checkpoints.manager import CheckpointManager, RequestCache

TEMPLATE = "${rank}_chunk_${chunk_index}.jsonl"


def output_writer(path: Path) -> JsonlWriter:
    return JsonlWriter(str(path), output_filename=TEMPLATE, compression=None)


def lines(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.strip()]


def read_output_files(output_path: Path) -> tuple[list[dict[str, object]], list[Path]]:
    files = sorted(output_path.glob("*_chunk_*.jsonl"))
    return [json.loads(line) for f in files for line in lines(f)], files


def seed_two_chunks(tmp_path: Path) -> Path:
    checkpoints = tmp_path / "checkpoints"
    rank_dir = checkpoints / "00000"
    rank_dir.mkdir(parents=True)
    chunk_0 = [Document(text="chunk0-a", id="0"), Document(text="chunk0-b", id="1")]
    (rank_dir / "chunk_00000.jsonl").write_text("".join(json.dumps(dataclasses.asdict(doc)) + "\n" for doc in chunk_0))
    (rank_dir / "chunk_00001.jsonl").write_text(
        json.dumps(dataclasses.asdict(Document(text="chunk1-a", id="2"))) + "\n"
    )
    return checkpoints


def test_parse_existing_checkpoints_skips_replay_for_existing_full_chunk(tmp_path: Path) -> None:
    checkpoints = seed_two_chunks(tmp_path)
    output = tmp_path / "output"
    output.mkdir()
    (output / "00000_chunk_0.jsonl").write_text('{"text":"chunk0-a","id":"0"}\n{"text":"chunk0-b","id":"1"}\n')
    cm = CheckpointManager(checkpoints_local_dir=str(checkpoints), records_per_chunk=2)
    with output_writer(output) as ctx:
        skip, processed = asyncio.run(cm.parse_existing_checkpoints(rank=0, output_writer_context=ctx))
    assert skip == 2
    assert processed == {"0", "1", "2"}
    assert len(lines(output / "00000_chunk_0.jsonl")) == 2
    assert len(lines(output / "00000_chunk_1.jsonl")) == 1
    assert not (checkpoints / "00000" / "chunk_00000.jsonl").exists()
    assert (checkpoints / "00000" / "chunk_00001.jsonl").exists()


def test_parse_existing_checkpoints_skips_chunks_before_last_chunk(tmp_path: Path) -> None:
    checkpoints = seed_two_chunks(tmp_path)
    (checkpoints / "last_chunk").mkdir()
    (checkpoints / "last_chunk" / "00000.txt").write_text("0")
    output = tmp_path / "output"
    output.mkdir()
    cm = CheckpointManager(checkpoints_local_dir=str(checkpoints), records_per_chunk=2)
    with output_writer(output) as ctx:
        skip, processed = asyncio.run(cm.parse_existing_checkpoints(rank=0, output_writer_context=ctx))
    assert skip == 2
    assert processed == {"2"}
    assert not (output / "00000_chunk_0.jsonl").exists()  # the stale chunk 0 was not read
    assert len(lines(output / "00000_chunk_1.jsonl")) == 1
    docs_after_resume = []
    for index, doc in enumerate([Document(text=f"d{i}", id=str(i)) for i in range(5)]):
        if index < skip:
            continue
        if doc.id in processed:
            processed.remove(doc.id)
            continue
        docs_after_resume.append(doc.id)
    assert docs_after_resume == ["3", "4"]


async def test_request_cache_store_and_fetch(tmp_path: Path) -> None:
    cache = RequestCache(str(tmp_path))
    await cache.initialize(rank=0)
    payload = {"prompt": "hello"}
    result = {"text": "world", "finish_reason": "stop", "usage": {"prompt_tokens": 1}, "reasoning": "scratchpad"}
    payload_hash = cache.prepare_payload(payload)
    assert await cache.get_cached_response("doc-1", 0, payload_hash=payload_hash) == (None, None)
    await cache.store_result(0, "doc-1", 0, result, payload_hash=payload_hash)
    await cache.store_error(0, "doc-2", 0, "boom", payload_hash=payload_hash)
    await cache.flush()

    resume_cache = RequestCache(str(tmp_path))
    await resume_cache.initialize(rank=0)
    assert await resume_cache.get_cached_response("doc-1", 0, payload_hash=payload_hash) == (result, None)
    assert await resume_cache.get_cached_response("doc-2", 0, payload_hash=payload_hash) == (None, "boom")
    await resume_cache.mark_document_complete("doc-1")
    assert await resume_cache.get_cached_response("doc-1", 0, payload_hash=payload_hash) == (None, None)
    await resume_cache.drop_chunk(0)
    await resume_cache.close(delete_file=True)
    await cache.close()
    assert not list(tmp_path.glob("*/replay.sqlite3"))


async def test_request_cache_keeps_keyword_calls_and_extra_keys(tmp_path: Path) -> None:
    # test_cached_request_defaults_missing_reasoning / test_request_cache_preserves_model_on_replay
    cache = RequestCache(str(tmp_path / "checkpoints"))
    await cache.initialize(rank=0)
    payload = {"messages": [{"role": "user", "content": "hello"}]}
    payload_hash = cache.prepare_payload(payload)
    stored = {"text": "cached answer", "finish_reason": "stop", "usage": {"prompt_tokens": 1}, "model": "m-1"}
    await cache.store_result(chunk_index=0, doc_id="doc-1", rollout_idx=0, result=stored, payload_hash=payload_hash)
    await cache.close()
    replay = RequestCache(str(tmp_path / "checkpoints"))
    await replay.initialize(rank=0)
    assert await replay.get_cached_response("doc-1", 0, payload_hash=payload_hash) == (stored, None)
    await replay.close()


async def test_skip_bad_requests_advances_checkpoint_progress(tmp_path: Path) -> None:
    checkpoints, output = tmp_path / "checkpoints", tmp_path / "output"
    cache = RequestCache(str(checkpoints))
    await cache.initialize(0)
    cm = CheckpointManager(str(checkpoints), 2, request_cache=cache)
    docs = [Document(text=f"bad doc {i}", id=f"bad-{i}") for i in range(3)]
    with output_writer(output) as ctx:
        assert await cm.parse_existing_checkpoints(0, ctx) == (0, set())
        gen = cm.chunk_index_gen()
        chunk_index = 0
        for doc in docs:
            chunk_index = next(gen)
            doc.metadata.update({"rollout_results": [], "__no_rollouts_remove": True})
            await cm.write_document(doc, 0, chunk_index, ctx)
            await cache.mark_document_complete(doc.id)
        await cm.cleanup_last_chunk(0, chunk_index)
    await cache.close(delete_file=True)
    for name in ("00000_chunk_0.jsonl", "00000_chunk_1.jsonl"):
        assert not (output / name).exists() or not (output / name).read_text().strip()
    assert (checkpoints / "last_chunk" / "00000.txt").read_text().strip() == "1"
    assert not (checkpoints / "00000").exists()


async def run_like_inference_runner(
    checkpoints: Path, output: Path, docs: list[Document], *, fail_after: int | None, concurrency: int
) -> None:
    """The calls InferenceRunner makes: resume, skip, bounded concurrent rollouts, write, clean up."""
    cache = RequestCache(str(checkpoints))
    await cache.initialize(0)
    cm = CheckpointManager(str(checkpoints), 10, request_cache=cache)
    completed = False
    processed_count = 0
    try:
        with output_writer(output) as ctx:
            skip, processed = await cm.parse_existing_checkpoints(0, ctx)
            semaphore = asyncio.Semaphore(concurrency)

            async def rollout(doc: Document, chunk_index: int) -> None:
                nonlocal processed_count
                async with semaphore:
                    processed_count += 1
                    if fail_after is not None and processed_count > fail_after:
                        raise RuntimeError(f"Simulated failure after processing {fail_after} documents")
                    key = cache.prepare_payload({"messages": [{"role": "user", "content": doc.text}]})
                    result, _ = await cache.get_cached_response(doc.id, 0, payload_hash=key)
                    if result is None:
                        result = {"text": f"answer to {doc.text}", "finish_reason": "stop", "usage": {}}
                        await cache.store_result(chunk_index, doc.id, 0, result, payload_hash=key)
                    doc.metadata["rollout_results"] = [result]
                    await cm.write_document(doc, 0, chunk_index, ctx)
                    await cache.mark_document_complete(doc.id)

            tasks = []
            gen = cm.chunk_index_gen()
            last_chunk = 0
            for position, doc in enumerate(docs):
                last_chunk = next(gen)
                if position < skip or doc.id in processed:
                    continue
                tasks.append(rollout(doc, last_chunk))
            await asyncio.gather(*tasks)
            await cm.cleanup_last_chunk(0, last_chunk)
            completed = True
    finally:
        await cache.close(delete_file=completed)


def test_checkpoint_recovery_and_completeness(tmp_path: Path) -> None:
    checkpoints, output = tmp_path / "checkpoints", tmp_path / "output"

    def make_documents() -> list[Document]:
        return [Document(text=f"Test document {i}", id=str(i)) for i in range(35)]

    with pytest.raises(RuntimeError, match="Simulated failure"):
        asyncio.run(run_like_inference_runner(checkpoints, output, make_documents(), fail_after=22, concurrency=2))
    assert list(checkpoints.rglob("chunk_*.jsonl"))
    assert int((checkpoints / "last_chunk" / "00000.txt").read_text()) == 1
    partial_docs, _ = read_output_files(output)
    assert 0 < len(partial_docs) <= 22

    asyncio.run(run_like_inference_runner(checkpoints, output, make_documents(), fail_after=None, concurrency=2))
    final_docs, final_files = read_output_files(output)
    ids = [doc["id"] for doc in final_docs]
    assert len(ids) == len(set(ids)) == 35
    assert set(ids) == {str(i) for i in range(35)}
    assert [len(lines(f)) for f in final_files] == [10, 10, 10, 5]
    for doc in final_docs:
        results = doc["metadata"]["rollout_results"]  # type: ignore[index]
        assert results
        assert all({"text", "finish_reason", "usage"} <= set(r) for r in results)


def test_complete_pipeline_with_various_scenarios(tmp_path: Path) -> None:
    checkpoints, output = tmp_path / "checkpoints", tmp_path / "output"
    docs = [Document(text="What's the weather in Tokyo?", id=str(i)) for i in range(1005)]

    async def run() -> None:
        cm = CheckpointManager(str(checkpoints), 500)
        with output_writer(output) as ctx:
            gen = cm.chunk_index_gen()
            pairs = [(doc, next(gen)) for doc in docs]
            semaphore = asyncio.Semaphore(10)

            async def one(doc: Document, chunk_index: int) -> None:
                async with semaphore:
                    await cm.write_document(doc, 0, chunk_index, ctx)

            await asyncio.gather(*(one(d, c) for d, c in pairs))
            await cm.cleanup_last_chunk(0, 2)

    asyncio.run(run())
    final_docs, files = read_output_files(output)
    assert {doc["id"] for doc in final_docs} == {str(i) for i in range(1005)}
    assert sorted(len(lines(f)) for f in files) == [5, 500, 500]
