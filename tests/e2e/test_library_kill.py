"""kill -9 a real job built on app.checkpoints.manager at random moments; the output ends exactly once."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

JOB = Path(__file__).with_name("library_job.py")
N_DOCS, RECORDS_PER_CHUNK, CONCURRENCY = 600, 50, 16


def start(checkpoints: Path, output: Path) -> subprocess.Popen[str]:
    args = [sys.executable, str(JOB), str(checkpoints), str(output), str(N_DOCS), str(RECORDS_PER_CHUNK)]
    return subprocess.Popen(
        [*args, str(CONCURRENCY)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1
    )


def test_kill_9_at_random_moments_loses_no_acknowledged_document(tmp_path: Path) -> None:
    checkpoints, output = tmp_path / "checkpoints", tmp_path / "output"
    rng = random.Random(int(os.environ.get("LIBRARY_KILL_SEED", "7")))
    acknowledged: set[str] = set()
    generations = 0
    kills = 0
    deadline = time.monotonic() + 120
    while True:
        assert time.monotonic() < deadline, "the job did not finish in time"
        proc = start(checkpoints, output)
        assert proc.stdout is not None
        kill_after = rng.randint(20, 150) if kills < 4 else None
        acks_this_run = 0
        finished = False
        for line in proc.stdout:
            event, _, rest = line.rstrip("\n").partition(" ")
            if event == "RESUME":
                skip_text, _, ids_text = rest.partition(" ")
                skip, processed = int(skip_text), set(json.loads(ids_text))
                position = {f"doc-{i}": i for i in range(N_DOCS)}
                lost = {d for d in acknowledged if position[d] >= skip and d not in processed}
                assert not lost, f"acknowledged documents lost by the kill: {sorted(lost)[:5]}"
            elif event == "GEN":
                generations += 1
            elif event == "ACK":
                acknowledged.add(rest)
                acks_this_run += 1
                if kill_after is not None and acks_this_run >= kill_after:
                    proc.send_signal(signal.SIGKILL)
                    break
            elif event == "DONE":
                finished = True
        proc.stdout.close()
        proc.wait(timeout=30)
        if finished:
            break
        kills += 1

    assert kills == 4
    published: list[str] = []
    for f in sorted(output.glob("*.jsonl")):
        published += [json.loads(line)["id"] for line in f.read_text().splitlines() if line.strip()]
    assert sorted(published) == sorted(f"doc-{i}" for i in range(N_DOCS))  # every document exactly once
    assert (checkpoints / "last_chunk" / "00000.txt").read_text() == str((N_DOCS - 1) // RECORDS_PER_CHUNK)
    # each kill can cost what was in flight plus one cache flush window, never a chunk's worth
    assert generations <= N_DOCS + kills * 3 * CONCURRENCY
