"""A rank's total counted from its reader (app/integrations/datatrove/totals.py): exactly the documents
datatrove's own JsonlReader yields for the rank, or no count at all."""

from __future__ import annotations

import gzip
import json
import threading
from pathlib import Path
from typing import Any

import pytest
from datatrove.pipeline.filters import LambdaFilter
from datatrove.pipeline.readers import JsonlReader

from app.integrations.datatrove.totals import Uncountable, count_documents, reader_shard


def lines_of(prefix: str, documents: int) -> list[str]:
    return [json.dumps({"id": f"{prefix}-{i}", "text": f"text {i}"}) for i in range(documents)]


def write_input(folder: Path) -> Path:
    """Three files, and lines the reader drops: blank, not JSON, a text empty or missing under its key."""
    folder.mkdir()
    odd = ["", "{not json", json.dumps({"id": "empty", "text": ""}), json.dumps({"id": "none", "body": "x"})]
    (folder / "a.jsonl").write_text("\n".join(lines_of("a", 7)[:3] + odd + lines_of("a", 7)[3:]) + "\n")
    (folder / "b.jsonl.gz").write_bytes(gzip.compress(("\n".join(lines_of("b", 5)) + "\n").encode()))
    (folder / "c.jsonl").write_text("\n".join(lines_of("c", 4)))  # no newline at the end
    return folder


def counted(reader: JsonlReader, rank: int = 0, world_size: int = 1) -> int:
    return count_documents(reader_shard(reader.run(None, rank, world_size)), threading.Event())


def read(reader: JsonlReader, rank: int = 0, world_size: int = 1) -> int:
    return sum(1 for _ in reader.run(None, rank, world_size))


@pytest.mark.parametrize(
    "options", [{}, {"skip": 4}, {"limit": 9}, {"skip": 2, "limit": 5}, {"limit": 100}, {"skip": 100}, {"limit": 0}]
)
def test_the_count_is_what_jsonlreader_yields_with_its_skip_and_limit(tmp_path: Path, options: dict[str, int]) -> None:
    folder = write_input(tmp_path / "input")
    assert counted(JsonlReader(str(folder), **options)) == read(JsonlReader(str(folder), **options))


def test_each_rank_counts_its_own_shard_of_files(tmp_path: Path) -> None:
    folder = write_input(tmp_path / "input")
    assert [counted(JsonlReader(str(folder)), rank, 2) for rank in (0, 1)] == [7 + 4, 5]
    assert [read(JsonlReader(str(folder)), rank, 2) for rank in (0, 1)] == [7 + 4, 5]


def test_a_text_key_of_the_readers_own_is_counted_as_it_reads_it(tmp_path: Path) -> None:
    folder = write_input(tmp_path / "input")
    # only the line {"id": "none", "body": "x"} has a "body"
    assert counted(JsonlReader(str(folder), text_key="body")) == read(JsonlReader(str(folder), text_key="body")) == 1


def test_a_paths_file_gives_the_files_as_it_gives_them_to_the_reader(tmp_path: Path) -> None:
    folder = write_input(tmp_path / "input")
    paths = tmp_path / "paths.txt"
    paths.write_text("b.jsonl.gz\nc.jsonl\n")
    assert counted(JsonlReader(str(folder), paths_file=str(paths))) == 5 + 4


def uncountable(data: Any) -> str:
    with pytest.raises(Uncountable) as raised:
        reader_shard(data)
    return str(raised.value)


def test_nothing_is_counted_where_the_runners_input_need_not_be_the_readers_files(tmp_path: Path) -> None:
    folder = str(write_input(tmp_path / "input"))
    filtered = LambdaFilter(lambda document: True)(JsonlReader(folder).run(None, 0, 1), 0, 1)
    assert "step between them" in uncountable(filtered)
    assert "step between them" in uncountable(iter([]))

    class Subclass(JsonlReader):  # type: ignore[misc]  # datatrove is untyped
        pass

    assert "Subclass" in uncountable(Subclass(folder).run(None, 0, 1))
    adapted = JsonlReader(folder, adapter=lambda self, data, path, line: {"text": "x", "id": str(line)})
    assert "adapter" in uncountable(adapted.run(None, 0, 1))
    assert "step before it" in uncountable(JsonlReader(folder).run(iter([object()]), 0, 1))
    started = JsonlReader(folder).run(None, 0, 1)
    next(started)
    assert "started" in uncountable(started)
    assert "not local" in uncountable(JsonlReader(f"memory://{folder}").run(None, 0, 1))


def test_a_file_that_does_not_decode_or_holds_json_that_is_no_object_stops_the_count(tmp_path: Path) -> None:
    folder = tmp_path / "input"
    folder.mkdir()
    (folder / "a.jsonl").write_bytes(b'{"id": "a", "text": "t"}\n{"id": "b", "text": "\xff"}\n')
    with pytest.raises(Uncountable, match="does not decode"):
        counted(JsonlReader(str(folder)))
    (folder / "a.jsonl").write_text('{"id": "a", "text": "t"}\n[1, 2]\n')
    with pytest.raises(Uncountable, match=r"line 2 of .* is not a JSON object"):
        counted(JsonlReader(str(folder)))


def test_a_stop_ends_the_count_without_a_total(tmp_path: Path) -> None:
    folder = write_input(tmp_path / "input")
    stop = threading.Event()
    stop.set()
    with pytest.raises(Uncountable, match="ended first"):
        count_documents(reader_shard(JsonlReader(str(folder)).run(None, 0, 1)), stop)
