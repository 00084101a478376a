"""A rank's total, learnt from its reader while the rank runs: the documents datatrove's `JsonlReader`
will hand the runner, counted in its local files.

The proxy shows progress and an ETA only once it knows a rank's total, and a
wrong total is worse than none (a rank "done" at 80%, an ETA that lies). So
the count is made only where it is exact, and otherwise not at all (the
runner declares the total at the rank's end, as before):

- the runner's input is the reader's own generator, not started, with no
  step between them (a filter may drop documents) and nothing before the
  reader (its `data` is passed through first);
- the reader is a `JsonlReader` (not a subclass) with its default adapter:
  a document is a line that is a JSON object with a non-empty text, which
  the count checks as the reader does;
- its files are local (a second read over object storage is not cheap),
  and each decodes cleanly (the reader gives up on a file at a bad byte).

`skip` and `limit` bound the count as they bound the reader: counting stops
at `skip + limit` documents.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import orjson
from datatrove.io import get_shard_from_paths_file
from datatrove.pipeline.readers.base import BaseDiskReader, BaseReader
from datatrove.pipeline.readers.jsonl import JsonlReader


@dataclass(frozen=True)
class ReaderShard:
    """One rank's part of a reader's input, as the reader's `run` was called for it."""

    reader: Any
    rank: int
    world_size: int


class Uncountable(Exception):
    """The documents cannot be counted exactly: the reason, for the task's log."""


def reader_shard(data: object) -> ReaderShard:
    """The reader whose documents `data` is, if it is the generator of a `JsonlReader`'s `run` not yet started;
    `Uncountable` with the reason otherwise."""
    if not inspect.isgenerator(data) or data.gi_code is not BaseDiskReader.run.__code__:
        raise Uncountable("its input does not come straight from a reader (a step between them may drop documents)")
    if inspect.getgeneratorstate(data) != inspect.GEN_CREATED:
        raise Uncountable("its reader had started already")
    arguments = inspect.getgeneratorlocals(data)
    reader = arguments["self"]
    if type(reader) is not JsonlReader:
        raise Uncountable(f"its reader is a {type(reader).__name__}, whose documents need not be its files' lines")
    if getattr(reader.adapter, "__func__", None) is not BaseReader._default_adapter:
        raise Uncountable("its JsonlReader has an adapter of its own")
    if arguments["data"]:
        raise Uncountable("its JsonlReader passes on the documents of a step before it")
    if not reader.data_folder.is_local():
        raise Uncountable("its JsonlReader's files are not local (they would be read twice over the network)")
    return ReaderShard(reader, arguments["rank"], arguments["world_size"])


def count_documents(shard: ReaderShard, stop: threading.Event) -> int:
    """The documents the reader yields for this shard, counted by reading its files as it does; `Uncountable`
    if they cannot be counted exactly, or if `stop` is set before the end."""
    reader = shard.reader
    skip, limit = int(reader.skip), int(reader.limit)
    bound = skip + limit if limit != -1 else None
    documents = 0
    for path in _files(shard):
        with reader.data_folder.open(path, "r", compression=reader.compression) as lines:
            try:
                for position, line in enumerate(lines):
                    if position % 1024 == 0 and stop.is_set():
                        raise Uncountable("the run ended first")
                    documents += _is_document(reader, line, path, position)
                    if bound is not None and documents >= bound:
                        return limit
            except UnicodeDecodeError as exc:
                raise Uncountable(f"{path} does not decode ({exc})") from None
    return max(0, documents - skip)


def _files(shard: ReaderShard) -> Iterator[str]:
    """The files of the shard, listed as the reader's `run` lists them (its order aside: it does not count)."""
    reader = shard.reader
    if reader.paths_file:
        yield from get_shard_from_paths_file(reader.paths_file, shard.rank, shard.world_size)
        return
    files = reader.data_folder.get_shard(
        shard.rank, shard.world_size, recursive=reader.recursive, glob_pattern=reader.glob_pattern
    )
    if files is None:
        raise Uncountable("its reader found no files")
    yield from files


def _is_document(reader: Any, line: str, path: str, position: int) -> bool:
    """Whether the reader makes a document of this line: JSON, and a text once adapted (as `read_file` and
    `get_document_from_dict` decide; what they would fail on fails the run, and the count does not matter)."""
    try:
        data = orjson.loads(line)
    except orjson.JSONDecodeError:
        return False
    if not isinstance(data, dict):
        raise Uncountable(f"line {position + 1} of {path} is not a JSON object")
    return bool(reader.adapter(data, path, position).get("text"))
