"""`ChunkPublisher`: the one writer of published chunks, for the service and the library alike.

A chunk's documents are durable in its checkpoint file as soon as they are
acknowledged, so nothing is streamed to the output meanwhile (`write` does
nothing). When the checkpoint manager completes a chunk it closes the
chunk's output file, and that is when the publisher reads the chunk file
and publishes it as one file named by `output_filename`:

- locally: written under a temporary name of its own in the target folder
  (`.<name>.<random>.tmp`), fsynced, renamed over the final name, the folder
  fsynced: the file is whole or absent, and two publishers of one chunk (an
  owner that lost the rank, the one that took it over) never write into one
  file. One a crash left is removed when the rank is next restored
  (`remove_stale_temporaries`);
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

A publication runs in a daemon thread of its own (`close_file_async`), which
checks between pieces of the file and just before its rename (or upload) that
the proxy still owns the rank (`holds_rank`) and that the publication was not
given up (`abandon`): a proxy that stops gives a slow publication up rather
than let it outlive the rank's lock, and a thread stuck in a stalled upload
never keeps the process from exiting.

It has the surface of datatrove's `DiskWriter` that checkpointing uses
(`write`, `close_file`, `_get_output_filename`, and `with`), so the library's
`CheckpointManager` takes it as its `output_writer_context`. A manager
without a checkpoints dir has no chunk files to publish from: give it a
datatrove writer instead, as datatrove does.
`app.checkpoints.output` checks the output at start; its `redact_url` and `scrub`
keep credentials written into an output URL out of every message.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gzip
import logging
import os
import threading
from collections.abc import Callable
from string import Template
from typing import Any, TypeVar

import orjson

from app.checkpoints.documents import NO_ROLLOUTS_MARKER
from app.checkpoints.resume import last_published_chunk
from app.store.durable import (
    atomic_write_bytes,
    make_dirs_durable,
    read_jsonl_whole_lines,
    read_regular,
    temporary_target,
)
from app.store.layout import DEFAULT_OUTPUT_FILENAME, CheckpointsLayout, OutputNames, rank_name

__all__ = [
    "DEFAULT_OUTPUT_FILENAME",
    "ChunkFileGone",
    "ChunkPublisher",
    "PublicationAbandoned",
    "PublishError",
    "check_output_filename",
    "chunk_file_gone",
    "in_daemon_thread",
    "is_remote",
    "shortened",
]
from app.checkpoints.output import S3_PROTOCOLS, install_hint, is_remote, protocols, redact_url, scrub

logger = logging.getLogger(__name__)

_ALLOWED_FIELDS = frozenset({"rank", "chunk_index"})
# S3 takes up to 5 GiB in one PutObject; s3fs switches to a multipart upload
# at twice its chunksize (100 MiB by default): raise it so a chunk is one PUT.
_S3_SINGLE_PUT = {"chunksize": 5 * 2**30}


#: An output's error is shown (in a 503, `/stats`, the page, `status`, the log) up to this many characters:
#: an object store or a gateway before it may answer with a page of HTML, or a megabyte of anything.
REASON_CHARS = 1000


def shortened(reason: str) -> str:
    """`reason` cut to `REASON_CHARS`, saying how much was left out."""
    if len(reason) <= REASON_CHARS:
        return reason
    return f"{reason[:REASON_CHARS]}… ({len(reason) - REASON_CHARS} characters more)"


def check_output_filename(template: str) -> Template:
    """Only the integers rank and chunk_index become part of an output path, and both must:
    one proxy serves every rank, and two ranks' chunks must never share a name."""
    parsed = Template(template)
    fields = set(parsed.get_identifiers())
    if fields != _ALLOWED_FIELDS:
        raise ValueError(
            f"output_filename must use ${{rank}} and ${{chunk_index}} and nothing else, got {template!r}: one proxy "
            f"publishes every rank's chunks, each chunk a file of its own, so without both two chunks would share "
            f"a name (e.g. ${{rank}}_chunk_${{chunk_index}}.jsonl.gz)"
        )
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


class ChunkFileGone(FileNotFoundError):
    """A complete chunk's checkpoint file is gone (removed under a running proxy): its documents cannot be
    published, and retrying does not bring them back."""


def chunk_file_gone(exc: BaseException) -> bool:
    """Whether `exc` (a `PublishError` or what it wraps) says a chunk's checkpoint file is gone."""
    return isinstance(exc, ChunkFileGone) or isinstance(exc.__cause__, ChunkFileGone)


class PublicationAbandoned(RuntimeError):
    """A publication given up before its rename or upload (the proxy stops, or no longer owns the rank):
    its temporary file is removed and the output is untouched."""


T = TypeVar("T")


