"""The open files a proxy lives within: the default cap on client connections, and failures for want of files.

Every client connection is a file descriptor, and so is the upstream socket of each request it
has in flight; each open rank holds ~7 more (its SQLite cache and WAL, chunk files, ownership
lock). A process out of descriptors fails whatever opens one next, often a rank's files: the
connection cap keeps clients from taking the descriptors the ranks need, and an open that fails
all the same is answered 503 naming the limits to change, not 500.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import sqlite3

from app.service.settings import Settings

logger = logging.getLogger(__name__)

FILES_PER_RANK = 8  # a rank's cache, its WAL and shared memory, chunk files, ownership lock; rounded up
FILES_OF_THE_PROCESS = 64  # listening socket, event loop, logs, the upstream pool's idle sockets, imports
MIN_CONNECTIONS = 64  # the cap never goes below this, whatever the limit: a proxy too tight says so at start
_OUT_OF_FILES = (errno.EMFILE, errno.ENFILE)


def open_files_limit() -> int:
    """The process's soft limit on open files (`ulimit -n`)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def default_max_connections(max_open_ranks: int, limit: int | None = None) -> int:
    """`max_connections` when not set: what the open files limit leaves once ranks and the process have theirs.

    `(limit - 64 - 8 x max_open_ranks) // 2`, at least 64: each connection counts twice, for its
    own socket and its request's upstream one.
    """
    limit = open_files_limit() if limit is None else limit
    return max(MIN_CONNECTIONS, (limit - FILES_OF_THE_PROCESS - FILES_PER_RANK * max_open_ranks) // 2)


def files_needed(max_open_ranks: int, max_connections: int) -> int:
    """The open files limit under which `max_connections` clients and `max_open_ranks` ranks all fit."""
    return FILES_OF_THE_PROCESS + FILES_PER_RANK * max_open_ranks + 2 * max_connections


def out_of_files(exc: BaseException) -> bool:
    """Whether `exc` is an open that failed because the process (or the system) has no file descriptor left.

    SQLite says only "unable to open database file": it is taken for that when the process is
    at its limit now.
    """
    if isinstance(exc, OSError):
        return exc.errno in _OUT_OF_FILES
    if isinstance(exc, sqlite3.OperationalError) and "unable to open database file" in str(exc):
        return _at_the_limit()
    return False


def files_short_for_a_rank() -> bool:
    """Whether opening one more rank's files would take the process to its open files limit now.

    False where the count cannot be taken (no /proc): the open then says so itself.
    """
    return _within_of_the_limit(2 * FILES_PER_RANK)


def _at_the_limit() -> bool:
    # A few may have been closed since the open failed (a connection gone, a thread's file).
    return _within_of_the_limit(16)


def _within_of_the_limit(margin: int) -> bool:
    """Whether the process's open descriptors are within `margin` of its open files limit."""
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError as exc:  # the listing needs a descriptor of its own; no /proc: cannot tell
        return exc.errno in _OUT_OF_FILES
    return in_use + margin >= open_files_limit()


def max_connections(settings: Settings) -> int:
    """`max_connections`, or what the open files limit leaves once the ranks and the process have theirs."""
    if settings.max_connections is not None:
        return settings.max_connections
    cap = default_max_connections(settings.max_open_ranks)
    needed = files_needed(settings.max_open_ranks, cap)
    if needed > open_files_limit():
        logger.warning(
            "the open files limit (ulimit -n) is %d: too low for max_open_ranks=%d and %d connections; raise it "
            "to %d, or lower max_open_ranks",
            open_files_limit(),
            settings.max_open_ranks,
            cap,
            needed,
        )
    return cap
