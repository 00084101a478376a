"""The chaos suite's options: short counts for `make test`, `--chaos-long` for the benchmark machine, and
the seed of every random moment, printed with any failure so that the run can be repeated."""

from __future__ import annotations

import random
import time
from collections.abc import Generator
from dataclasses import dataclass

import pytest

SHORT_SEED = 20251201


@dataclass(frozen=True)
class Chaos:
    long: bool
    seed: int

    def rng(self, name: str) -> random.Random:
        """A generator of its own for each use, so that one scenario's draws do not shift another's."""
        return random.Random(f"{self.seed}:{name}")

    def count(self, short: int, long: int) -> int:
        return long if self.long else short


@pytest.fixture
def chaos(request: pytest.FixtureRequest) -> Chaos:
    long = bool(request.config.getoption("--chaos-long"))
    seed = request.config.getoption("--chaos-seed")
    if seed is None:
        seed = time.time_ns() % 1_000_000_007 if long else SHORT_SEED
    return Chaos(long, seed)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    chaos = getattr(item, "funcargs", {}).get("chaos")
    if report.failed and isinstance(chaos, Chaos):
        mode = " --chaos-long" if chaos.long else ""
        report.sections.append(("chaos", f"seed {chaos.seed}: repeat with --chaos-seed {chaos.seed}{mode}"))
    return report
