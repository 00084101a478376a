"""`ChunkPublisher`: the one writer of published chunks, for the service and the library alike.

A chunk's documents are durable in its checkpoint file as soon as they are
acknowledged, so nothing is streamed to the output meanwhile (`write` does
nothing). When the checkpoint manager completes a chunk it closes the
chunk's output file, and that is when the publisher reads the chunk file
and publishes it as one file named by `output_filename`:

- locally: written under a temporary name in the target folder, fsynced,
  renamed over the final name, the folder fsynced: the file is whole or absent
  (the temporary name is the chunk's own, `.<name>.tmp`: one a crash left is
  replaced by the chunk's publication after the restart);
- to an fsspec URL (`s3://bucket/prefix`, ...): uploaded in one piece (one
  PUT on S3, which stores an object only once its whole body has arrived);
- `.gz` and `.zst` endings compress (zstd needs the `zstandard` package);
- documents marked `__no_rollouts_remove` are left out, a document id that
  repeats in the chunk file is published once, and a chunk with nothing
  left to publish produces no file;
- each line is what datatrove's `JsonlWriter` writes by default: the
  document's non-empty fields.

Publishing is deterministic (same documents, same order, gzip without a
timestamp), so a chunk published again after a crash replaces the file
with the same bytes: never a second copy.

It has the surface of datatrove's `DiskWriter` that checkpointing uses
(`write`, `close_file`, `_get_output_filename`, and `with`), so the library's
`CheckpointManager` takes it as its `output_writer_context`. A manager
without a checkpoints dir has no chunk files to publish from: give it a
datatrove writer instead, as datatrove does.
`app.output_check` checks the output at start; its `redact_url` and `scrub`
keep credentials written into an output URL out of every message.
"""

from __future__ import annotations

import asyncio
import gzip
import logging
import os
from string import Template
from typing import Any

import orjson

from app.documents import NO_ROLLOUTS_MARKER
from app.durable import atomic_write_bytes, read_jsonl_whole_lines
from app.layout import DEFAULT_OUTPUT_FILENAME, CheckpointsLayout, OutputNames, rank_name
from app.resume import last_published_chunk

__all__ = ["DEFAULT_OUTPUT_FILENAME", "ChunkPublisher", "PublishError", "check_output_filename", "is_remote"]
from app.output_check import S3_PROTOCOLS, install_hint, protocols, redact_url, scrub

logger = logging.getLogger(__name__)

_ALLOWED_FIELDS = frozenset({"rank", "chunk_index"})
# S3 takes up to 5 GiB in one PutObject; s3fs switches to a multipart upload
# at twice its chunksize (100 MiB by default): raise it so a chunk is one PUT.
_S3_SINGLE_PUT = {"chunksize": 5 * 2**30}


def check_output_filename(template: str) -> Template:
    """Only the integers rank and chunk_index become part of an output path, and both must:
    one proxy serves every rank, and two ranks' chunks must never share a name."""
    parsed = Template(template)
    fields = set(parsed.get_identifiers())
    if fields != _ALLOWED_FIELDS:
        raise ValueError(f"output_filename must use ${{rank}} and ${{chunk_index}} and nothing else, got {template!r}")
    if template.endswith(".zst"):
        try:
            import zstandard  # noqa: F401
        except ImportError:
            raise ValueError("output_filename ends with .zst: install the zstandard package") from None
    return parsed


class PublishError(RuntimeError):
    """A complete chunk could not be published; its documents stay checkpointed and it is retried.

    `where` is the folder that refused it: the output, or the checkpoints dir (which records it in `last_chunk`).
    """

    def __init__(self, message: str, *, where: str) -> None:
        super().__init__(message)
        self.where = where


def is_remote(output: str) -> bool:
    return "://" in output and not output.startswith("file://")


