"""app.job.progress: the job's progress line, and how often it is drawn."""

from __future__ import annotations

import contextlib
import io
import logging
import time
from collections.abc import Iterator

from app.job.progress import REDRAW_S, InPlace, Progress, describe, duration


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


def screen(written: str) -> list[str]:
    """What a terminal shows of `written`: each `\\r` goes back to the line's start, later text over earlier."""
    shown = []
    for line in written.split("\n"):
        row = ""
        for part in line.split("\r"):
            row = part + row[len(part) :]
        shown.append(row.rstrip())
    return shown


@contextlib.contextmanager
def logging_to(stream: io.StringIO) -> Iterator[logging.Logger]:
    """A handler of the root logger writing to `stream`, as `inferproxy`'s own writes to stderr."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield logging.getLogger("app.test")
    finally:
        root.removeHandler(handler)


def test_a_log_record_written_while_the_line_is_shown_gets_a_line_of_its_own() -> None:
    terminal = io.StringIO()
    with logging_to(terminal) as logger:
        progress = Progress("rank 0", 1000, terminal, interactive=True)
        progress.update(100, 100)
        progress._show(time.monotonic())  # drawn now, whatever the clock
        logger.warning("rank 0: chunk 3 published")
        progress.update(1000, 1000)
        progress.close()
        logger.warning("after the job")
    rows = screen(terminal.getvalue())
    assert rows[0] == "WARNING rank 0: chunk 3 published", rows
    assert rows[1].startswith("rank 0 [########################] 1,000/1,000 documents 100%"), rows
    assert rows[2:] == ["WARNING after the job", ""], rows


def test_a_line_is_left_alone_by_handlers_writing_elsewhere_and_cleared_when_closed_early() -> None:
    terminal, log_file = io.StringIO(), io.StringIO()
    with logging_to(log_file) as logger:
        line = InPlace(terminal)
        line.open()
        line.draw("run-batch [#---] 1/4 lines")
        logger.warning("to the log file")
        assert terminal.getvalue() == "\rrun-batch [#---] 1/4 lines"  # not cleared: the record went elsewhere
        line.close()  # cut short, the line is cleared: what comes next starts at the line's start
        logger.warning("not filtered any more")
    assert screen(terminal.getvalue()) == [""]
    assert log_file.getvalue() == "WARNING to the log file\nWARNING not filtered any more\n"
