"""The Batch API end to end with the `openai` package, against a real `inferproxy serve` (with `--api-key`)
in front of `inferproxy fake-upstream`: upload, create, retrieve until done, download the output and
error files, list, cancel; every batch and file route refused without the key."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.conftest import Upstream, running_upstream, start_proxy
from tests.servers import process, wait_for_http

pytestmark = pytest.mark.e2e

KEY = "batch-secret"
FINAL = ("completed", "failed", "expired", "cancelled")


def line(custom_id: str, text: str, **extra: Any) -> bytes:
    body = {"model": "fake-model", "messages": [{"role": "user", "content": text}], "max_tokens": 8, **extra}
    request = {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}
    return json.dumps(request).encode() + b"\n"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Upstream]]:
    with running_upstream(latency_ms=30) as upstream:
        args, port = start_proxy(
            upstream.url, tmp_path_factory.mktemp("proxy"), f"--api-key={KEY}", "--max-inflight-per-upstream=4"
        )
        with process(*args):
            url = f"http://127.0.0.1:{port}"
            wait_for_http(url + "/healthz")
            yield url, upstream


def wait_final(client: openai.OpenAI, batch_id: str) -> Any:
    deadline = time.monotonic() + 60
    while (batch := client.batches.retrieve(batch_id)).status not in FINAL:
        assert time.monotonic() < deadline, batch
        time.sleep(0.1)
    return batch


def test_the_openai_package_runs_a_batch_from_upload_to_download(served: tuple[str, Upstream]) -> None:
    url, upstream = served
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    data = b"".join(line(f"q-{i}", f"question {i}") for i in range(30))
    data += line("bad", "x", fake_upstream={"status": 400})
    uploaded = client.files.create(file=("requests.jsonl", io.BytesIO(data)), purpose="batch")
    assert uploaded.bytes == len(data)
    assert client.files.content(uploaded.id).content == data

    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"run": "1"}
    )
    assert batch.status in ("validating", "in_progress")
    batch = wait_final(client, batch.id)
    assert batch.status == "completed"
    assert batch.request_counts is not None
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (31, 30, 1)
    assert batch.metadata == {"run": "1"}
    assert batch.output_file_id
    assert batch.error_file_id
    output = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    errors = [json.loads(x) for x in client.files.content(batch.error_file_id).text.splitlines()]
    assert sorted(o["custom_id"] for o in output) == sorted(f"q-{i}" for i in range(30))
    assert all(o["response"]["body"]["choices"][0]["message"]["content"] for o in output)
    assert [(e["custom_id"], e["response"]["status_code"]) for e in errors] == [("bad", 400)]
    assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"
    assert upstream.stats()["generations"] == 30

    # the same file again: answered from the first batch, nothing generated
    again = wait_final(
        client,
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h").id,
    )
    assert again.status == "completed"
    assert upstream.stats()["generations"] == 30

    # a slow batch cancelled part-way: the finished lines are kept, nothing more is sent
    slow = b"".join(line(f"s-{i}", f"slow {i}", fake_upstream={"latency_ms": 100}) for i in range(200))
    big = client.files.create(file=("slow.jsonl", io.BytesIO(slow)), purpose="batch")
    running = client.batches.create(input_file_id=big.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 30
    while (client.batches.retrieve(running.id).request_counts.completed or 0) < 4:  # type: ignore[union-attr]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with pytest.raises(openai.ConflictError, match="cancel the batch"):
        client.files.delete(big.id)  # a running batch reads it still
    assert client.batches.cancel(running.id).status in ("cancelling", "cancelled")
    cancelled = wait_final(client, running.id)
    assert cancelled.status == "cancelled"
    sent = upstream.stats()["requests"]
    kept = [json.loads(x) for x in client.files.content(cancelled.output_file_id).text.splitlines()]
    assert len(kept) == cancelled.request_counts.completed >= 4
    time.sleep(0.5)
    assert upstream.stats()["requests"] == sent, "a line was sent after the batch was cancelled"

    listed = client.batches.list(limit=2)
    assert [b.id for b in listed.data] == [running.id, again.id]
    assert listed.has_more
    assert [b.id for b in client.batches.list(after=again.id).data] == [batch.id]
    assert client.files.delete(batch.output_file_id).deleted
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_000000000000000000000000")


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/files"),
        ("GET", "/v1/files"),
        ("GET", "/v1/files/file-000000000000000000000000"),
        ("GET", "/v1/files/file-000000000000000000000000/content"),
        ("HEAD", "/v1/files/file-000000000000000000000000"),
        ("HEAD", "/v1/files/file-000000000000000000000000/content"),
        ("DELETE", "/v1/files/file-000000000000000000000000"),
        ("POST", "/v1/batches"),
        ("GET", "/v1/batches"),
        ("GET", "/v1/batches/batch_000000000000000000000000"),
        ("POST", "/v1/batches/batch_000000000000000000000000/cancel"),
    ],
)
def test_every_batch_and_file_route_needs_the_key(served: tuple[str, Upstream], method: str, path: str) -> None:
    url, upstream = served
    before = upstream.stats()["requests"]  # its readiness wait's
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        answer = httpx.request(method, url + path, headers=headers, timeout=10)
        assert answer.status_code == 401, (method, path, answer.text)
        if method != "HEAD":  # a HEAD's answer has no body
            assert answer.json()["error"]["type"] == "authentication_error"
    assert upstream.stats()["requests"] == before
