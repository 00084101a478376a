"""app.publish: how a chunk is uploaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from app.publish import ChunkPublisher


def test_an_s3_chunk_is_uploaded_with_one_put_up_to_five_gib(tmp_path: Path) -> None:
    """s3fs turns a pipe_file of 100 MiB or more into a multipart upload unless told otherwise."""
    publisher = ChunkPublisher("s3://bucket/run", str(tmp_path))
    calls: list[tuple[str, int, dict[str, Any]]] = []

    class Recorder:
        def pipe_file(self, path: str, data: bytes, **kwargs: Any) -> None:
            calls.append((path, len(data), kwargs))

    publisher._fs = Recorder()
    (tmp_path / "00000").mkdir()
    (tmp_path / "00000" / "chunk_00000.jsonl").write_text('{"id": "a", "text": "x"}\n')
    name = publisher._get_output_filename(None, 0, chunk_index=0)
    publisher.close_file(name)
    assert calls == [("bucket/run/00000_chunk_0.jsonl", 22, {"chunksize": 5 * 2**30})]
