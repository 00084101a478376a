"""`ChunkPublisher` as the library's output writer: whole files, datatrove's lines, resume from the output."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any, ClassVar

import pytest
from datatrove.data import Document as DatatroveDocument
from datatrove.pipeline.writers import JsonlWriter

from app.checkpoints.manager import CheckpointManager
from app.checkpoints.publish import ChunkPublisher, PublishError
from app.checkpoints.resume import last_published_chunk
from app.store.layout import OutputNames
from tests.factories import chunk_path, document, documents, manager
from tests.faults import SimulatedCrash
from tests.waiting import eventually


async def test_a_chunk_file_appears_only_when_complete_and_then_whole(tmp_path: Path) -> None:
    cm = manager(tmp_path / "ckpt", 2)
    with ChunkPublisher(str(tmp_path / "out"), str(tmp_path / "ckpt")) as writer:
        await cm.write_document(document("a"), 0, 3, writer)
        assert not (tmp_path / "out").exists()
        await cm.write_document(document("b"), 0, 3, writer)
        assert (tmp_path / "out" / "00000_chunk_3.jsonl").read_text().count("\n") == 2
    assert os.listdir(tmp_path / "out") == ["00000_chunk_3.jsonl"]


async def test_a_publication_cut_by_a_crash_leaves_nothing_behind_once_the_chunk_is_published(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def crash(src: str, dst: str) -> None:
        raise SimulatedCrash(f"the process dies before renaming {src} to {dst}")

    def dead(path: str) -> None:
        """A dead process cleans nothing up."""

    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    cm = manager(ckpt, 2)
    with ChunkPublisher(str(out), str(ckpt)) as writer:
        await cm.write_document(document("a"), 0, 0, writer)
        monkeypatch.setattr(os, "replace", crash)
        monkeypatch.setattr(os, "unlink", dead)
        with pytest.raises(SimulatedCrash):
            await cm.write_document(document("b"), 0, 0, writer)
        monkeypatch.undo()
    assert [name for name in os.listdir(out) if not name.startswith(".")] == []
    # the restart publishes the full chunk, and removes the crash's temporary file
    with ChunkPublisher(str(out), str(ckpt)) as writer:
        await manager(ckpt, 2).parse_existing_checkpoints(0, writer)
    assert os.listdir(out) == ["00000_chunk_0.jsonl"]


async def test_a_chunk_of_removed_documents_publishes_no_file(tmp_path: Path) -> None:
    cm = CheckpointManager(str(tmp_path / "ckpt"), 2)
    with ChunkPublisher(str(tmp_path / "out"), str(tmp_path / "ckpt")) as writer:
        for doc_id in ("a", "b"):
            await cm.write_document(document(doc_id, __no_rollouts_remove=True), 0, 0, writer)
        await cm.write_document(document("c"), 0, 1, writer)
        await cm.write_document(document("d"), 0, 1, writer)
    assert os.listdir(tmp_path / "out") == ["00000_chunk_1.jsonl"]
    assert cm.last_chunk_index == 1


async def test_a_last_chunk_declared_complete_with_no_document_is_published_empty_not_lost(tmp_path: Path) -> None:
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    publisher = ChunkPublisher(str(out), str(ckpt))
    cm = manager(ckpt, 2)
    await cm.restore(0, publisher)
    for doc_id in ("a", "b"):
        await cm.write_document(document(doc_id), 0, 0, publisher)
    await cm.cleanup_last_chunk(0, 1)  # none of chunk 1's documents was written (all failed)
    assert cm.last_chunk_index == 1
    assert publisher.empty_chunks(0) == {1}
    assert publisher.missing_chunks(0, 1) == []  # else every later request of the rank were a 409 output_lost
    assert os.listdir(out) == ["00000_chunk_0.jsonl"]


async def test_an_output_folder_gone_under_the_proxy_is_not_made_again_and_the_chunk_waits_for_it(
    tmp_path: Path,
) -> None:
    """A file system unmounted under the proxy leaves its empty mount point: a folder made there would take the
    chunks where nobody looks, hidden once the file system is back, and their checkpoints deleted."""
    ckpt, mount = tmp_path / "ckpt", tmp_path / "mnt"
    out = mount / "job" / "out"
    out.mkdir(parents=True)
    publisher = ChunkPublisher(str(out), str(ckpt))
    cm = manager(ckpt, 1, publish_in_background=True, retry_backoff_s=0.01, max_retry_backoff_s=0.05)
    await cm.restore(0, publisher)
    await cm.write_document(document("a"), 0, 0, publisher)
    await cm.publish_pending(0)
    shutil.rmtree(mount / "job")  # unmounted
    await cm.write_document(document("b"), 0, 1, publisher)
    with pytest.raises(PublishError, match=r"the output folder .*/mnt/job/out is gone .*bring it back"):
        await cm.publish_pending(0)
    assert not (mount / "job").exists()
    assert cm.waiting_chunks() == [1]
    assert os.path.exists(chunk_path(ckpt, 1))
    out.mkdir(parents=True)  # mounted again
    await eventually(lambda: cm.last_chunk_index == 1, "chunk 1 was never published once its output was back")
    assert os.listdir(out) == ["00000_chunk_1.jsonl"]
    await cm.close()


async def test_names_and_lines_match_datatrove_jsonl_writer(tmp_path: Path) -> None:
    docs = [DatatroveDocument(text=f"t{i}", id=f"d{i}", metadata={"k": i} if i else {}) for i in range(3)]
    template = "${rank}/part_${chunk_index}.jsonl"
    with JsonlWriter(str(tmp_path / "dt"), output_filename=template, compression=None) as theirs:
        for doc in docs:
            theirs.write(doc, rank=2, chunk_index=7)
    cm = CheckpointManager(str(tmp_path / "ckpt"), 3)
    with ChunkPublisher(str(tmp_path / "ip"), str(tmp_path / "ckpt"), template) as ours:
        assert ours._get_output_filename(docs[0], 2, chunk_index=7) == theirs._get_output_filename(
            docs[0], 2, chunk_index=7
        )
        for doc in docs:
            await cm.write_document(doc, 2, 7, ours)
    assert (tmp_path / "ip/00002/part_7.jsonl").read_bytes() == (tmp_path / "dt/00002/part_7.jsonl").read_bytes()


async def test_published_files_and_folders_get_the_modes_datatrove_jsonl_writer_gives(tmp_path: Path) -> None:
    # Published chunks were 0600: other users and downstream jobs could not read them.
    template = "${rank}/part_${chunk_index}.jsonl"
    doc = DatatroveDocument(text="t", id="d")
    previous = os.umask(0o022)
    try:
        with JsonlWriter(str(tmp_path / "dt"), output_filename=template, compression=None) as theirs:
            theirs.write(doc, rank=2, chunk_index=0)
        cm = CheckpointManager(str(tmp_path / "ckpt"), 1)
        with ChunkPublisher(str(tmp_path / "ip"), str(tmp_path / "ckpt"), template) as ours:
            await cm.write_document(doc, 2, 0, ours)
    finally:
        os.umask(previous)
    for relative, mode in (("", 0o755), ("00002", 0o755), ("00002/part_0.jsonl", 0o644)):
        assert (tmp_path / "dt" / relative).stat().st_mode & 0o777 == mode
        assert (tmp_path / "ip" / relative).stat().st_mode & 0o777 == mode, relative


async def test_a_chunk_that_cannot_be_published_is_an_error_in_the_log_naming_chunk_rank_and_reason(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "out").write_text("a file where the output folder should be")
    cm = manager(tmp_path / "ckpt", 1)
    writer = ChunkPublisher(str(tmp_path / "out"), str(tmp_path / "ckpt"))
    with (
        caplog.at_level(logging.ERROR, logger="app.checkpoints.publish"),
        pytest.raises(PublishError, match="00003_chunk_5"),
    ):
        await cm.write_document(document("a"), 3, 5, writer)
    [record] = caplog.records
    assert record.levelname == "ERROR"
    assert record.getMessage().startswith(
        f"publishing chunk 5 of rank 3 to {tmp_path}/out/00003_chunk_5.jsonl failed: "
    )
    assert "File exists" in record.getMessage() or "Not a directory" in record.getMessage()


@pytest.mark.parametrize(
    ("template", "names", "expected"),
    [
        ("${rank}_chunk_${chunk_index}.jsonl", ["00001_chunk_0.jsonl", "00001_chunk_1.jsonl"], 1),
        # a gap: chunk 3 may be one the lost checkpoints had not reached
        ("${rank}_chunk_${chunk_index}.jsonl", [f"00001_chunk_{i}.jsonl" for i in (0, 1, 3)], 1),
        ("${rank}_chunk_${chunk_index}.jsonl", ["00002_chunk_0.jsonl", "00001_chunk_1.jsonl"], -1),  # another rank's
        ("${rank}_chunk_${chunk_index}.jsonl", ["00001_chunk_0.jsonl.partial", ".00001_chunk_0.jsonl.x.tmp"], -1),
        ("out/${rank}/c${chunk_index}.jsonl.gz", ["out/00001/c0.jsonl.gz", "out/00001/c1.jsonl.gz"], 1),
        ("c${chunk_index}/${rank}.jsonl", ["c0/00001.jsonl", "c1/00001.jsonl", "c2/00011.jsonl"], 1),
    ],
)
def test_the_last_published_chunk_is_the_end_of_an_unbroken_run(template: str, names: list[str], expected: int) -> None:
    assert last_published_chunk(names, OutputNames(template).pattern(1)) == expected


@pytest.mark.parametrize("template", ["${rank}_chunk_${chunk_index}.jsonl", "p/${rank}/c_${chunk_index}.jsonl"])
async def test_the_publisher_lists_what_it_published(tmp_path: Path, template: str) -> None:
    cm = manager(tmp_path / "ckpt", 2)
    with ChunkPublisher(str(tmp_path / "out"), str(tmp_path / "ckpt"), template) as writer:
        assert writer.last_published_chunk(0) == -1  # no output folder yet
        for position, doc in enumerate(documents(7)):
            await cm.write_document(doc, 0, position // 2, writer)
        assert writer.last_published_chunk(0) == 2
        assert writer.last_published_chunk(1) == -1


async def test_a_rank_without_a_chunk_0_in_the_output_is_known_new_without_listing_the_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A proxy meets a new rank a second in a job of many tasks; the output may hold 100,000 chunks."""
    managers = [manager(tmp_path / "ckpt", 2) for _ in range(2)]  # one a rank
    with ChunkPublisher(str(tmp_path / "out"), str(tmp_path / "ckpt")) as writer:
        for position, doc in enumerate(documents(6)):
            await managers[position % 2].write_document(doc, position % 2, position // 4, writer)

        def no_listing(rank: int) -> list[str]:
            raise AssertionError(f"the output was listed for rank {rank}")

        monkeypatch.setattr(writer, "_listing", no_listing)
        assert [writer.last_published_chunk(rank) for rank in (2, 3, 1000)] == [-1, -1, -1]
        monkeypatch.undo()
        assert [writer.last_published_chunk(rank) for rank in (0, 1)] == [0, 0]


async def test_the_publisher_keeps_nothing_of_the_chunks_it_has_published(tmp_path: Path) -> None:
    """One publisher serves a proxy for its whole life: thousands of chunks an hour in bench/soak.py."""
    cm = manager(tmp_path / "ckpt", 2)
    with ChunkPublisher(str(tmp_path / "out"), str(tmp_path / "ckpt")) as writer:
        for position, doc in enumerate(documents(20)):
            await cm.write_document(doc, 0, position // 2, writer)
        assert len(os.listdir(tmp_path / "out")) == 10
        held = {name: value for name, value in vars(writer).items() if isinstance(value, list | dict | set) and value}
        assert held == {}


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


def test_a_failure_to_look_for_chunk_0_is_raised_not_taken_for_a_new_rank(tmp_path: Path) -> None:
    """A rank whose chunk 0 cannot be looked at (here a symlink loop; on a network file system EIO or
    ESTALE) is not "new": answering -1 would make the job generate its whole published output again."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "00003").symlink_to(out / "00003")  # stat of anything under it: ELOOP
    writer = ChunkPublisher(str(out), str(tmp_path / "ckpt"), "${rank}/c_${chunk_index}.jsonl")
    with pytest.raises(OSError, match="Too many levels of symbolic links"):
        writer.last_published_chunk(3)
    assert writer.last_published_chunk(4) == -1  # a folder that is not there: new


def test_a_remote_output_that_fails_to_answer_for_chunk_0_is_an_error_not_a_new_rank(tmp_path: Path) -> None:
    """fsspec's generic `exists` takes any error (a timeout, throttling) for "absent"."""
    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    class Flaky(MemoryFileSystem):  # type: ignore[misc]
        protocol = "flakytest"
        store: ClassVar[dict[str, Any]] = {}
        pseudo_dirs: ClassVar[list[str]] = [""]

        def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
            if "00007" in path:
                raise TimeoutError("the endpoint did not answer")
            return dict(super().info(path, **kwargs))

    fsspec.register_implementation("flakytest", Flaky, clobber=True)
    writer = ChunkPublisher("flakytest://bucket/out", str(tmp_path / "ckpt"))
    with pytest.raises(TimeoutError):
        writer.last_published_chunk(7)
    assert writer.last_published_chunk(8) == -1
