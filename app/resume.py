"""Where a rank resumes: read back from its checkpoints, or from the output alone.

- `check_records_per_chunk`: the one check that a checkpoints dir is resumed
  with the `records_per_chunk` it was written with (the CLI at start-up and
  the checkpoint manager both call it);
- `read_last_chunk` and `read_chunk_file`: a rank's checkpoints as they are
  on disk, repaired where a crash left a torn line or an empty file;
- `last_published_chunk`: a rank whose checkpoints were lost with its node
  resumes after the last chunk of an unbroken run of published chunks
  `0..i`, as the output's listing shows them.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterable
from typing import Any

import orjson

from app.documents import DocumentLike
from app.durable import CorruptFileError, create_exclusive_bytes, make_dirs_durable, read_jsonl_repairing_tail
from app.layout import CheckpointsLayout

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
    try:
        with open(path, "rb") as f:
            meta = orjson.loads(f.read())
        recorded = meta["records_per_chunk"]
    except (FileNotFoundError, NotADirectoryError):
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
    except (ValueError, TypeError, KeyError) as exc:
        raise CorruptFileError(
            f"{path} is not a JSON object with records_per_chunk ({exc}); write "
            f'{{"records_per_chunk": N}} with the value the checkpoints were written with'
        ) from exc
    if recorded != records_per_chunk:
        raise RecordsPerChunkMismatch(
            f"the checkpoints in {layout.root} were written with records_per_chunk={recorded}, "
            f"this run uses records_per_chunk={records_per_chunk}: every chunk boundary would shift. "
            f"Resume with records_per_chunk={recorded} (inferproxy serve --records-per-chunk {recorded}), "
            f"or give a new job its own checkpoints dir (--checkpoints-dir)"
        )


def read_last_chunk(path: str) -> int:
    """The value of a `last_chunk/<rank>.txt` file: -1 if absent, and -1 (logged) if unreadable."""
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        return -1
    except OSError as exc:
        text = f"<unreadable: {exc}>"
    try:
        value = int(text.strip())
        if value < -1:
            raise ValueError(value)
    except ValueError:
        # Left by a writer that truncated the file and died before writing
        # it again (datatrove rewrites it in place). The true value is lost;
        # the only safe lower bound is "no chunk complete": finished chunks
        # are generated again and their outputs rewritten, none is lost.
        logger.warning(
            "%s is empty or unreadable (%r), probably left by a crash while it was rewritten in place; "
            "resuming as if no chunk were complete: chunks already published will be generated again "
            "and their output files rewritten",
            path,
            text[:80],
        )
        return -1
    return value


def docs_to_skip(last_chunk_index: int, records_per_chunk: int) -> int:
    """How many input documents the published chunks `0..last_chunk_index` cover."""
    return (last_chunk_index + 1) * records_per_chunk if last_chunk_index >= 0 else 0


def read_chunk_file(
    path: str, records_per_chunk: int, document_factory: Callable[[dict[str, Any]], DocumentLike]
) -> list[DocumentLike]:
    """Decode one unfinished chunk file, every line validated before anything is used."""
    documents = []
    for number, record in enumerate(read_jsonl_repairing_tail(path), start=1):
        if not isinstance(record, dict) or not isinstance(record.get("id"), str):
            raise CorruptFileError(
                f"{path}: record {number} is not a document (a JSON object with a string id): "
                f"{str(record)[:80]!r}. Move the file aside or repair that line, then restart"
            )
        documents.append(document_factory(record))
    distinct = len({document.id for document in documents})
    if distinct > records_per_chunk:
        raise RecordsPerChunkMismatch(
            f"{path} holds {distinct} distinct documents but records_per_chunk is "
            f"{records_per_chunk}: these checkpoints were written with a larger "
            f"records_per_chunk; resume with that value or use a fresh checkpoints dir"
        )
    return documents


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
    published = {int(match.group(1)) for name in names if (match := pattern.match(name))}
    last = -1
    while last + 1 in published:
        last += 1
    return last
