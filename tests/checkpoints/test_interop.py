"""Checkpoint dirs are interchangeable with datatrove's CheckpointManager, both ways."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from datatrove.data import Document, Media
from datatrove.pipeline.inference.checkpointing import CheckpointManager as DatatroveCheckpointManager
from datatrove.pipeline.writers import JsonlWriter

from app.checkpoints.manager import CheckpointManager

TEMPLATE = "${rank}_chunk_${chunk_index}.jsonl"
RPC = 4


def make_docs(n: int = 15) -> list[Document]:
    docs = []
    for i in range(n):
        metadata: dict[str, Any] = {"i": i, "unicode": "é中😀", "nested": {"x": [1.5, None, True]}}
        if i == 5:
            metadata["__no_rollouts_remove"] = True
        media = [Media(id=f"m{i}", type=0, url=f"https://example.invalid/{i}.png", metadata={"w": 3})] if i % 4 else []
        docs.append(Document(text=f"document {i}", id=f"doc-{i}", media=media, metadata=metadata))
    return docs


async def write_scenario(cm: Any, output: Path) -> None:
    """Chunks 0 and 2 complete, chunk 1 half-written, chunk 3 started: a job killed mid-way."""
    docs = make_docs()
    plan = [(docs[i], 0) for i in range(0, 4)] + [(docs[i], 2) for i in range(8, 12)]
    plan += [(docs[i], 1) for i in (4, 5)] + [(docs[12], 3)]
    with JsonlWriter(str(output), output_filename=TEMPLATE, compression=None) as ctx:
        for doc, chunk_index in plan:
            await cm.write_document(doc, 0, chunk_index, ctx)


async def resume_and_finish(cm: Any, output: Path) -> tuple[int, set[str]]:
    """What a restarted job does, in one writer context as datatrove's runner: resume, skip, write the rest."""
    docs = make_docs()
    with JsonlWriter(str(output), output_filename=TEMPLATE, compression=None) as ctx:
        skip, processed = await cm.parse_existing_checkpoints(0, ctx)
        result = (skip, set(processed))
        snapshot = (cm.last_chunk_index, dict(cm.per_chunk_counts))
        gen = cm.chunk_index_gen()
        last = 0
        for position, doc in enumerate(docs):
            last = next(gen)
            if position < skip or doc.id in processed:
                continue
            await cm.write_document(doc, 0, last, ctx)
        await cm.cleanup_last_chunk(0, last)
    cm.resumed_state = snapshot
    return result


def output_files(output: Path) -> dict[str, list[str]]:
    return {
        f.name: [json.loads(line)["id"] for line in f.read_text().splitlines() if line.strip()]
        for f in sorted(output.glob("*.jsonl"))
    }


@pytest.mark.parametrize("writer_tool", ["datatrove", "inferproxy"])
async def test_both_tools_resume_a_checkpoint_dir_with_the_same_numbers_and_outputs(
    tmp_path: Path, writer_tool: str
) -> None:
    written = tmp_path / "written"
    tool = DatatroveCheckpointManager if writer_tool == "datatrove" else CheckpointManager
    await write_scenario(tool(str(written), RPC), tmp_path / "first-output")
    for name in ("datatrove", "inferproxy"):  # each resumes its own copy of the dir and the output
        shutil.copytree(written, tmp_path / f"for-{name}")
        shutil.copytree(tmp_path / "first-output", tmp_path / f"out-{name}")

    theirs = DatatroveCheckpointManager(str(tmp_path / "for-datatrove"), RPC)
    ours = CheckpointManager(str(tmp_path / "for-inferproxy"), RPC)
    their_result = await resume_and_finish(theirs, tmp_path / "out-datatrove")
    our_result = await resume_and_finish(ours, tmp_path / "out-inferproxy")
    assert our_result == their_result == (4, {f"doc-{i}" for i in (4, 5, 8, 9, 10, 11, 12)})
    # after the resume: chunk 2 complete again but waiting for chunk 1, chunk 3 open
    assert theirs.resumed_state == ours.resumed_state == (0, {1: 2, 2: 4, 3: 1})
    # and either finishes the job from there: every document published exactly once
    expected = sorted(f"doc-{i}" for i in range(15) if i != 5)
    for name in ("datatrove", "inferproxy"):
        published = [doc_id for ids in output_files(tmp_path / f"out-{name}").values() for doc_id in ids]
        assert sorted(published) == expected, name
    assert output_files(tmp_path / "out-inferproxy") == output_files(tmp_path / "out-datatrove")


async def test_checkpoint_lines_are_byte_identical_to_datatrove(tmp_path: Path) -> None:
    await write_scenario(DatatroveCheckpointManager(str(tmp_path / "dt"), RPC), tmp_path / "o1")
    await write_scenario(CheckpointManager(str(tmp_path / "ip"), RPC), tmp_path / "o2")
    for name in ("chunk_00001.jsonl", "chunk_00003.jsonl"):
        assert (tmp_path / "ip" / "00000" / name).read_bytes() == (tmp_path / "dt" / "00000" / name).read_bytes()
    assert (tmp_path / "ip" / "last_chunk" / "00000.txt").read_text() == "0"
    assert (tmp_path / "dt" / "last_chunk" / "00000.txt").read_text() == "0"
