"""Where a rank resumes: read back from its checkpoints, or from the output alone.

- `check_records_per_chunk`: the one check that a checkpoints dir is resumed
  with the `records_per_chunk` it was written with (the CLI at start-up and
  the checkpoint manager both call it);
- `read_last_chunk` and `read_chunk_file`: a rank's checkpoints as they are
  on disk, repaired where a crash left a torn line or an empty file;
- `resume_after_restore`: where a rank restored from its checkpoints
  resumes, what `GET /resume` answers after a restart (`inferproxy inspect`
  computes it from the checkpoints as they are, changing nothing);
- `last_published_chunk`: a rank whose checkpoints were lost with its node
  resumes after the last chunk of an unbroken run of published chunks
  `0..i`, as the output's listing shows them.
"""

from __future__ import annotations

import itertools
import logging
import operator
import os
import re
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import orjson

from app.checkpoints.documents import DocumentLike
from app.store.durable import (
    SMALL_FILE_BYTES,
    CorruptFileError,
    JsonlLines,
    UnsafeFileError,
    create_exclusive_bytes,
    make_dirs_durable,
    open_to_read,
    read_jsonl_repairing_tail,
    read_regular,
)
from app.store.layout import CheckpointsLayout

logger = logging.getLogger(__name__)


class RecordsPerChunkMismatch(ValueError):
    """The checkpoints were written with another `records_per_chunk`."""


def check_records_per_chunk(layout: CheckpointsLayout, records_per_chunk: int, *, record: bool) -> None:
    """Check `records_per_chunk` against the one recorded beside the checkpoints.

    With `record`, a checkpoints dir without the record gets one (created if
    need be); without it, nothing is written, so that a start-up check can
    refuse before anything exists. Raises `RecordsPerChunkMismatch` for
    another value and `CorruptFileError` for an unreadable record.
    """
    path = layout.meta_file
    recorded = recorded_records_per_chunk(layout)
    if recorded is None:
        if not record:
            return
        if os.path.isdir(os.path.join(layout.root, "last_chunk")):
            logger.warning(
                "%s holds checkpoints but no %s (written by datatrove or an older inferproxy): "
                "trusting records_per_chunk=%d and recording it; a different value would shift every chunk",
                layout.root,
                os.path.basename(path),
                records_per_chunk,
            )
        make_dirs_durable(layout.root)
        try:
            # Created, never replaced: two proxies sharing a fresh dir with different values must not
            # both believe they recorded theirs. The one that loses checks against the winner's.
            create_exclusive_bytes(path, orjson.dumps({"records_per_chunk": records_per_chunk}))
        except FileExistsError:
            check_records_per_chunk(layout, records_per_chunk, record=False)
        return
    if recorded != records_per_chunk:
        raise RecordsPerChunkMismatch(
            f"the checkpoints in {layout.root} were written with records_per_chunk={recorded}, "
            f"this run uses records_per_chunk={records_per_chunk}: every chunk boundary would shift. "
            f"Resume with records_per_chunk={recorded} (inferproxy serve --records-per-chunk {recorded}), "
            f"or give a new job its own checkpoints dir (--checkpoints-dir)"
        )


def recorded_records_per_chunk(layout: CheckpointsLayout) -> int | None:
    """The `records_per_chunk` recorded beside the checkpoints, None if none is.

    Raises `CorruptFileError` for a record that is not a JSON object with a positive integer.
    """
    path = layout.meta_file
    try:
        recorded = orjson.loads(read_regular(path, limit=SMALL_FILE_BYTES))["records_per_chunk"]
        if not isinstance(recorded, int) or isinstance(recorded, bool) or recorded <= 0:
            raise ValueError(f"records_per_chunk is {recorded!r}")
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (ValueError, TypeError, KeyError) as exc:
        raise CorruptFileError(
            f"{path} is not a JSON object with records_per_chunk, a positive integer ({exc}); write "
            f'{{"records_per_chunk": N}} with the value the checkpoints were written with'
        ) from exc
    return recorded


class LastChunkFile(NamedTuple):
    """A `last_chunk/<rank>.txt` file as read."""

    value: int  # what a resume uses: -1 when the file is absent or unreadable
    problem: str | None  # why its value could not be read, if it could not


#: The largest `last_chunk` a file may hold. It moves one completed chunk at a time, so no job gets
#: near; and `docs_to_skip` then stays within the 64 bits SQLite and JSON carry (records_per_chunk < 2^32).
MAX_LAST_CHUNK = 2**31 - 1


