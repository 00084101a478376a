from __future__ import annotations

import os
from pathlib import Path

import pytest
from datatrove.data import Document as DatatroveDocument
from datatrove.pipeline.writers import JsonlWriter

from app.checkpointing import CheckpointManager
from app.output import ChunkOutputWriter
from tests.factories import document


def test_a_chunk_file_appears_only_when_closed_and_then_whole(tmp_path: Path) -> None:
    writer = ChunkOutputWriter(str(tmp_path))
    writer.write(document("a"), rank=0, chunk_index=3)
    writer.write(document("b"), rank=0, chunk_index=3)
    assert not (tmp_path / "00000_chunk_3.jsonl").exists()
    writer.close_file("00000_chunk_3.jsonl")
    assert (tmp_path / "00000_chunk_3.jsonl").read_text().count("\n") == 2
    assert os.listdir(tmp_path) == ["00000_chunk_3.jsonl"]


def test_closing_a_file_never_written_publishes_nothing(tmp_path: Path) -> None:
    ChunkOutputWriter(str(tmp_path)).close_file("00000_chunk_0.jsonl")
    assert os.listdir(tmp_path) == []


def test_a_failed_job_leaves_no_output_and_a_restart_starts_the_chunk_afresh(tmp_path: Path) -> None:
    def failing_job() -> None:
        with ChunkOutputWriter(str(tmp_path)) as writer:
            writer.write(document("a"), rank=0, chunk_index=0)
            raise RuntimeError("job died")

    with pytest.raises(RuntimeError, match="job died"):
        failing_job()
    assert not (tmp_path / "00000_chunk_0.jsonl").exists()
    with ChunkOutputWriter(str(tmp_path)) as writer:
        writer.write(document("b"), rank=0, chunk_index=0)
    assert '"id":"b"' in (tmp_path / "00000_chunk_0.jsonl").read_text()
    assert '"id":"a"' not in (tmp_path / "00000_chunk_0.jsonl").read_text()


def test_names_and_lines_match_datatrove_jsonl_writer(tmp_path: Path) -> None:
    docs = [DatatroveDocument(text=f"t{i}", id=f"d{i}", metadata={"k": i} if i else {}) for i in range(3)]
    template = "${rank}/part_${chunk_index}.jsonl"
    with JsonlWriter(str(tmp_path / "dt"), output_filename=template, compression=None) as theirs:
        for doc in docs:
            theirs.write(doc, rank=2, chunk_index=7)
    with ChunkOutputWriter(str(tmp_path / "ip"), template) as ours:
        assert ours._get_output_filename(docs[0], 2, chunk_index=7) == theirs._get_output_filename(
            docs[0], 2, chunk_index=7
        )
        for doc in docs:
            ours.write(doc, rank=2, chunk_index=7)
    assert (tmp_path / "ip/00002/part_7.jsonl").read_bytes() == (tmp_path / "dt/00002/part_7.jsonl").read_bytes()


async def test_as_checkpoint_output_a_chunk_of_removed_documents_publishes_no_file(tmp_path: Path) -> None:
    cm = CheckpointManager(str(tmp_path / "ckpt"), 2)
    with ChunkOutputWriter(str(tmp_path / "out")) as writer:
        for doc_id in ("a", "b"):
            await cm.write_document(document(doc_id, __no_rollouts_remove=True), 0, 0, writer)
        await cm.write_document(document("c"), 0, 1, writer)
        await cm.write_document(document("d"), 0, 1, writer)
    assert os.listdir(tmp_path / "out") == ["00000_chunk_1.jsonl"]
    assert cm.last_chunk_index == 1
