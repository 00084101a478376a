"""`ChunkFiles`: the open checkpoint files of a rank's unfinished chunks, and their durability.

Each chunk's file is opened (created durably: its directory fsynced) on its
first append and kept open until the chunk completes. `make_durable` waits
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
        self._files: dict[int, AppendFile] = {}
        self._sync = GroupSync()
        self._broken: BaseException | None = None

    def get(self, chunk_index: int) -> AppendFile | None:
        return self._files.get(chunk_index)

    def check_usable(self) -> None:
        if self._broken is not None:
            raise CheckpointDurabilityError(
                f"a checkpoint file could not be made durable earlier ({self._broken}); what was acknowledged "
                f"since may not be on disk. Restart the job: it resumes from what the disk holds"
            ) from self._broken

    async def open(self, chunk_index: int, path: str) -> AppendFile:
        """The chunk's file, opened for appending (and created durably) if it is not open yet."""
        file = self._files.get(chunk_index)
        if file is not None:
            return file
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
                raise
        self._files[chunk_index] = file
        return file

    async def make_durable(self, chunk_index: int) -> None:
        """Under `fsync="always"`: return once every append made to the chunk's file so far is on disk."""
        file = self._files.get(chunk_index)
        if file is None or self.fsync != "always":
            return
        try:
            await self._sync.sync(file)
        except OSError as exc:
            self._broken = exc
            self.check_usable()

    def remove(self, chunk_index: int, path: str) -> None:
        """The chunk is complete and published: close its file and delete it."""
        file = self._files.pop(chunk_index, None)
        if file is not None:
            file.close()
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)

    async def close(self) -> None:
        """Make every append durable and close every file; idempotent."""
        files = list(self._files.values())
        self._files.clear()
        try:
            if files and self.fsync == "always":
                await self._sync.sync(*files)
        finally:
            for file in files:
                file.close()
