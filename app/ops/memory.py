"""Memory the process has freed, given back to the system.

glibc's malloc keeps what is freed for reuse, and can return to the system only the free memory at
the top of its heaps: SQLite's page caches, parsers and buffers, which come and go with ranks and
connections, leave free pages between live blocks that stay resident. `malloc_trim(0)` returns
every whole free page; called every few seconds it keeps a proxy's resident memory close to what it
uses (bench/README.md, soak), for well under a millisecond a call.

glibc also gives each new thread an arena of its own, up to 8 per core: SQLite's per-rank
connections and the thread pool fill a new one now and then, each holding a few MiB that
`malloc_trim` cannot take back while a block in it lives. `limit_malloc_arenas` caps them, before
any thread starts. Elsewhere (musl, macOS) both are no-ops.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable


def release_free_memory() -> None:
    """Return the C heap's free pages to the system, if the C library can."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


M_ARENA_MAX = -8  # glibc's malloc.h
MALLOC_ARENAS = 2  # the main thread's, and one the other threads share: they seldom malloc at once


def limit_malloc_arenas(arenas: int = MALLOC_ARENAS) -> bool:
    """Cap the C heap's arenas at `arenas`, unless the operator told glibc how many (the operator's choice
    stands); True if the C library took the cap. Call before threads start: an arena once made is kept."""
    if operator_arena_max() is not None:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    return bool(mallopt(M_ARENA_MAX, arenas))


def operator_arena_max() -> str | None:
    """The arena limit the environment gives glibc, as written: `glibc.malloc.arena_max` in
    `GLIBC_TUNABLES` (glibc's own way, last one wins), else `MALLOC_ARENA_MAX`, its older alias. A
    value glibc ignores (not a whole number of at least 1: `abc`, `0`, empty) is none: left to
    glibc, it would leave the heap at glibc's 8 arenas a core."""
    value = None
    for tunable in os.environ.get("GLIBC_TUNABLES", "").split(":"):
        name, _, setting = tunable.partition("=")
        if name == "glibc.malloc.arena_max":
            value = setting
    if value is None:
        value = os.environ.get("MALLOC_ARENA_MAX")
    if value is None or not value.strip().isdigit() or int(value) < 1:
        return None
    return value


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # the process's own symbols, libc's among them
    except (OSError, AttributeError):  # not glibc
        return None
