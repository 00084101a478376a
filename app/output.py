"""`ChunkOutputWriter`: publishes each chunk as one JSONL file that is whole or absent.

It has the surface of datatrove's `DiskWriter` that checkpointing uses
(`write`, `close_file`, `_get_output_filename`), so it is a drop-in
`output_writer_context` for `CheckpointManager`. Unlike a plain writer, a
chunk's documents go to a hidden temporary file (`.<name>.partial`) and
`close_file` publishes it: flush, fsync, `os.replace` onto the final name,
fsync of the directory. A crash leaves a stale partial file, never a
truncated output; the next write to that chunk starts the partial afresh,
as datatrove's writers reopen files in "wt" mode. A chunk whose documents
were all left out of the output publishes no file at all. Leaving the
`with` block normally publishes what is still open (the job's last, partial
chunk), as datatrove's writers do; leaving it by an exception does not.
"""

from __future__ import annotations

import dataclasses
import os
from string import Template
from typing import IO, Any

import orjson

from app.durable import fsync_dir, make_dirs_durable

DEFAULT_OUTPUT_FILENAME = "${rank}_chunk_${chunk_index}.jsonl"


def output_record(document: Any) -> dict[str, Any]:
    """The line datatrove's JsonlWriter writes by default: the document's non-empty fields."""
    if dataclasses.is_dataclass(document) and not isinstance(document, type):
        fields = dataclasses.asdict(document)
    else:
        fields = dict(vars(document))
    return {key: value for key, value in fields.items() if value}


class ChunkOutputWriter:
    """Writes documents into per-chunk JSONL files under `output_dir`, published atomically on close."""

    def __init__(self, output_dir: str, output_filename: str = DEFAULT_OUTPUT_FILENAME) -> None:
        self.output_dir = output_dir
        self.output_filename = Template(output_filename)
        self._open: dict[str, IO[bytes]] = {}
        self.published: list[str] = []

    def _get_output_filename(
        self, document: Any, rank: int | str = 0, chunk_index: int | None = None, **kwargs: Any
    ) -> str:
        values: dict[str, Any] = {"rank": str(rank).zfill(5), "id": document.id, **document.metadata, **kwargs}
        if chunk_index is not None:
            values["chunk_index"] = chunk_index
        return self.output_filename.substitute(values)

    def write(self, document: Any, rank: int = 0, **kwargs: Any) -> None:
        name = self._get_output_filename(document, rank, **kwargs)
        file = self._open.get(name)
        if file is None:
            partial = self._partial_path(name)
            make_dirs_durable(os.path.dirname(partial))
            file = self._open[name] = open(partial, "wb")  # noqa: SIM115 - closed by close_file / close
        file.write(orjson.dumps(output_record(document), option=orjson.OPT_APPEND_NEWLINE))

    def close_file(self, original_name: str) -> None:
        """Publish the file: afterwards `output_dir/original_name` exists whole."""
        file = self._open.pop(original_name, None)
        if file is None:
            return  # nothing was written to it: no empty file is published
        try:
            file.flush()
            os.fsync(file.fileno())
        finally:
            file.close()
        final = os.path.join(self.output_dir, original_name)
        os.replace(self._partial_path(original_name), final)
        fsync_dir(os.path.dirname(final))
        self.published.append(original_name)

    def close(self) -> None:
        """Publish every file still open, as datatrove's writers do when a job ends; idempotent."""
        for name in list(self._open):
            self.close_file(name)

    def abandon(self) -> None:
        """Close open files without publishing them (the job failed: a restart rewrites them)."""
        while self._open:
            _, file = self._open.popitem()
            file.close()

    def __enter__(self) -> ChunkOutputWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abandon()

    def _partial_path(self, name: str) -> str:
        directory, base = os.path.split(os.path.join(self.output_dir, name))
        return os.path.join(directory, f".{base}.partial")
