"""bench/soak.py's verdict, on runs made up for it (the soak itself takes minutes to an hour)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import soak


def run(duration: float, interval: float = 30.0) -> dict[str, Any]:
    """A flat run of `duration` s: a sample each `interval` s, a probe each 5 s."""
    latency = {kind: {"n": 100, "p50": 1.0, "p99": 2.0} for kind in soak.KINDS}
    samples = [
        {
            "t": t,
            "anon_mib": 30.0,
            "fds": 60,
            "requests_per_s": 200.0,
            "latency_ms": latency,
            "errors": {},
            "unexpected": {},
            "shed": 0,
        }
        for t in range(int(interval), int(duration) + 1, int(interval))
    ]
    probes = [soak.Probe(float(t), 50_000, 30 * 1024, 60, 10) for t in range(5, int(duration) + 1, 5)]
    return {"samples": samples, "probes": probes}


def test_a_run_that_ends_within_the_memory_warmup_is_judged_on_the_rest_not_refused() -> None:
    """`--long --duration 1200`: 15 minutes after the 5-minute warm-up, all within memory's 20. The run
    used to end in "too short to judge" after its 20 minutes, its JSON never written."""
    judged = soak.verdict(run(1200), 300.0, soak.MEMORY_WARMUP_LONG_S)
    assert judged["ok"]
    assert judged["descriptors"]["judged"]
    assert not judged["memory"]["judged"]


def test_memory_is_judged_after_its_own_warmup_in_a_long_run() -> None:
    judged = soak.verdict(run(3600), 300.0, soak.MEMORY_WARMUP_LONG_S)
    assert judged["memory"]["judged"]
    assert judged["memory"]["warmup"] == soak.MEMORY_WARMUP_LONG_S
