"""The Batch API in front of a real vLLM: a batch of chat lines through `inferproxy serve`, the proxy killed
(SIGKILL) mid-batch and started again on the same directories.

Generations are counted by vLLM itself (`vllm:request_success_total`, every finish reason summed, the
server being the suite's, shared: counted as a difference): the proxy killed with lines in flight may
pay for those again (their answers were not durable yet, or were cut), never for a line whose answer
was recorded, so vLLM finishes at most the lines plus those not yet on disk (twice `max_inflight_per_upstream`).
"""

from __future__ import annotations

import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.servers import free_port, process, wait_for_http
from tests.service.test_batches import CHAT, put_file, read_file
from tests.vllm.helpers import IGNORE_EOS, chat_body, generations_at_least
from tests.vllm.server import MODEL, VLLM
from tests.vllm.tiny_model import MAX_MODEL_LEN

pytestmark = pytest.mark.e2e

LINES = 80
INFLIGHT = 8
#: a kill's cost: lines sent, or answered and not yet on disk (twice `max_inflight_per_upstream`, contract §12)
UNWRITTEN = 2 * INFLIGHT
#: With `ignore_eos`, every answer this long: ~3 s for the batch here, a kill after a quarter lands mid-batch.
TOKENS = 24


def batch_of(url: str, batch_id: str) -> dict[str, Any]:
    answer = httpx.get(f"{url}/v1/batches/{batch_id}", timeout=10)
    assert answer.status_code == 200, answer.text
    batch: dict[str, Any] = answer.json()
    return batch


def test_a_batch_through_vllm_with_the_proxy_killed_mid_batch_answers_every_line_once(
    vllm: VLLM, tmp_path: Path
) -> None:
    lines = [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": CHAT,
            "body": chat_body(f"question {i} of the batch", max_tokens=TOKENS, **IGNORE_EOS),
        }
        for i in range(LINES)
    ]
    too_long = {
        "custom_id": "too-long",
        "method": "POST",
        "url": CHAT,
        "body": chat_body("the " * (MAX_MODEL_LEN + 10)),
    }
    lines.insert(LINES // 2, too_long)
    checkpoints = tmp_path / "checkpoints"
    file_id = put_file(checkpoints, lines)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = [
        "serve",
        f"--port={port}",
        f"--upstream={vllm.url}",
        f"--checkpoints-dir={checkpoints}",
        f"--output={tmp_path / 'output'}",
        f"--max-inflight-per-upstream={INFLIGHT}",
        "--log-level=warning",
    ]
    before = vllm.generations()
    seen: list[int] = []
    with process(*args) as proc:
        wait_for_http(url + "/healthz")
        created = httpx.post(f"{url}/v1/batches", json={"input_file_id": file_id, "endpoint": CHAT}, timeout=30)
        assert created.status_code == 200, created.text
        batch_id = created.json()["id"]
        deadline = time.monotonic() + 60
        while (completed := batch_of(url, batch_id)["request_counts"]["completed"]) < LINES // 4:
            assert time.monotonic() < deadline, "no quarter of the batch done in 60 s"
            seen.append(completed)
            time.sleep(0.02)
        seen.append(completed)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    killed_at = seen[-1]
    assert killed_at < LINES, f"the kill came after the batch was done: {killed_at} completed"
    with process(*args):
        wait_for_http(url + "/healthz")
        deadline = time.monotonic() + 90
        while (batch := batch_of(url, batch_id))["status"] != "completed":
            assert batch["status"] in ("in_progress", "finalizing"), batch
            assert time.monotonic() < deadline, batch
            seen.append(batch["request_counts"]["completed"])
            time.sleep(0.05)
    assert seen == sorted(seen), f"request_counts.completed went back across the restart: {seen}"
    assert batch["request_counts"] == {"total": LINES + 1, "completed": LINES, "failed": 1}

    output = read_file(checkpoints, batch["output_file_id"])
    errors = read_file(checkpoints, batch["error_file_id"])
    assert Counter(o["custom_id"] for o in output) == Counter(f"line-{i}" for i in range(LINES))
    for line in output:
        assert line["error"] is None
        assert line["response"]["status_code"] == 200
        answer = line["response"]["body"]
        assert (answer["object"], answer["model"]) == ("chat.completion", MODEL), answer
        assert answer["choices"][0]["message"]["role"] == "assistant"
        assert answer["usage"]["completion_tokens"] == TOKENS
    [refused] = errors
    assert refused["custom_id"] == "too-long"
    assert refused["response"]["status_code"] == 400
    message = refused["response"]["body"]["error"]["message"]
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in message, message

    # vLLM's count trails its answers by a moment: once it shows every line, a moment more for the rest
    generations_at_least(vllm, before + LINES)
    time.sleep(1)
    paid = vllm.generations() - before
    print(f"vLLM finished {paid:g} requests for {LINES} lines, killed at {killed_at} completed")
    assert LINES <= paid <= LINES + UNWRITTEN, f"vLLM finished {paid:g} requests for {LINES} lines"
