"""kill -9 a process that is storing into the RequestCache: the file stays intact and every
answer acknowledged by flush() is there."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

WRITER = """
import asyncio, sys
from app.store.cache import RequestCache

async def main(path):
    cache = RequestCache(path, flush_interval_ms=10)
    await cache.initialize(0)
    i = 0
    while True:
        await cache.store_result(i // 100, f"doc-{i}", 0, {"text": "x" * 200, "i": i}, payload_hash="h")
        i += 1
        if i % 250 == 0:
            await cache.flush()
            print("FLUSHED", i, flush=True)
        if i % 10 == 0:
            await asyncio.sleep(0)

asyncio.run(main(sys.argv[1]))
"""


@pytest.mark.parametrize("flushes_before_kill", [1, 7, 20])
def test_kill_9_while_storing_never_corrupts_the_cache_nor_loses_a_flushed_answer(
    tmp_path: Path, flushes_before_kill: int
) -> None:
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    acknowledged = 0
    for line in proc.stdout:
        acknowledged = int(line.split()[1])
        if acknowledged >= flushes_before_kill * 250:
            proc.send_signal(signal.SIGKILL)
            break
    proc.stdout.close()
    proc.wait(timeout=30)
    assert acknowledged == flushes_before_kill * 250

    with sqlite3.connect(tmp_path / "00000" / "replay.sqlite3") as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        stored = {row[0] for row in conn.execute("SELECT doc_id FROM request_cache")}
    assert {f"doc-{i}" for i in range(acknowledged)} <= stored
