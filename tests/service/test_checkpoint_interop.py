"""The checkpoint service and datatrove's CheckpointManager read each other's checkpoint dirs."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from datatrove.data import Document
from datatrove.pipeline.inference.checkpointing import CheckpointManager as DatatroveCheckpointManager
from datatrove.pipeline.writers import JsonlWriter

from app.service.settings import Settings
from tests.servers import proxy_client

# Under both servers: the app must behave the same under the built-in one and under uvicorn.
pytestmark = pytest.mark.usefixtures("http_server")

RPC = 4


def settings(tmp_path: Path, checkpoints: Path) -> Settings:
    return Settings(
        upstream=["http://127.0.0.1:9"],
        checkpoints_dir=checkpoints,
        output=str(tmp_path / "out"),
        records_per_chunk=RPC,
    )


async def datatrove_resume(checkpoints: Path, output: Path) -> tuple[int, set[str]]:
    manager = DatatroveCheckpointManager(str(checkpoints), RPC)
    with JsonlWriter(str(output), output_filename="${rank}_chunk_${chunk_index}.jsonl", compression=None) as ctx:
        result: tuple[int, set[str]] = await manager.parse_existing_checkpoints(0, ctx)
    return result


async def test_a_dir_written_by_datatrove_is_resumed_by_the_service(tmp_path: Path) -> None:
    written = tmp_path / "written"
    manager = DatatroveCheckpointManager(str(written), RPC)
    plan = [(f"d{i}", 0) for i in range(4)] + [(f"d{i}", 2) for i in range(8, 12)] + [("d4", 1), ("d5", 1)]
    with JsonlWriter(
        str(tmp_path / "dt-out"), output_filename="${rank}_chunk_${chunk_index}.jsonl", compression=None
    ) as ctx:
        for doc_id, chunk in plan:
            await manager.write_document(Document(text=f"text {doc_id}", id=doc_id), 0, chunk, ctx)
    shutil.copytree(written, tmp_path / "copy")
    expected = await datatrove_resume(tmp_path / "copy", tmp_path / "copy-out")

    # The proxy publishes where datatrove's writer did (what it published is checked against last_chunk).
    shutil.copytree(tmp_path / "dt-out", tmp_path / "out")
    async with proxy_client(settings(tmp_path, written)) as client:
        resume = (await client.get("/resume")).json()
    assert (resume["docs_to_skip"], set(resume["processed_ids"])) == expected
    assert expected == (4, {"d4", "d5", "d8", "d9", "d10", "d11"})
    # chunk 2 was complete on disk: the service published it on start
    assert (tmp_path / "out" / "00000_chunk_2.jsonl").read_text().count("\n") == 4


async def test_a_dir_written_by_the_service_is_resumed_by_datatrove(tmp_path: Path) -> None:
    checkpoints = tmp_path / "ckpt"
    async with proxy_client(settings(tmp_path, checkpoints)) as client:

        async def post(ids: list[str], chunk: int) -> Any:
            body = [{"id": i, "text": f"text {i}"} for i in ids]
            return await client.post("/documents", json=body, headers={"X-Chunk-Index": str(chunk)})

        await post(["a", "b", "c", "d"], 0)
        await post(["e", "f"], 1)
        await post(["i", "j", "k", "l"], 2)
        resume = (await client.get("/resume")).json()
    assert await datatrove_resume(checkpoints, tmp_path / "dt-out") == (
        resume["docs_to_skip"],
        set(resume["processed_ids"]),
    )
    assert resume["docs_to_skip"] == 4


async def test_what_datatroves_writer_can_serialize_the_job_client_and_the_library_take_as_it_writes_it(
    tmp_path: Path,
) -> None:
    # A rollout's score from a model is a numpy scalar; a ParquetReader's timestamp a datetime subclass.
    # datatrove's JsonlWriter writes them; the proxy refused every such document (the task exited 1).
    import datetime

    import numpy as np

    from app.checkpoints.manager import CheckpointManager as LibraryCheckpointManager
    from app.checkpoints.publish import ChunkPublisher
    from app.job.client import ProxyJob
    from tests.servers import serve_proxy

    class Stamp(datetime.datetime):  # as pandas.Timestamp: a subclass orjson refuses
        pass

    def documents() -> list[Document]:
        return [
            Document(
                text=f"text {i}",
                id=f"d{i}",
                metadata={
                    "score": np.float32(0.25 * i),
                    "tokens": np.int64(i),
                    "kept": np.bool_(i % 2),
                    "when": Stamp(2026, 12, 2, 10, i),
                    "day": np.datetime64("2026-12-02"),
                },
            )
            for i in range(RPC)
        ]

    with JsonlWriter(str(tmp_path / "dt"), output_filename="${rank}_chunk_${chunk_index}.jsonl", compression=None) as w:
        for document in documents():
            w.write(document, rank=0, chunk_index=0)
    expected = (tmp_path / "dt" / "00000_chunk_0.jsonl").read_bytes()

    async with serve_proxy(settings(tmp_path, tmp_path / "ckpt")) as url:
        job = ProxyJob(url)
        try:
            for document in documents():
                await job.write_document(document, 0)
            assert (await job.resume()).last_chunk_index == 0
        finally:
            await job.close()
    assert (tmp_path / "out" / "00000_chunk_0.jsonl").read_bytes() == expected

    manager = LibraryCheckpointManager(str(tmp_path / "lib-ckpt"), RPC)
    with ChunkPublisher(str(tmp_path / "lib-out"), str(tmp_path / "lib-ckpt")) as writer:
        for document in documents():
            await manager.write_document(document, 0, 0, writer)
        await manager.close()
    assert (tmp_path / "lib-out" / "00000_chunk_0.jsonl").read_bytes() == expected