class ChunkPublisher:
    #: A chunk is rendered from its checkpoint file when it is published: a manager restoring
    #: checkpoints need not hand this writer their documents again (`write` ignores them).
    needs_documents = False

    def __init__(self, output: str, checkpoints_dir: str, output_filename: str = DEFAULT_OUTPUT_FILENAME) -> None:
        self.output = output.removeprefix("file://")
        self.layout = CheckpointsLayout(checkpoints_dir)
        check_output_filename(output_filename)
        self.names = OutputNames(output_filename)
        self._chunks: dict[str, tuple[int, int]] = {}
        self._fs: Any = None
        if is_remote(self.output):
            try:
                import fsspec
            except ImportError:
                raise ValueError(f"output {redact_url(output)} is a URL: {install_hint(output)}") from None
            self._fs, self._root = fsspec.core.url_to_fs(self.output)
            self._put_options = _S3_SINGLE_PUT if protocols(output) & S3_PROTOCOLS else {}

    # -- the DiskWriter surface CheckpointManager uses
    def write(self, document: Any, rank: int = 0, **kwargs: Any) -> None:
        """Nothing to do: the document is in the chunk's checkpoint file already."""

    def _get_output_filename(
        self, document: Any, rank: int | str = 0, chunk_index: int | None = None, **kwargs: Any
    ) -> str:
        assert chunk_index is not None
        name = self.names.name(rank, chunk_index)
        self._chunks[name] = (int(rank), int(chunk_index))
        return name

    def close_file(self, original_name: str) -> None:
        self._publish(original_name)

    async def close_file_async(self, original_name: str) -> None:
        """Publish off the event loop: reading, compressing and uploading a chunk takes a while."""
        try:
            await asyncio.to_thread(self._publish, original_name)
        except Exception as exc:
            reason = scrub(str(exc), self.output)
            rank, chunk_index = self._chunks.get(original_name, (-1, -1))
            # The client that triggered it gets a 500, but the operator reads the proxy's log.
            logger.error(
                "publishing chunk %d of rank %d to %s failed: %s; its documents stay checkpointed and it "
                "is retried with the rank's next write or chunk completion",
                chunk_index,
                rank,
                redact_url(os.path.join(self.output, original_name)),
                reason,
            )
            raise PublishError(f"publishing {original_name} failed: {reason}", where=redact_url(self.output)) from exc

    def close(self) -> None:
        """Nothing to flush: every chunk is published when the manager completes it."""

    def __enter__(self) -> ChunkPublisher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- resuming from the output
    def last_published_chunk(self, rank: int) -> int:
        """The last chunk of an unbroken run `0..i` of this rank's published chunks (-1 if none).

        Most ranks a proxy meets are new (a datatrove task's first request): one look for their chunk 0
        answers them, where a listing grows with everything published to the output."""
        if not self._published(self.names.name(rank, 0)):
            return -1
        return last_published_chunk(self._listing(rank), self.names.pattern(rank))

    def _published(self, name: str) -> bool:
        """Whether `name` is in the output. Only "not found" is an answer: any other failure to look
        (a network file system's EIO or ESTALE, a symlink loop, S3 throttling) is raised, as a listing
        raises it, never taken for "new rank" (`os.path.exists` and fsspec's `exists` swallow every
        error): the rank would start again from chunk 0 and generate its whole output again."""
        try:
            if self._fs is not None:
                path = f"{self._root.rstrip('/')}/{name}"
                self._fs.invalidate_cache(path.rpartition("/")[0])  # another proxy may have published it since
                self._fs.info(path)
            else:
                os.stat(os.path.join(self.output, name))
        except (FileNotFoundError, NotADirectoryError):
            return False
        return True

    def _listing(self, rank: int) -> list[str]:
        """Names (relative to the output) that may be this rank's chunks: one listing where the
        template puts the chunk index in the file name only, else every name under the output."""
        template = self.names.template.template
        directory = template.rpartition("/")[0]
        fixed = "chunk_index" not in directory
        prefix = Template(directory).substitute(rank=rank_name(rank)) if fixed and directory else ""
        if self._fs is not None:
            root = self._root.rstrip("/")
            where = f"{root}/{prefix}" if prefix else root
            # s3fs & co. keep listings for good: other proxies publish to the same output meanwhile.
            self._fs.invalidate_cache(where)
            try:
                paths = self._fs.find(where) if not fixed else self._fs.ls(where, detail=False)
            except FileNotFoundError:
                return []
            return [str(path)[len(root) + 1 :] for path in paths if str(path).startswith(root + "/")]
        where = os.path.join(self.output, prefix)
        if fixed:
            try:
                return [os.path.join(prefix, name) if prefix else name for name in os.listdir(where)]
            except FileNotFoundError:
                return []
        found: list[str] = []
        for folder, _, files in os.walk(self.output):
            relative = os.path.relpath(folder, self.output)
            found.extend(name if relative == "." else os.path.join(relative, name) for name in files)
        return found

    # -- publishing
    def _publish(self, name: str) -> None:
        rank, chunk_index = self._chunks[name]
        data = self._render(self.layout.rank(rank).chunk_file(chunk_index), name)
        if data is not None:
            if self._fs is not None:
                self._fs.pipe_file(f"{self._root.rstrip('/')}/{name}", data, **self._put_options)
            else:
                atomic_write_bytes(os.path.join(self.output, name), data, sole_writer=True)
        self._chunks.pop(name, None)

    def _render(self, chunk_file: str, name: str) -> bytes | None:
        try:
            records = read_jsonl_whole_lines(chunk_file)
        except FileNotFoundError:
            # A chunk with documents always has its file until last_chunk has moved past it.
            raise FileNotFoundError(
                f"its checkpoint file {chunk_file} is gone (removed while the proxy ran?), so its documents "
                f"cannot be published; restart the job: it generates again what the checkpoints lost"
            ) from None
        seen: set[str] = set()
        lines = []
        for record in records:
            if record["id"] in seen or NO_ROLLOUTS_MARKER in (record.get("metadata") or {}):
                continue
            seen.add(record["id"])
            # datatrove's JsonlWriter line: the document's non-empty fields
            lines.append(orjson.dumps({k: v for k, v in record.items() if v}, option=orjson.OPT_APPEND_NEWLINE))
        if not lines:
            return None
        data = b"".join(lines)
        if name.endswith(".gz"):
            return gzip.compress(data, mtime=0)
        if name.endswith(".zst"):
            import zstandard

            return bytes(zstandard.ZstdCompressor().compress(data))
        return data
