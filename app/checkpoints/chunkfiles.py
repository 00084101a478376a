"""`ChunkFiles`: opening, syncing and removing the checkpoint files of a rank's unfinished chunks.

Each chunk's file is opened (created durably: its directory fsynced) on its
first append and kept open, by its `Chunk`, until the chunk completes. `make_durable` waits
for an fsync that started after the caller's append, shared with every
concurrent writer (`GroupSync`). A failed fsync breaks the whole set: after
it the kernel may have dropped the pages, so the only safe state is the one
a restart reads back (as PostgreSQL does), and every later call raises
`CheckpointDurabilityError` until the job restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import Literal

from app.store.durable import AppendFile, GroupSync, fsync_dir, make_dirs_durable

logger = logging.getLogger(__name__)

FsyncPolicy = Literal["always", "never"]


class CheckpointDurabilityError(OSError):
    """An fsync failed: this manager refuses further work until the job restarts."""


class ChunkFiles:
    def __init__(self, fsync: FsyncPolicy) -> None:
        self.fsync: FsyncPolicy = fsync
        self._sync = GroupSync()
        self._broken: BaseException | None = None

    def check_usable(self) -> None:
        if self._broken is not None:
            raise CheckpointDurabilityError(
                f"a checkpoint file could not be made durable earlier ({self._broken}); what was acknowledged "
                f"since may not be on disk. Restart the job: it resumes from what the disk holds"
            ) from self._broken

    async def open(self, path: str) -> AppendFile:
        """A chunk's file, opened for appending (and created durably if it does not exist)."""
        created = not os.path.exists(path)
        if created:
            await asyncio.to_thread(make_dirs_durable, os.path.dirname(path))
            logger.info("Creating checkpoint file %s", path)
        file = AppendFile(path)
        if created and self.fsync == "always":
            try:
                await asyncio.to_thread(fsync_dir, os.path.dirname(path))
            except BaseException:
                file.close()
                # Empty, just made: removed, so that the retry creates it again and fsyncs its name (one
                # left in place would be found there, and appended to with its name never made durable).
                with contextlib.suppress(OSError):
                    os.remove(path)
                raise
        return file

    async def make_durable(self, file: AppendFile | None) -> None:
        """Under `fsync="always"`: return once every append made to `file` so far is on disk."""
        if file is None or self.fsync != "always":
            return
        try:
            await self._sync.sync(file)
        except OSError as exc:
            self._broken = exc
            self.check_usable()

    def remove(self, file: AppendFile | None, path: str) -> None:
        """The chunk is complete and published: close its file (if open) and delete it."""
        if file is not None:
            file.close()
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)

    async def close(self, files: list[AppendFile]) -> None:
        """Make every append to `files` durable and close them (their owners have let go of them already)."""
        try:
            if files and self.fsync == "always":
                await self._sync.sync(*files)
        finally:
            for file in files:
                file.close()
