"""Which proxy owns which rank, when several share one checkpoints dir.

On a cluster the checkpoints dir is a shared filesystem and a rank's job may
be restarted on another node. Each rank is owned by one live proxy at a
time: the proxy takes it when the rank's first request arrives, with an
`flock` on `<checkpoints>/owners/<rank:05d>.lock`, and holds it while it
runs. The kernel (or the NFS/Lustre lock manager) drops the lock when the
owner dies, `kill -9` included, so any other proxy can take the rank over
at once and restore it from what the disk holds. A rank owned by a live
proxy is refused elsewhere with `RankOwnedError` (the service's 409), which names the owner.

The lock is what makes SQLite's WAL safe on a shared filesystem too: only
one host ever has a rank's cache file open. `probe_owner` tells, changing
nothing, whether a live proxy holds a rank's lock and whom the file names.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import time
from dataclasses import dataclass

import orjson

from app.store.durable import check_safe, make_dirs_durable, open_regular
from app.store.layout import CheckpointsLayout


class RankOwnedError(Exception):
    """Another live proxy owns the rank; the message (one line) names it: host, pid, port."""


logger = logging.getLogger(__name__)


class RankOwnership:
    """The ranks this process owns in one checkpoints dir; `release_all()` gives them back."""

    def __init__(self, layout: CheckpointsLayout, *, port: int | None = None) -> None:
        self.layout = layout
        self.identity: dict[str, object] = {"host": socket.gethostname(), "pid": os.getpid()}
        if port:
            self.identity["port"] = port
        self._fds: dict[int, int] = {}
        self._kept: set[int] = set()  # held until the process exits, whatever asks to release them

    def owns(self, rank: int) -> bool:
        return rank in self._fds

    def owned(self) -> list[int]:
        return sorted(self._fds)

    def claim(self, rank: int) -> None:
        """Own `rank` from now on, or raise `RankOwnedError` naming the live proxy that does.

        Synchronous and short (an open, an flock and a write): callers claim
        before they read anything of the rank, and a cancelled caller
        cannot leave the lock half-taken. A rank whose folders (its own,
        `last_chunk/`, `owners/`) are links is refused (`UnsafeFileError`).
        """
        if rank in self._fds:
            return
        paths = self.layout.rank(rank)
        for folder in paths.folders:  # a link there would make this proxy write where it points
            check_safe(folder, folder=True)
        path = paths.owner_file
        make_dirs_durable(os.path.dirname(path))
        fd = open_regular(path, os.O_RDWR | os.O_CREAT)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise RankOwnedError(_owned_message(rank, read_owner(fd))) from None
            previous = read_owner(fd)
            record = orjson.dumps({**self.identity, "since": round(time.time(), 3)})
            os.ftruncate(fd, 0)
            os.pwrite(fd, record + b"\n", 0)
        except BaseException:
            os.close(fd)  # closing drops the lock too, if it was taken
            raise
        self._fds[rank] = fd
        if previous.get("pid") is not None and (previous.get("pid"), previous.get("host")) != (
            self.identity["pid"],
            self.identity["host"],
        ):
            logger.info(
                "took over rank %d from a proxy that is gone (pid %s on host %s)",
                rank,
                previous.get("pid"),
                previous.get("host"),
            )

    def keep_until_exit(self, rank: int) -> None:
        """Never release `rank` in this process: something of it still runs (a publication that could not
        be stopped), and no other proxy may take the rank over before the kernel drops the lock at exit."""
        if rank in self._fds:
            self._kept.add(rank)

    def kept(self, rank: int) -> bool:
        return rank in self._kept

    def release(self, rank: int) -> None:
        """Idempotent. The file stays (removing it would race with the next owner), emptied: the next
        owner then knows the rank was given up, not left by a proxy that died. A rank kept until exit
        stays held."""
        if rank in self._kept:
            return
        fd = self._fds.pop(rank, None)
        if fd is not None:
            try:
                os.ftruncate(fd, 0)
            except OSError:
                pass  # a full or read-only disk: the next owner only logs a takeover
            finally:
                os.close(fd)

    def release_all(self) -> None:
        for rank in list(self._fds):
            self.release(rank)


@dataclass(frozen=True, slots=True)
class OwnerLock:
    """A rank's owner lock file as a probe found it."""

    held: bool  # by a live process
    owner: dict[str, object]  # what the file says (host, pid, port, since); empty once a proxy released it


def probe_owner(path: str) -> OwnerLock | None:
    """Whether a live proxy holds the owner lock at `path`, and whom it names; None without the file.

    Changes nothing: the file is opened read-only (never created), and a
    shared lock is tried without waiting and dropped at once. A proxy that
    claims the rank in that instant answers 409, which job clients retry.
    """
    try:
        fd = open_regular(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return OwnerLock(True, read_owner(fd))
        return OwnerLock(False, read_owner(fd))
    finally:
        os.close(fd)  # drops the probe's lock


def read_owner(fd: int) -> dict[str, object]:
    """The owner an owner lock file names: `{}` if it is empty."""
    raw = os.pread(fd, 4096, 0)
    try:
        owner = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return {"pid": raw.decode("ascii", "replace").strip() or "?"} if raw.strip() else {}
    return owner if isinstance(owner, dict) else {}


def _owned_message(rank: int, owner: dict[str, object]) -> str:
    host, pid = owner.get("host", "?"), owner.get("pid", "?")
    where = f", listening on port {owner['port']}" if owner.get("port") else ""
    return (
        f"rank {rank} is owned by another inferproxy (pid {pid} on host {host}{where}): send this rank's "
        f"requests to that proxy, or stop it; a proxy releases a rank at once when it dies, and when no request "
        f"has used the rank for its --rank-idle-s"
    )
