"""`inferproxy serve` keeps glibc's malloc to two arenas, whatever its threads (bench/README.md, soak)."""

from __future__ import annotations

import platform
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import Upstream, start_proxy
from tests.factories import chat_request
from tests.ops.test_memory import thread_heaps
from tests.servers import process, wait_for_http

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc arenas are glibc's"),
]


def test_a_proxy_serving_many_ranks_at_once_keeps_to_one_heap_besides_the_main_one(
    upstream: Upstream, tmp_path: Path
) -> None:
    args, port = start_proxy(upstream.url, tmp_path)
    url = f"http://127.0.0.1:{port}"
    with process(*args) as served, httpx.Client(base_url=url, timeout=30) as client:
        wait_for_http(url + "/healthz")

        def job(rank: int) -> None:  # each rank has its own SQLite connections, the writer's thread
            for i in range(20):
                headers = {"X-Rank": str(rank), "X-Doc-Id": f"d{i}", "X-Chunk-Index": "0"}
                answer = client.post(
                    "/v1/chat/completions",
                    json=chat_request(messages=[{"role": "user", "content": f"{rank} {i}"}]),
                    headers=headers,
                )
                assert answer.status_code == 200, answer.text
                documents = [{"id": f"d{i}", "text": f"text {i}"}]
                written = client.post("/documents", json=documents, headers={"X-Rank": str(rank), "X-Chunk-Index": "0"})
                assert written.status_code == 200, written.text

        with ThreadPoolExecutor(16) as pool:
            list(pool.map(job, range(16)))
        assert served.poll() is None
        assert thread_heaps(served.pid) <= 1
