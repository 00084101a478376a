"""How far a job is: documents done of its total, the rate and the time left.

On a terminal one line is redrawn in place with `\\r` (at most every
`REDRAW_S`, however fast documents go); elsewhere (a pipe, a log file, a
batch scheduler's output) nothing is drawn and a log line at INFO says the
same every `LOG_EVERY_S`, so a log holds a few lines, not one per document.
A log record written to the same terminal while the line is shown clears it
first (`InPlace`): the record gets a line of its own, the next redraw shows the
line again below it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TextIO

logger = logging.getLogger(__name__)

REDRAW_S = 0.25
LOG_EVERY_S = 30.0
BAR_WIDTH = 24


def duration(seconds: float) -> str:
    """`42s`, `3m05s`, `2h07m`: an ETA is read at a glance, not to the second."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def describe(label: str, done: int, total: int | None, rate: float | None, *, bar: bool) -> str:
    """`rank 0 [#####-----] 512/1,000 documents 51% 42.0 docs/s ETA 12s`; without a total, no bar,
    share or ETA; without a rate yet (nothing processed), no rate or ETA."""
    parts = [label]
    if total:
        share = min(done / total, 1.0)
        if bar:
            filled = round(share * BAR_WIDTH)
            parts.append("[" + "#" * filled + "-" * (BAR_WIDTH - filled) + "]")
        parts.append(f"{done:,}/{total:,} documents {share:.0%}")
    else:
        parts.append(f"{done:,} documents")
    if rate is not None:
        parts.append(f"{rate:,.1f} docs/s")
        if total and rate > 0 and done < total:
            parts.append(f"ETA {duration((total - done) / rate)}")
    return " ".join(parts)


class InPlace(logging.Filter):
    """One line redrawn in place on a terminal stream, which no log record lands in the middle of.

    From `open()` to `close()` it is a filter of every handler of the root logger that writes to the same
    stream: before such a handler writes a record, the line shown is cleared (`\\r`, blanks, `\\r`).
    """

    def __init__(self, stream: TextIO) -> None:
        super().__init__()
        self.stream = stream
        self._width = 0  # of the line shown; 0: none
        self._lock = threading.Lock()  # records may come from other threads
        self._handlers: list[logging.Handler] = []

    def open(self) -> None:
        self._handlers = [h for h in logging.getLogger().handlers if getattr(h, "stream", None) is self.stream]
        for handler in self._handlers:
            handler.addFilter(self)

    def close(self) -> None:
        """No longer a filter; a line still shown (a run cut short) is cleared."""
        for handler in self._handlers:
            handler.removeFilter(self)
        self._handlers = []
        self.filter(None)

    def draw(self, line: str, *, end: bool = False) -> None:
        """Show `line` in place of the one shown (padded over a longer one); with `end`, end it with a newline:
        what comes next starts on its own line."""
        with self._lock:
            self.stream.write("\r" + line.ljust(self._width) + ("\n" if end else ""))
            self.stream.flush()
            self._width = 0 if end else len(line)

    def filter(self, record: logging.LogRecord | None) -> bool:
        with self._lock:
            if self._width:
                self.stream.write("\r" + " " * self._width + "\r")
                self.stream.flush()
                self._width = 0
        return True


class Progress:
    """A job's documents done (skipped on resume or processed now) against its total, if known.

    The rate counts only documents processed in this run: skipping what a
    previous run did is instant and would make the ETA a lie.
    """

    def __init__(self, label: str, total: int | None, stream: TextIO, *, interactive: bool) -> None:
        self.label = label
        self.total = total
        self.stream = stream
        self.interactive = interactive
        self.done = self.processed = 0
        self._start = self._last = time.monotonic()
        self._line = InPlace(stream)
        if interactive:
            self._line.open()

    def update(self, done: int, processed: int) -> None:
        self.done, self.processed = done, processed
        now = time.monotonic()
        if now - self._last >= (REDRAW_S if self.interactive else LOG_EVERY_S):
            self._last = now
            self._show(now)

    def close(self) -> None:
        """The last state and the time taken; on a terminal the line then ends, so that what is
        written next starts on its own."""
        now = time.monotonic()
        self._show(now, f" in {duration(now - self._start)}", end=True)
        self._line.close()

    def _rate(self, now: float) -> float | None:
        if not self.processed:
            return None
        return self.processed / max(now - self._start, 1e-3)

    def _show(self, now: float, suffix: str = "", *, end: bool = False) -> None:
        line = describe(self.label, self.done, self.total, self._rate(now), bar=self.interactive) + suffix
        if not self.interactive:
            logger.info("%s", line)
            return
        self._line.draw(line, end=end)
