"""Real processes on free loopback ports: `inferproxy fake-upstream` and `inferproxy serve`."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.servers import free_port, process, wait_for_http


@dataclass
class Upstream:
    url: str
    proc: subprocess.Popen[bytes]

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = httpx.get(self.url + "/_fake/stats").json()
        return stats


@dataclass
class Proxy:
    url: str
    args: list[str]
    proc: subprocess.Popen[bytes]


@contextlib.contextmanager
def running_upstream(latency_ms: float = 0.0) -> Iterator[Upstream]:
    """`inferproxy fake-upstream` on a free port, answering after `latency_ms`."""
    port = free_port()
    with process("fake-upstream", f"--port={port}", f"--latency-ms={latency_ms:g}") as proc:
        url = f"http://127.0.0.1:{port}"
        wait_for_http(url + "/v1/models")
        yield Upstream(url, proc)


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    with running_upstream() as started:
        yield started


def start_proxy(upstream_url: str, data: Path, *extra: str, port: int | None = None) -> tuple[list[str], int]:
    port = port or free_port()
    args = [
        "serve",
        f"--port={port}",
        f"--upstream={upstream_url}",
        f"--checkpoints-dir={data / 'checkpoints'}",
        f"--output={data / 'output'}",
        "--retry-backoff-s=0.05",
        "--log-level=warning",
        *extra,
    ]
    return args, port


@pytest.fixture
def proxy(upstream: Upstream, tmp_path: Path) -> Iterator[Proxy]:
    args, port = start_proxy(upstream.url, tmp_path)
    with process(*args) as proc:
        url = f"http://127.0.0.1:{port}"
        wait_for_http(url + "/healthz")
        yield Proxy(url, args, proc)
