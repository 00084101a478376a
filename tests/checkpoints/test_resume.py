"""Restoring checkpoints at scale: ids only for a writer that needs no documents, the same resume point
whichever path is taken (and as datatrove's), nothing written before every chunk is validated."""

from __future__ import annotations

import os
import random
import shutil
import tracemalloc
from pathlib import Path
from typing import Any

import orjson
import pytest
from datatrove.pipeline.inference.checkpointing import CheckpointManager as DatatroveCheckpointManager
from datatrove.pipeline.writers import JsonlWriter

from app.checkpoints.documents import Document
from app.checkpoints.publish import ChunkPublisher
from app.checkpoints.resume import read_chunk_file, read_chunk_ids
from app.service.settings import Settings
from app.store.durable import CorruptFileError
from app.tools.inspect import inspect_dir
from tests.factories import RecordingWriter, chunk_ids, chunk_path, last_chunk_path, manager, write_chunk_file
from tests.servers import proxy_client

RPC = 1000
OPEN_CHUNKS = range(5, 75)  # chunks 0..4 are published: last_chunk is 4


class IdsOnlyWriter(RecordingWriter):
    """A writer that, like `ChunkPublisher`, renders chunks from their checkpoint files."""

    needs_documents = False


def line(doc_id: str, **metadata: Any) -> bytes:
    return orjson.dumps({"text": f"text of {doc_id}", "id": doc_id, "media": [], "metadata": metadata}) + b"\n"


