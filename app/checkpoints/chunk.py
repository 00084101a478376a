"""`Chunk`: everything a `CheckpointManager` knows about one of a rank's chunks, in one object.

A chunk's life is one explicit state (as h11 keeps a connection's)::

    OPEN  --all its documents, or declared complete-->  READY  --output closed-->  PUBLISHED

and then, once `last_chunk` has moved over it, the manager drops the object:
whatever the chunk held (its ids, count, output, open file, lock) goes with it, so no
piece can be left behind. A chunk whose checkpoint file is found gone is
dropped the same way, from READY.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field

from app.checkpoints.documents import OutputWriter
from app.store.durable import AppendFile

__all__ = ["Chunk", "ChunkState"]


class ChunkState(enum.Enum):
    OPEN = "open"  # takes documents
    READY = "ready"  # has all its documents (or was declared complete): its output is to be closed
    PUBLISHED = "published"  # its output is closed; it waits for `last_chunk` to move over it


@dataclass(eq=False, slots=True)
class Chunk:
    """One chunk of a rank, from its first document (or its completion) until the manager drops it.

    `count` is the number of distinct documents in it (without a checkpoints
    dir, the number written: nothing is remembered then), `ids` their ids (`unsynced` those not yet durable),
    `output` the output writer and file name its documents went to, closed
    when it is published. `file` is its checkpoint file while open, `lock`
    serialises the writes to it.
    """

    index: int
    state: ChunkState = ChunkState.OPEN
    count: int = 0
    ids: set[str] = field(default_factory=set)
    #: Those of `ids` whose append waits for its fsync: not yet counted by a resume point.
    unsynced: set[str] = field(default_factory=set)
    output: tuple[OutputWriter, str] | None = None
    warned_duplicate: bool = False  # a repeated id was logged once; the next are not
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    file: AppendFile | None = None

    def take_file(self) -> AppendFile | None:
        """Its open checkpoint file, for the caller to close: a writer syncing after this finds none."""
        file, self.file = self.file, None
        return file

    def mark_ready(self) -> None:
        """It has all its documents, or the job says it has: publish it next. A chunk past OPEN stays where it is."""
        if self.state is ChunkState.OPEN:
            self.state = ChunkState.READY

    def mark_published(self) -> None:
        """Its output is closed; it waits for the chunks before it."""
        assert self.state is ChunkState.READY, self.state
        self.state = ChunkState.PUBLISHED
