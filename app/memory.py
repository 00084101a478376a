"""Memory the process has freed, given back to the system.

glibc's malloc keeps what is freed for reuse, and can return to the system only the free memory at
the top of its heaps: SQLite's page caches, parsers and buffers, which come and go with ranks and
connections, leave free pages between live blocks that stay resident. `malloc_trim(0)` returns
every whole free page; called every few seconds it keeps a proxy's resident memory close to what it
uses (bench/README.md, soak), for well under a millisecond a call. Elsewhere (musl, macOS) it is a
no-op.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable


def release_free_memory() -> None:
    """Return the C heap's free pages to the system, if the C library can."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # the process's own symbols, libc's among them
    except (OSError, AttributeError):  # not glibc
        return None
