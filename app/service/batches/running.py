"""What the engine keeps of each batch it runs, and the upstream slots its batches share.

`Running` is one batch's state in this proxy (its record, its lines done as a bit set `Lines`, its tasks,
the answers waiting for their write, the writes its disk refuses); `FairShare` hands the slots out to the
running batches in turn, so that a large batch does not starve a small one. Nothing here does I/O.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time

from app.store.batches import BatchDir, BatchRecord, Result


class FairShare:
    """`capacity` slots shared by the running batches in turn: a slot released goes to the next batch in
    the rotation that waits for one, so each running batch gets its share whatever its size."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.held = 0
        self._waiting: collections.OrderedDict[str, collections.deque[asyncio.Future[None]]] = collections.OrderedDict()

    async def acquire(self, batch_id: str) -> None:
        if self.held < self.capacity and not self._waiting:
            self.held += 1
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(batch_id, collections.deque()).append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()
            else:
                queue = self._waiting.get(batch_id)
                if queue is not None:
                    with contextlib.suppress(ValueError):
                        queue.remove(waiter)
                    if not queue:
                        del self._waiting[batch_id]
            raise

    def release(self) -> None:
        while self._waiting:
            batch_id, queue = next(iter(self._waiting.items()))
            waiter = queue.popleft()
            del self._waiting[batch_id]
            if queue:
                self._waiting[batch_id] = queue  # to the end of the rotation
            if not waiter.done():
                waiter.set_result(None)
                return
        self.held -= 1


class Lines:
    """A set of line numbers, one bit each: a million lines in 125 KB."""

    def __init__(self) -> None:
        self.bits = bytearray()

    def __contains__(self, line: int) -> bool:
        byte = line >> 3
        return byte < len(self.bits) and bool(self.bits[byte] & (1 << (line & 7)))

    def add(self, line: int) -> None:
        byte = line >> 3
        if byte >= len(self.bits):
            self.bits.extend(bytes(max(byte + 1 - len(self.bits), len(self.bits) // 2)))
        self.bits[byte] |= 1 << (line & 7)


class Running:
    """A batch this proxy runs: its record, which lines are done, and its tasks."""

    def __init__(self, folder: BatchDir, record: BatchRecord) -> None:
        self.dir = folder
        self.record = record
        self.done = Lines()
        self.task: asyncio.Task[None] | None = None
        self.in_flight: set[asyncio.Task[None]] = set()  # its lines not yet on disk (their tasks)
        self.sending = 0  # of those, the lines at the upstream (or its cache) now
        self.stopping = asyncio.Event()
        #: answered, not yet on disk: the writer's next round
        self.pending: list[Result] = []
        self.wake = asyncio.Event()
        #: notified once a round is on disk (`_write_results`)
        self.written = asyncio.Condition()
        self.saved_counts = (-1, -1)
        #: held by each save of batch.json (`BatchEngine._saved`): one at a time, in order
        self.saving = asyncio.Lock()
        self.hits = 0
        self.started_at = time.monotonic()
        self.completed_at_start = 0
        #: results.jsonl just read back (by `adopt`), not to be read again by the first `_execute`
        self.loaded = False
        #: the batch's writes its disk refuses now (`results`, `record`, `step`: a step of `_drive`), each with
        #: why; while there is one, no new line is sent (`resumed` is clear)
        self.refused: dict[str, str] = {}
        self.gone = False  # its folder removed by hand: run no more
        self.resumed = asyncio.Event()
        self.resumed.set()

    def is_done(self, line: int) -> bool:
        return line in self.done

    def mark_done(self, line: int) -> None:
        self.done.add(line)