def read_last_chunk_file(path: str) -> LastChunkFile:
    """Read a `last_chunk/<rank>.txt` file, saying what is wrong with it rather than logging it.

    `UnsafeFileError` for a link or a special file there: nothing is read.
    """
    try:
        text = read_regular(path, limit=SMALL_FILE_BYTES).decode("ascii", "replace")
    except FileNotFoundError:
        return LastChunkFile(-1, None)
    except UnsafeFileError:
        raise
    except (OSError, ValueError) as exc:
        text = f"<unreadable: {exc}>"
    try:
        value = int(text.strip())
        if not -1 <= value <= MAX_LAST_CHUNK:
            raise ValueError(value)
    except ValueError:
        # Left by a writer that truncated the file and died before writing
        # it again (datatrove rewrites it in place). The true value is lost;
        # the only safe lower bound is "no chunk complete": finished chunks
        # are generated again and their outputs rewritten, none is lost.
        return LastChunkFile(
            -1,
            f"{path} is empty or unreadable ({text[:80]!r}): not a chunk index from -1 to {MAX_LAST_CHUNK}, "
            f"probably left by a crash while it was rewritten in place; resuming as if no chunk were complete: "
            f"chunks already published will be generated again and their output files rewritten",
        )
    return LastChunkFile(value, None)


def read_last_chunk(path: str) -> int:
    """The value of a `last_chunk/<rank>.txt` file: -1 if absent, and -1 (logged) if unreadable."""
    last = read_last_chunk_file(path)
    if last.problem is not None:
        logger.warning("%s", last.problem)
    return last.value


def docs_to_skip(last_chunk_index: int, records_per_chunk: int) -> int:
    """How many input documents the published chunks `0..last_chunk_index` cover."""
    return (last_chunk_index + 1) * records_per_chunk if last_chunk_index >= 0 else 0


class ChunkScan(NamedTuple):
    """An unfinished chunk file as its first, validating read keeps it: ids, not documents."""

    ids: set[str]  # its distinct document ids
    first: dict[str, Any] | None  # its first record, which names the chunk's output (None if empty)


def read_chunk_ids(path: str, records_per_chunk: int) -> ChunkScan:
    """Validate one unfinished chunk file line by line, holding one document at a time, and cut off a
    torn last line. Raises as `decode_chunk` does."""
    scan = _whole_chunk_ids(path)
    if scan is None:  # something to repair or refuse: read again, line by careful line
        scan = _careful_chunk_ids(path)
    _check_distinct(path, len(scan.ids), records_per_chunk)
    return scan


def _whole_chunk_ids(path: str) -> ChunkScan | None:
    """The common case, with the loop over lines in C (a fifth less CPU than `_careful_chunk_ids`):
    every line a JSON object with a string id, the last one whole. None for anything else."""
    with open_to_read(path) as f:
        try:
            ids = set(map(operator.itemgetter("id"), map(orjson.loads, f)))
        except (orjson.JSONDecodeError, KeyError, TypeError):  # not JSON, or not an object with an id
            return None
        if not ids:
            return ChunkScan(ids, None)
        f.seek(-1, os.SEEK_END)
        if f.read(1) != b"\n" or set(map(type, ids)) != {str}:  # a torn last line, or an id not a string
            return None
        f.seek(0)
        return ChunkScan(ids, orjson.loads(f.readline()))


def _careful_chunk_ids(path: str) -> ChunkScan:
    lines = JsonlLines(path)
    ids: set[str] = set()
    first: dict[str, Any] | None = None
    bad: tuple[int, Any] | None = None
    for number, record in enumerate(lines, start=1):
        if not isinstance(record, dict) or not isinstance(doc_id := record.get("id"), str):
            bad = bad or (number, record)
        else:
            ids.add(doc_id)
            if first is None:
                first = record
    lines.repair()  # before refusing the file, as `read_chunk_file` does
    if bad is not None:
        raise _not_a_document(path, *bad)
    return ChunkScan(ids, first)


def read_chunk_file(
    path: str, records_per_chunk: int, document_factory: Callable[[dict[str, Any]], DocumentLike]
) -> list[DocumentLike]:
    """Decode one unfinished chunk file, cutting off a torn last line, every line validated before anything is used."""
    return decode_chunk(path, read_jsonl_repairing_tail(path), records_per_chunk, document_factory)


