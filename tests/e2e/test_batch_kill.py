"""A batch through a real `inferproxy serve` killed with SIGKILL at random moments, and stopped with SIGTERM,
then started again on the same directories: every line answered exactly once, nothing done paid twice."""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import running_upstream, start_proxy
from tests.servers import process, wait_for_http
from tests.service.test_batches import CHAT, chat_line, put_file, read_file

pytestmark = pytest.mark.e2e

LINES = 3000
INFLIGHT = 16
#: a kill's cost: lines sent, or answered and not yet on disk (twice `max_inflight_per_upstream`, contract §12)
UNWRITTEN = 2 * INFLIGHT


def batch_of(url: str, batch_id: str) -> dict[str, Any]:
    answer: dict[str, Any] = httpx.get(f"{url}/v1/batches/{batch_id}", timeout=10).json()
    return answer


def test_a_batch_killed_again_and_again_ends_with_every_line_once(tmp_path: Path) -> None:
    rng = random.Random(20)
    file_id = put_file(tmp_path / "checkpoints", [chat_line(f"line-{i}", f"question {i}") for i in range(LINES)])
    with running_upstream(latency_ms=50) as upstream:
        args, port = start_proxy(upstream.url, tmp_path, f"--max-inflight-per-upstream={INFLIGHT}")
        url = f"http://127.0.0.1:{port}"
        batch_id = None
        counts: list[int] = []
        for round_ in range(6):
            with process(*args) as proc:
                wait_for_http(url + "/healthz")
                if batch_id is None:
                    created = httpx.post(f"{url}/v1/batches", json={"input_file_id": file_id, "endpoint": CHAT})
                    assert created.status_code == 200, created.text
                    batch_id = created.json()["id"]
                time.sleep(rng.uniform(0.3, 1.5))
                counts.append(batch_of(url, batch_id)["request_counts"]["completed"])
                proc.send_signal(signal.SIGTERM if round_ == 3 else signal.SIGKILL)
                proc.wait(timeout=30)
        with process(*args):
            wait_for_http(url + "/healthz")
            deadline = time.monotonic() + 120
            while (batch := batch_of(url, batch_id))["status"] != "completed":
                assert time.monotonic() < deadline, batch
                assert batch["status"] in ("in_progress", "finalizing"), batch
                time.sleep(0.1)
        assert counts == sorted(counts), f"request_counts.completed went back: {counts}"
        assert 0 < counts[-1] < LINES, counts
        assert batch["request_counts"] == {"total": LINES, "completed": LINES, "failed": 0}
        output = read_file(tmp_path / "checkpoints", batch["output_file_id"])
        assert sorted(o["custom_id"] for o in output) == sorted(f"line-{i}" for i in range(LINES))
        assert batch["error_file_id"] is None
        # what was in flight at each of the six stops at most was generated twice
        generations = upstream.stats()["generations"]
        assert LINES <= generations <= LINES + 6 * UNWRITTEN, generations


def test_sigterm_stops_a_batch_sending_at_once_and_the_next_start_carries_on(tmp_path: Path) -> None:
    lines, inflight = 400, 4
    file_id = put_file(tmp_path / "checkpoints", [chat_line(f"t-{i}", f"question {i}") for i in range(lines)])
    with running_upstream(latency_ms=200) as upstream:
        args, port = start_proxy(upstream.url, tmp_path, f"--max-inflight-per-upstream={inflight}")
        url = f"http://127.0.0.1:{port}"
        with process(*args) as proc:
            wait_for_http(url + "/healthz")
            batch_id = httpx.post(f"{url}/v1/batches", json={"input_file_id": file_id, "endpoint": CHAT}).json()["id"]
            deadline = time.monotonic() + 30
            while batch_of(url, batch_id)["request_counts"]["completed"] < 8:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            sent = upstream.stats()["requests"]
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=20) == 0
        # what was in flight was answered (and kept); nothing new was sent once the signal came
        assert upstream.stats()["requests"] <= sent + inflight
        with process(*args):
            wait_for_http(url + "/healthz")
            deadline = time.monotonic() + 120
            while (batch := batch_of(url, batch_id))["status"] != "completed":
                assert time.monotonic() < deadline, batch
                time.sleep(0.1)
        output = read_file(tmp_path / "checkpoints", batch["output_file_id"])
        assert sorted(o["custom_id"] for o in output) == sorted(f"t-{i}" for i in range(lines))
        assert lines <= upstream.stats()["generations"] <= lines + inflight
