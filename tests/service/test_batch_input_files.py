"""A batch's input that is no JSON Lines at all (gzip-compressed, binary, one JSON array): the batch fails
with one error in `errors.data` that says so in words, not the JSON parser's."""

from __future__ import annotations

import gzip
import json
from typing import Any

import orjson
import pytest

from app.service.settings import Settings
from tests.service.test_batches import CHAT, chat_line, final, proxy, put_file, settings, until, upstream  # noqa: F401

GOOD = b"".join(orjson.dumps(chat_line(f"ok-{i}", f"q{i}")) + b"\n" for i in range(3))


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (gzip.compress(GOOD), "the file is gzip-compressed: gunzip it"),
        (bytes(range(1, 256)) * 8, "the file is not UTF-8 text (its first KB is not): give the batch file, in UTF-8"),
        (b"PK\x03\x04\0\0" + GOOD, "the file is not text: its first KB holds NUL bytes"),
        (
            json.dumps([chat_line("a", "q"), chat_line("b", "q")], indent=2).encode(),
            "the file looks like one JSON array, not one request per line: write one JSON object per line "
            "(jq -c '.[]' does)",
        ),
        (b"\n" + json.dumps([chat_line("a", "q")]).encode() + b"\n", "the file looks like one JSON array"),
    ],
)
async def test_a_file_that_is_no_json_lines_fails_the_batch_with_one_error_saying_what_it_is(
    settings: Settings,  # noqa: F811
    upstream: Any,  # noqa: F811
    raw: bytes,
    message: str,
) -> None:
    url, fake = upstream
    file_id = put_file(settings.checkpoints_dir, [], raw=raw)
    async for client in proxy(settings, url):
        created = await client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": CHAT})
        batch = await until(client, created.json()["id"], final)
    assert batch["status"] == "failed"
    [error] = batch["errors"]["data"]
    assert error["code"] == "invalid_json_line"
    assert error["message"].startswith(message), error
    assert error["line"] == (2 if raw.startswith(b"\n[") else 1)
    assert fake.requests == 0


async def test_a_line_that_is_not_utf8_past_the_files_start_is_named_as_such(
    settings: Settings,  # noqa: F811
    upstream: Any,  # noqa: F811
) -> None:
    url, _ = upstream
    lines = b"".join(orjson.dumps(chat_line(f"ok-{i}", f"question {i}")) + b"\n" for i in range(20))
    latin1 = json.dumps(chat_line("cafe", "caf\u00e9"), ensure_ascii=False).encode("latin-1")
    file_id = put_file(settings.checkpoints_dir, [], raw=lines + latin1 + b"\n")
    async for client in proxy(settings, url):
        created = await client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": CHAT})
        batch = await until(client, created.json()["id"], final)
    assert batch["errors"]["data"] == [
        {"code": "invalid_json_line", "line": 21, "message": "the line is not UTF-8 text", "param": None}
    ]