def decode_chunk(
    path: str,
    records: Iterable[Any],
    records_per_chunk: int | None,
    document_factory: Callable[[dict[str, Any]], DocumentLike],
) -> list[DocumentLike]:
    """The documents of a chunk file's records (as `scan_jsonl` reads them), each validated.

    Raises `CorruptFileError` for a record that is not a document, `RecordsPerChunkMismatch`
    for more distinct documents than a chunk holds (unchecked where `records_per_chunk` is unknown).
    """
    documents = []
    for number, record in enumerate(records, start=1):
        if not isinstance(record, dict) or not isinstance(record.get("id"), str):
            raise _not_a_document(path, number, record)
        documents.append(document_factory(record))
    if records_per_chunk is not None:
        _check_distinct(path, len({document.id for document in documents}), records_per_chunk)
    return documents


def _not_a_document(path: str, number: int, record: Any) -> CorruptFileError:
    return CorruptFileError(
        f"{path}: record {number} is not a document (a JSON object with a string id): "
        f"{str(record)[:80]!r}. Move the file aside or repair that line, then restart"
    )


def _check_distinct(path: str, distinct: int, records_per_chunk: int) -> None:
    if distinct > records_per_chunk:
        raise RecordsPerChunkMismatch(
            f"{path} holds {distinct} distinct documents but records_per_chunk is "
            f"{records_per_chunk}: these checkpoints were written with a larger "
            f"records_per_chunk; resume with that value or use a fresh checkpoints dir"
        )


def last_published_chunk(names: Iterable[str], pattern: re.Pattern[str]) -> int:
    """The last chunk `i` such that chunks `0..i` are all among `names` (-1 if chunk 0 is not).

    Chunks complete in any order but `last_chunk` only moves over an
    unbroken run, so a chunk published past a gap may belong to a run the
    lost checkpoints had not reached: resuming after the gap would skip the
    chunks in it. A gap can also be a chunk whose documents were all left
    out of the output (it publishes no file); its successors are then
    generated again and their files replaced with the same documents, so
    the output still holds each document once.
    """
    return end_of_run(-1, {int(match.group(1)) for name in names if (match := pattern.match(name))})


def end_of_run(last_chunk_index: int, chunks: Collection[int]) -> int:
    """The last `i` such that chunks `last_chunk_index + 1 .. i` are all in `chunks` (`last_chunk_index` if
    the next one is not): how far `last_chunk_index` moves, one chunk at a time, over complete chunks."""
    last = last_chunk_index
    while last + 1 in chunks:
        last += 1
    return last


def processed_ids(last_chunk_index: int, chunk_ids: Mapping[int, Collection[str]]) -> set[str]:
    """The ids a resumed job skips beyond `docs_to_skip`: the documents of the chunks after the last complete one."""
    return {doc_id for chunk, ids in chunk_ids.items() if chunk > last_chunk_index for doc_id in ids}


def sorted_processed_ids(last_chunk_index: int, chunk_ids: Mapping[int, Collection[str]]) -> list[str]:
    """`processed_ids` as `GET /resume` lists them, sorted, each once: built without a set of them all,
    which for a million ids would be ~32 MiB more at the answer's peak."""
    ids = sorted(itertools.chain.from_iterable(ids for chunk, ids in chunk_ids.items() if chunk > last_chunk_index))
    if any(map(operator.eq, ids, itertools.islice(ids, 1, None))):  # an id in two open chunks
        ids = [doc_id for doc_id, _ in itertools.groupby(ids)]
    return ids


@dataclass(frozen=True, slots=True)
class ResumePoint:
    """Where a rank resumes: the numbers of `GET /resume`."""

    last_chunk_index: int
    docs_to_skip: int
    processed_ids: frozenset[str]


def resume_after_restore(
    last_chunk_index: int, chunk_ids: Mapping[int, Collection[str]], records_per_chunk: int
) -> ResumePoint:
    """Where a rank resumes once restored from its checkpoints: what `GET /resume` answers after a restart.

    `last_chunk_index` is the rank's `last_chunk` file, `chunk_ids` the
    distinct document ids of each of its chunk files. Restoring
    (`CheckpointManager.parse_existing_checkpoints`) publishes every full
    chunk, and `last_chunk_index` moves over the full ones that follow it.
    """
    full = {chunk for chunk, ids in chunk_ids.items() if len(ids) == records_per_chunk}
    last = end_of_run(last_chunk_index, full)
    return ResumePoint(last, docs_to_skip(last, records_per_chunk), frozenset(processed_ids(last, chunk_ids)))