async def in_daemon_thread(function: Callable[[], T], name: str) -> T:
    """`function()` in a daemon thread of its own, awaited: unlike `asyncio.to_thread`'s pool, whose
    threads the interpreter joins at exit, a daemon thread stuck in a stalled upload never keeps a
    stopping proxy from exiting (its rank locks go with the process)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        try:
            result, error = function(), None
        except BaseException as exc:
            result, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name=name, daemon=True).start()
    return await future


class ChunkPublisher:
    #: A chunk is rendered from its checkpoint file when it is published: a manager restoring
    #: checkpoints need not hand this writer their documents again (`write` ignores them).
    needs_documents = False

    def __init__(
        self,
        output: str,
        checkpoints_dir: str,
        output_filename: str = DEFAULT_OUTPUT_FILENAME,
        *,
        holds_rank: Callable[[int], bool] | None = None,
    ) -> None:
        self.output = output.removeprefix("file://")
        self.layout = CheckpointsLayout(checkpoints_dir)
        check_output_filename(output_filename)
        self.names = OutputNames(output_filename)
        #: Whether this process still owns a rank (`RankOwnership.owns`): checked before each rename
        #: or upload, so that only the rank's owner ever replaces one of its chunks.
        self.holds_rank = holds_rank
        self._chunks: dict[str, tuple[int, int]] = {}
        self._abandon: dict[str, threading.Event] = {}  # name -> set to give its publication up
        #: Whether this process has made (or found) the local output folder: from then on a publication
        #: never makes it again, and fails while it is gone (`_publish_local`).
        self._output_made = False
        self._fs: Any = None
        if is_remote(self.output):
            try:
                import fsspec
            except ImportError:
                raise ValueError(f"output {redact_url(output)} is a URL: {install_hint(output)}") from None
            # No listings cache: one listing in flight (a /resume's check of the output) would store what it
            # saw after another call cleared the cache, and that call would then take the stale listing for
            # the output: a chunk just published "lost" (seen under a /resume storm against S3).
            self._fs, self._root = fsspec.core.url_to_fs(self.output, use_listings_cache=False)
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
        self._publish(original_name, threading.Event())

    async def close_file_async(self, original_name: str) -> None:
        """Publish off the event loop, in a daemon thread: reading, compressing and uploading a chunk takes
        a while. `abandon_file` gives it up (`PublicationAbandoned`) at its next check."""
        abandon = self._abandon.setdefault(original_name, threading.Event())
        try:
            await in_daemon_thread(lambda: self._publish(original_name, abandon), f"publish {original_name}")
        except (PublicationAbandoned, PublishError):
            raise
        except Exception as exc:
            reason = shortened(scrub(str(exc), self.output))
            rank, chunk_index = self._chunks.get(original_name, (-1, -1))
            # Whoever waits for it gets the error, but the operator reads the proxy's log.
            logger.error(
                "publishing chunk %d of rank %d to %s failed: %s; its documents stay checkpointed",
                chunk_index,
                rank,
                redact_url(os.path.join(self.output, original_name)),
                reason,
            )
            raise PublishError(f"publishing {original_name} failed: {reason}", where=redact_url(self.output)) from exc
        finally:
            self._abandon.pop(original_name, None)

    def abandon_file(self, original_name: str) -> None:
        """Give up the publication of `original_name` running now, if any: it stops at its next check
        (within one piece of the file, or before its upload), its temporary file removed."""
        event = self._abandon.get(original_name)
        if event is not None:
            event.set()

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
            # In case a listings cache is kept all the same: other proxies publish to the same output meanwhile.
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
    def _checker(self, name: str, rank: int, abandon: threading.Event) -> Callable[[], None]:
        """What a publication calls between its pieces and before its rename: it raises
        `PublicationAbandoned` once the publication is given up, or the rank is no longer this proxy's."""

        def check() -> None:
            if abandon.is_set():
                raise PublicationAbandoned(f"the publication of {name} was given up (the proxy is stopping)")
            if self.holds_rank is not None and not self.holds_rank(rank):
                raise PublicationAbandoned(
                    f"the publication of {name} was given up: this proxy no longer owns rank {rank}"
                )

        return check

    def _publish(self, name: str, abandon: threading.Event) -> None:
        rank, chunk_index = self._chunks[name]
        check = self._checker(name, rank, abandon)
        paths = self.layout.rank(rank)
        data = self._render(paths.chunk_file(chunk_index), name)
        if data is None:
            self._record_empty(rank, chunk_index, check)
        elif self._fs is not None:
            check()
            self._fs.pipe_file(f"{self._root.rstrip('/')}/{name}", data, **self._put_options)
        else:
            self._publish_local(name, data, check)
        self._chunks.pop(name, None)

    def _publish_local(self, name: str, data: bytes, check: Callable[[], None]) -> None:
        """Write `name` into the local output folder. The process's first publication makes the folder (the
        start-up check found its parent); a later one that finds it gone fails (and is retried) rather than
        make it again: a folder removed, or a file system unmounted under a running proxy (leaving its
        empty mount point), would take the chunks where nobody looks for them, hidden once it is back."""
        if not self._output_made:
            make_dirs_durable(self.output)
            self._output_made = True
        try:
            atomic_write_bytes(os.path.join(self.output, name), data, check=check, under=self.output)
        except FileNotFoundError:
            if os.path.lexists(self.output):
                raise
            raise FileNotFoundError(
                errno.ENOENT,
                f"the output folder {self.output} is gone (removed, or its file system unmounted): bring it "
                f"back (the chunk is retried meanwhile), or restart with another --output",
            ) from None

    def publish_empty(self, rank: int, chunk_index: int) -> None:
        """A chunk with no document at all (the job's last, declared complete before any of its documents
        was written) is published as nothing: recorded so, not taken for a chunk lost from the output."""
        check = self._checker(f"chunk {chunk_index} of rank {rank}", rank, threading.Event())
        self._record_empty(rank, chunk_index, check)

    def _record_empty(self, rank: int, chunk_index: int, check: Callable[[], None]) -> None:
        paths = self.layout.rank(rank)
        empty = self.empty_chunks(rank)
        if chunk_index in empty:
            return
        lines = "".join(f"{chunk}\n" for chunk in sorted({*empty, chunk_index}))
        try:
            atomic_write_bytes(paths.empty_chunks_file, lines.encode(), check=check)
        except OSError as exc:  # the checkpoints disk refused it, not the output: name that one
            logger.error("recording chunk %d of rank %d as published empty failed: %s", chunk_index, rank, exc)
            raise PublishError(
                f"recording chunk {chunk_index} (nothing in it to publish) in {paths.empty_chunks_file} "
                f"failed: {shortened(str(exc))}",
                where=self.layout.root,
            ) from exc

    def empty_chunks(self, rank: int) -> set[int]:
        """The rank's chunks published as nothing, as `<checkpoints>/empty_chunks/<rank>.txt` records them."""
        try:  # never through a link, never a FIFO (a checkpoints dir is shared)
            data = read_regular(self.layout.rank(rank).empty_chunks_file)
        except FileNotFoundError:
            return set()
        return {int(line) for line in data.split() if line.isdigit()}

    # -- what a restore checks
    def remove_stale_temporaries(self, rank: int) -> int:
        """Remove the temporary files that publications of `rank`'s chunks left in a local output when
        their process died mid-write; how many. Only for the rank's owner, which alone publishes them."""
        if self._fs is not None:
            return 0  # an upload leaves nothing behind
        pattern = self.names.pattern(rank)
        removed = 0
        for relative in self._listing(rank):
            folder, _, base = relative.rpartition(os.sep)
            target = temporary_target(base)
            if target is None or not pattern.match(os.path.join(folder, target) if folder else target):
                continue
            try:
                os.remove(os.path.join(self.output, relative))
                removed += 1
            except FileNotFoundError:
                pass
        if removed:
            where = redact_url(self.output)
            logger.info(
                "removed %d temporary files of rank %d in %s, left by a publication cut short", removed, rank, where
            )
        return removed

    def missing_chunks(self, rank: int, last_chunk: int) -> list[int]:
        """The chunks `0..last_chunk` of `rank` that are not in the output (but those published as nothing):
        lost after they were published (a bucket emptied or recreated, files deleted)."""
        if last_chunk < 0:
            return []
        empty = self.empty_chunks(rank)
        pattern = self.names.pattern(rank)
        present = set()
        for name in self._listing(rank):
            match = pattern.match(name)
            if match:
                present.add(int(match.group(1)))
        return [chunk for chunk in range(last_chunk + 1) if chunk not in present and chunk not in empty]

    def _render(self, chunk_file: str, name: str) -> bytes | None:
        try:
            records = read_jsonl_whole_lines(chunk_file)
        except FileNotFoundError:
            # A chunk with documents always has its file until last_chunk has moved past it.
            raise ChunkFileGone(
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


def upload_whole(output: str, local_path: str, name: str) -> str:
    """Copy the file at `local_path` to `name` under the object store `output`, in one piece (one PUT on S3:
    the object is whole or absent); the URL written, without credentials."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(output, use_listings_cache=False)
    options = _S3_SINGLE_PUT if protocols(output) & S3_PROTOCOLS else {}
    target = f"{root.rstrip('/')}/{name}"
    fs.put_file(local_path, target, **options)
    return redact_url(f"{output.rstrip('/')}/{name}")