def large_checkpoints(root: Path) -> tuple[tuple[int, set[str]], set[str]]:
    """~50k documents in the open chunks 5..74 (chunks 5 and 7 full, the others not), a stale published
    chunk file, a repeated id and removed documents; returns what restoring them returns, and the ids
    of the documents that are not removed."""
    rng = random.Random(11)
    os.makedirs(os.path.dirname(last_chunk_path(root)))
    Path(last_chunk_path(root)).write_text("4")
    write_chunk_file(root, 3, ["stale-1", "stale-2"])  # left by a crash after last_chunk moved past chunk 3
    ids: set[str] = set()
    kept: set[str] = set()
    for chunk in OPEN_CHUNKS:
        count = RPC if chunk in (5, 7) else rng.randrange(RPC // 2, RPC)
        chunk_ids = [f"{rng.getrandbits(64):016x}-{chunk}" for _ in range(count)]
        lines = [
            line(doc_id, __no_rollouts_remove=True) if i % 97 == 0 else line(doc_id)
            for i, doc_id in enumerate(chunk_ids)
        ]
        if chunk == 9:
            lines.append(line(chunk_ids[0]))  # written twice (a retried write): counted once
        Path(chunk_path(root, chunk)).write_bytes(b"".join(lines))
        ids.update(chunk_ids)
        kept.update(doc_id for i, doc_id in enumerate(chunk_ids) if i % 97)
    # Restoring publishes the full chunk 5 and moves last_chunk to it; chunk 7 waits behind chunk 6.
    return (6 * RPC, ids), kept


async def restore(root: Path, writer: Any) -> tuple[tuple[int, set[str]], tuple[int, list[str]], dict[int, int]]:
    cm = manager(root, RPC)
    result = await cm.parse_existing_checkpoints(0, writer)
    return result, cm.resume_state(), dict(cm.per_chunk_counts)


async def test_a_large_dir_resumes_the_same_with_ids_only_with_documents_and_in_datatrove(tmp_path: Path) -> None:
    expected, kept = large_checkpoints(tmp_path / "ids")
    for copy in ("documents", "datatrove", "service"):
        shutil.copytree(tmp_path / "ids", tmp_path / copy)
    inspected = inspect_dir(str(tmp_path / "ids"), records_per_chunk=RPC).ranks[0].resume

    ids_only, with_documents = IdsOnlyWriter(), RecordingWriter()
    fast = await restore(tmp_path / "ids", ids_only)
    full = await restore(tmp_path / "documents", with_documents)
    datatrove = DatatroveCheckpointManager(str(tmp_path / "datatrove"), RPC)
    with JsonlWriter(str(tmp_path / "dt-out"), output_filename="${rank}_chunk_${chunk_index}.jsonl") as ctx:
        theirs = await datatrove.parse_existing_checkpoints(0, ctx)

    assert fast == full
    assert fast[0] == theirs == expected
    skip, processed = fast[1]
    assert inspected is not None
    assert (inspected.docs_to_skip, inspected.processed_ids) == (skip, frozenset(processed))
    assert processed == sorted(expected[1] - {doc_id for doc_id in expected[1] if doc_id.endswith("-5")})
    assert ids_only.writes == []
    assert sorted(w[0] for w in with_documents.writes) == sorted(kept)  # each once, removed ones left out
    assert ids_only.closed == with_documents.closed == ["00000_chunk_5.jsonl", "00000_chunk_7.jsonl"]
    assert not os.path.exists(chunk_path(tmp_path / "ids", 3))

    settings = Settings(
        upstream=["http://127.0.0.1:9"],
        checkpoints_dir=tmp_path / "service",
        output=str(tmp_path / "out"),
        records_per_chunk=RPC,
    )
    (tmp_path / "out").mkdir()
    for chunk in range(5):  # what a real run would have published before last_chunk moved past it
        (tmp_path / "out" / f"00000_chunk_{chunk}.jsonl").write_bytes(b"")
    async with proxy_client(settings) as client:
        resume = (await client.get("/resume")).json()
    assert (resume["docs_to_skip"], resume["processed_ids"]) == (skip, processed)
    published = (tmp_path / "out" / "00000_chunk_5.jsonl").read_bytes().splitlines()
    assert len(published) == RPC - len(range(0, RPC, 97))  # removed documents left out


async def test_a_torn_last_line_is_cut_off_on_the_ids_only_path_too(tmp_path: Path) -> None:
    write_chunk_file(tmp_path, 0, ["a", "b"])
    with open(chunk_path(tmp_path, 0), "ab") as f:
        f.write(b'{"text": "half a docu')
    cm = manager(tmp_path, 4)
    assert await cm.parse_existing_checkpoints(0, IdsOnlyWriter()) == (0, {"a", "b"})
    await cm.write_document(Document(text="c", id="c"), 0, 0, IdsOnlyWriter())
    assert chunk_ids(tmp_path, 0) == ["a", "b", "c"]  # the new line is whole, not glued onto the torn one


@pytest.mark.parametrize("needs_documents", [True, False])
async def test_a_corrupt_chunk_is_refused_before_anything_is_written_or_counted(
    tmp_path: Path, needs_documents: bool
) -> None:
    write_chunk_file(tmp_path, 0, ["a", "b", "c"])  # full: restoring would publish it
    write_chunk_file(tmp_path, 1, ["d"])
    with open(chunk_path(tmp_path, 2), "wb") as f:
        f.write(line("e") + b"not json\n" + line("f"))
    writer = RecordingWriter() if needs_documents else IdsOnlyWriter()
    cm = manager(tmp_path, 3)
    with pytest.raises(CorruptFileError, match=r"chunk_00002.jsonl: line 2 is not valid JSON"):
        await cm.parse_existing_checkpoints(0, writer)
    assert (writer.writes, writer.closed) == ([], [])
    assert (cm.last_chunk_index, dict(cm.per_chunk_counts), cm._chunks) == (-1, {}, {})
    assert os.path.exists(chunk_path(tmp_path, 0))


@pytest.mark.parametrize("returning_ids", [True, False], ids=["parse_existing_checkpoints", "restore"])
async def test_restoring_for_the_publisher_holds_ids_not_documents(tmp_path: Path, returning_ids: bool) -> None:
    """Memory, not time: 200k documents of ~1 KiB in open chunks cost their ids, not their text; and
    `restore` (the proxy's way) not the returned set either."""
    documents = 200_000
    text = "x" * 1000
    for chunk in range(documents // RPC):
        ids = (f"doc-{chunk * RPC + i:08d}" for i in range(RPC - 1))  # one short of full: all stay open
        Path(chunk_path(tmp_path, chunk)).parent.mkdir(exist_ok=True)
        Path(chunk_path(tmp_path, chunk)).write_bytes(
            b"".join(orjson.dumps({"text": text, "id": i}) + b"\n" for i in ids)
        )
    count = documents // RPC * (RPC - 1)
    cm = manager(tmp_path, RPC)
    publisher = ChunkPublisher(str(tmp_path / "out"), str(tmp_path))
    tracemalloc.start()
    try:
        if returning_ids:
            skip, processed = await cm.parse_existing_checkpoints(0, publisher)
        else:
            skip, processed = await cm.restore(0, publisher), set()
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert skip == 0
    assert len(processed) == (count if returning_ids else 0)
    assert len(cm.resume_state()[1]) == count
    # An id is a ~61-byte str plus a slot in its chunk's set, and in the returned set if there is one;
    # its document (what restoring held before) is over 1 KiB.
    held_limit, peak_limit = (200, 250) if returning_ids else (120, 120)
    assert held / count < held_limit, f"{held / count:.0f} bytes held per document"
    assert peak / count < peak_limit, f"{peak / count:.0f} bytes at the peak per document"


@pytest.mark.parametrize(
    "content",
    [
        b"",
        line("a") + line("b") + line("a"),  # an id twice
        line("a") + b"\n  \n" + b' {"id": "b", "text": "t"} \r\n',  # blank lines, blanks around a record
        line("a") + b'{"id": "b", "text": "t"}',  # a last line that parses but has no newline: torn
        line("a") + b'{"id": "b", "te',  # torn mid-line
        line("a") + b"\0\0\0",  # garbage a power cut left
        line("a") + b'{"id": 7}\n',  # an id that is not a string
        line("a") + b"[1, 2]\n",  # a record that is not an object
        line("a") + b'{"text": "no id"}\n' + line("b"),
        line("a") + b"not json\n" + line("b"),  # not a torn append: refused
    ],
)
def test_reading_a_chunk_for_its_ids_agrees_with_decoding_its_documents(tmp_path: Path, content: bytes) -> None:
    def outcome(read: Any, name: str) -> Any:
        path = str(tmp_path / name)
        Path(path).write_bytes(content)
        try:
            return read(path)
        except ValueError as exc:
            return type(exc), str(exc).replace(path, "<chunk file>")

    documents = outcome(lambda path: read_chunk_file(path, 3, Document.from_dict), "documents")
    scan = outcome(lambda path: read_chunk_ids(path, 3), "ids")
    if isinstance(documents, tuple):
        assert scan == documents  # the same error, the same message
    else:
        assert scan.ids == {document.id for document in documents}
        assert (scan.first or {}).get("id") == (documents[0].id if documents else None)
    assert (tmp_path / "ids").read_bytes() == (tmp_path / "documents").read_bytes()  # the same repair
