"""app.ops.memory: free pages between live blocks go back to the system."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap

import pytest

from app.ops.memory import MALLOC_ARENAS, release_free_memory

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim and arenas are glibc's")
HEAP_SIZE = 64 << 20  # glibc's HEAP_MAX_SIZE on 64-bit: every arena but the main one is such a heap


def anon_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))


@glibc
def test_memory_freed_between_live_blocks_is_given_back() -> None:
    # 64 MiB in 4 KiB blocks (from malloc's heap, below its mmap threshold), one in 64 kept: the heap
    # cannot shrink past the kept ones, so the freed pages stay resident until trimmed.
    blocks = [bytes(4000) for _ in range(16_384)]
    kept = blocks[::64]
    del blocks
    before = anon_kib()
    release_free_memory()
    after = anon_kib()
    assert before - after > 32 * 1024, (before, after)
    assert len(kept) == 256


def thread_heaps(pid: int | str = "self") -> int:
    """How many of glibc's thread arenas process `pid` has: a mapping aligned to 64 MiB, readable and
    writable where used, reserved (---p) for the rest, 64 MiB in all."""
    spans = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            fields = line.split()
            if len(fields) == 5:  # anonymous
                start, end = (int(x, 16) for x in fields[0].split("-"))
                spans.append((start, end, fields[1]))
    heaps = 0
    for start, end, perms in spans:
        if start % HEAP_SIZE == 0 and perms == "rw-p":
            for more_start, more_end, _ in spans:
                if more_start == end and more_end - start <= HEAP_SIZE:
                    end = more_end
            heaps += end - start == HEAP_SIZE
    return heaps


THREADS_THAT_MALLOC = textwrap.dedent(
    """
    import sys, threading, time
    from app.ops.memory import limit_malloc_arenas
    from tests.ops.test_memory import thread_heaps
    if sys.argv[1] == "limited":
        limit_malloc_arenas()
    started, done, kept = threading.Barrier(9), threading.Event(), []
    def work():
        kept.append([bytes(4000) for _ in range(100)])  # from malloc, not Python's small-object arenas
        started.wait()
        done.wait()
    threads = [threading.Thread(target=work) for _ in range(8)]
    for thread in threads:
        thread.start()
    started.wait()
    print(thread_heaps())
    done.set()
    """
)


@glibc
def test_with_arenas_limited_eight_threads_share_one_heap_besides_the_main_one() -> None:
    assert heaps("limited") == MALLOC_ARENAS - 1
    assert heaps("unlimited") >= 4  # glibc's default: a new arena for each new thread, up to 8 per core


@glibc
def test_malloc_arena_max_in_the_environment_is_left_to_glibc() -> None:
    """An operator who set glibc's own `MALLOC_ARENA_MAX` gets that many, not the proxy's cap."""
    assert heaps("limited", MALLOC_ARENA_MAX="6") == 5


def heaps(mode: str, **env: str) -> int:
    """The thread heaps of a Python process whose 8 threads malloc at once, its arenas `limited` or not."""
    run = subprocess.run(
        [sys.executable, "-c", THREADS_THAT_MALLOC, mode],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **env},
    )
    return int(run.stdout)


@glibc
def test_glibc_tunables_arena_max_in_the_environment_is_left_to_glibc() -> None:
    """`GLIBC_TUNABLES` is glibc's own way of saying it (`MALLOC_ARENA_MAX` is its older alias)."""
    assert heaps("limited", GLIBC_TUNABLES="glibc.malloc.check=0:glibc.malloc.arena_max=6") == 5


@pytest.mark.parametrize("value", ["abc", "0", "-1"])
@glibc
def test_a_malloc_arena_max_glibc_ignores_does_not_leave_the_heap_uncapped(value: str) -> None:
    """glibc takes no such value: leaving the choice to it would leave up to 8 arenas a core."""
    assert heaps("limited", MALLOC_ARENA_MAX=value) == MALLOC_ARENAS - 1
