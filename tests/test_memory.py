"""app.memory: free pages between live blocks go back to the system."""

from __future__ import annotations

import platform

import pytest

from app.memory import release_free_memory


def anon_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's; elsewhere a no-op")
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
