"""An upload to `/v1/files` is streamed to disk as it arrives: a 100 MiB one does not raise the peak memory of
a real `inferproxy serve` by anything near its size, and comes back byte for byte."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import httpx

from tests.servers import free_port, process, wait_for_http

MiB = 1 << 20
SIZE = 100 * MiB
BOUNDARY = "upl0ad"


def peak_rss(pid: int) -> int:
    """The process's peak resident memory so far, in bytes (`VmHWM`)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/PID/status")


def body(block: bytes, blocks: int) -> Iterator[bytes]:
    yield (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n\r\n'
    ).encode()
    for _ in range(blocks):
        yield block
    yield f"\r\n--{BOUNDARY}--\r\n".encode()


def test_a_100_mib_upload_does_not_raise_the_servers_peak_memory_by_its_size(tmp_path: Path) -> None:
    port = free_port()
    args = [
        "serve",
        f"--port={port}",
        "--upstream=http://127.0.0.1:9",
        f"--checkpoints-dir={tmp_path / 'checkpoints'}",
        f"--output={tmp_path / 'output'}",
        "--fsync=never",
        "--log-level=warning",
    ]
    block = os.urandom(MiB)
    headers = {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}
    with process(*args) as proc, httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
        wait_for_http(f"http://127.0.0.1:{port}/healthz")
        warm = client.post("/v1/files", content=body(block, 2), headers=headers)  # every code path run once
        assert warm.status_code == 200, warm.text
        before = peak_rss(proc.pid)
        uploaded = client.post("/v1/files", content=body(block, SIZE // MiB), headers=headers)
        grown = peak_rss(proc.pid) - before
        assert uploaded.status_code == 200, uploaded.text
        assert uploaded.json()["bytes"] == SIZE
        assert grown < 24 * MiB, f"the server's peak memory grew by {grown / MiB:.0f} MiB for a 100 MiB upload"

        digest = hashlib.sha256()
        with client.stream("GET", f"/v1/files/{uploaded.json()['id']}/content") as answer:
            for piece in answer.iter_bytes():
                digest.update(piece)
        assert digest.digest() == hashlib.sha256(block * (SIZE // MiB)).digest()
        assert peak_rss(proc.pid) - before < 24 * MiB  # nor does its download
