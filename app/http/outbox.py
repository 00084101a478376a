"""`Outbox`: a connection's answers made in one turn of the event loop, written together at its end.

Each write to a socket whose reader sleeps pays for waking it up (about half a hit's cost,
bench/README.md): the answers of one turn go out back to back, in one write, so that the client
wakes once for all of them. The connection decides when (`HTTPConnection.write_soon`, `flush`);
this holds what waits and how much.
"""

from __future__ import annotations


class Outbox:
    """Bytes waiting to be written, in order, and their total."""

    __slots__ = ("parts", "size")

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.size = 0

    def add(self, data: bytes) -> None:
        self.parts.append(data)
        self.size += len(data)

    def take(self, after: bytes = b"") -> bytes:
        """Everything waiting, then `after`, as one write; the outbox is empty again."""
        parts = self.parts
        self.parts, self.size = [], 0
        if not after and len(parts) == 1:
            return parts[0]
        if after:
            parts.append(after)
        return b"".join(parts)

    def take_back(self, data: bytes) -> bool:
        """Unqueue `data` if it is the last thing waiting; True if it was."""
        parts = self.parts
        if not parts or parts[-1] is not data:
            return False
        parts.pop()
        self.size -= len(data)
        return True

    def clear(self) -> None:
        self.parts, self.size = [], 0
