"""app.job.progress: the job's progress line, and how often it is drawn."""

from __future__ import annotations

import io
import time

from app.job.progress import REDRAW_S, Progress, describe, duration


def test_a_line_with_a_total_has_a_bar_the_share_the_rate_and_the_time_left() -> None:
    line = describe("rank 0", 2500, 10_000, 50.0, bar=True)
    assert line == "rank 0 [######------------------] 2,500/10,000 documents 25% 50.0 docs/s ETA 2m30s"
    assert (
        describe("rank 0", 2500, 10_000, 50.0, bar=False) == "rank 0 2,500/10,000 documents 25% 50.0 docs/s ETA 2m30s"
    )


def test_without_a_total_the_line_counts_and_without_a_rate_it_makes_no_promise() -> None:
    assert describe("rank 3", 12, None, 4.0, bar=True) == "rank 3 12 documents 4.0 docs/s"
    assert describe("rank 0", 600, 1000, None, bar=False) == "rank 0 600/1,000 documents 60%"


def test_durations_are_read_at_a_glance() -> None:
    assert [duration(s) for s in (0.4, 42, 185, 7620)] == ["0s", "42s", "3m05s", "2h07m"]


def test_a_terminal_line_is_redrawn_at_most_every_redraw_interval_however_fast_documents_go() -> None:
    terminal = io.StringIO()
    progress = Progress("rank 0", 200_000, terminal, interactive=True)
    start = time.monotonic()
    for done in range(1, 200_001):
        progress.update(done, done)
    elapsed = time.monotonic() - start
    progress.close()
    drawn = terminal.getvalue()
    assert drawn.count("\r") <= elapsed / REDRAW_S + 2  # the redraws, and the last line
    assert "200,000/200,000 documents 100%" in drawn.rsplit("\r", 1)[1]
