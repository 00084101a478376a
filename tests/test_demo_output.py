"""The demo's output check reads what the publisher writes, whatever characters the model produced."""

from __future__ import annotations

from pathlib import Path

from app.checkpointing import CheckpointManager
from app.demo import DemoOptions, demo_documents, verify_output
from app.documents import Document
from app.publish import ChunkPublisher


async def test_the_output_check_reads_documents_whose_text_holds_unicode_line_separators(tmp_path: Path) -> None:
    # str.splitlines() also splits at U+2028 and U+0085, which JSON (and the publisher) leave unescaped.
    odd = "one\u2028two\u0085three"
    options = DemoOptions(workdir=tmp_path, documents=2, rollouts=2)
    cm = CheckpointManager(str(tmp_path / "ckpt"), 2)
    with ChunkPublisher(str(tmp_path / "output"), str(tmp_path / "ckpt")) as publisher:
        for doc in demo_documents(2):
            results = [{"text": odd, "finish_reason": "stop"}] * 2
            await cm.write_document(
                Document(text=odd, id=doc.id, metadata={"rollout_results": results}), 0, 0, publisher
            )
    assert odd.encode() in (tmp_path / "output" / "00000_chunk_0.jsonl").read_bytes()  # raw, as a model wrote it
    assert verify_output(options) == (2, 1)
