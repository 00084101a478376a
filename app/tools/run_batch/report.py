"""What run-batch shows: the progress (a bar on a terminal, else a line now and then) and what the line a
run ends with says of a failure."""

from __future__ import annotations

import time
from typing import TextIO

from app.checkpoints.output import FolderError, OutputError
from app.job.progress import InPlace, duration
from app.tools.run_batch.errors import BAD_INPUT, UNANSWERED, RunBatchError

REDRAW_S = 0.5
LOG_EVERY_S = 30.0
BAR_WIDTH = 24


class Progress:
    """A bar redrawn in place on a terminal, else a line every `LOG_EVERY_S`: done, failed, rate, ETA."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.interactive = stream.isatty()
        self._first: tuple[float, int] | None = None
        self._last = 0.0
        self._bar = InPlace(stream)  # a log record clears it first: never written into its middle

    def __enter__(self) -> Progress:
        if self.interactive:
            self._bar.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self._bar.close()

    def line(self, done: int, failed: int, total: int, now: float) -> str:
        if self._first is None:
            self._first = (now, done)
        started, done_then = self._first
        rate = (done - done_then) / (now - started) if now > started else 0.0
        share = min(done / total, 1.0) if total else 0.0
        parts = ["run-batch"]
        if self.interactive:
            filled = round(share * BAR_WIDTH)
            parts.append("[" + "#" * filled + "-" * (BAR_WIDTH - filled) + "]")
        # "failed": answered with an error, or never (the summary tells which)
        parts.append(f"{done:,}/{total:,} lines {share:.0%}, {failed:,} failed")
        if rate > 0:  # none yet, or all done before the first look (a rerun): no rate to show
            parts[-1] += f", {rate:,.1f} lines/s"
        if rate > 0 and done < total:
            parts.append(f"ETA {duration((total - done) / rate)}")
        return " ".join(parts)

    def update(self, done: int, failed: int, total: int, *, final: bool = False) -> None:
        if not total:  # still being checked
            return
        now = time.monotonic()
        line = self.line(done, failed, total, now)
        if not final and now - self._last < (REDRAW_S if self.interactive else LOG_EVERY_S):
            return
        self._last = now
        if self.interactive:
            self._bar.draw(line, end=final)
        else:
            self.stream.write(line + "\n")
            self.stream.flush()


def failure(exc: RunBatchError | OutputError | FolderError | OSError) -> tuple[int, str]:
    """The exit code of a run that raised `exc`, and what it says."""
    if isinstance(exc, RunBatchError):
        return exc.code, str(exc)
    if isinstance(exc, OutputError | FolderError):
        return BAD_INPUT, str(exc)
    # the state's disk refused a write, or went away
    return UNANSWERED, f"stopped: {exc}; rerun the same command to carry on once that is fixed"


def shorten(text: str, most: int = 240) -> str:
    """`text` cut to `most` characters: an upstream's error may carry a whole page."""
    return text if len(text) <= most else text[: most - 1] + "…"
