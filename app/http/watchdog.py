"""`Watchdog`: a connection's one timer, ticking every `keep_alive_s`, and what it saw on its last tick.

One timer per connection, not one per request (no clock read per request on the hit path): when it
fires, the connection asks it whether nothing began since it was armed (idle: close, after
`keep_alive_s` to twice that), whether the head or the body arriving now is overdue (timed from
the first tick that sees it: refused between the timeout and that plus two ticks), and whether a
request part-way has stopped arriving. The connection decides what to do about it
(`HTTPConnection._tick`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class Watchdog:
    __slots__ = (
        "body_request",
        "body_since",
        "body_timeout_s",
        "bytes_in",
        "handle",
        "head_request",
        "head_since",
        "head_timeout_s",
        "keep_alive_s",
        "loop",
        "requests",
        "stall_s",
        "stalled",
    )

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        keep_alive_s: float,
        head_timeout_s: float,
        body_timeout_s: float,
        stall_s: float,
    ) -> None:
        self.loop = loop
        self.keep_alive_s, self.head_timeout_s, self.body_timeout_s = keep_alive_s, head_timeout_s, body_timeout_s
        self.stall_s = stall_s
        self.handle: asyncio.TimerHandle | None = None
        self.requests = -1  # the connection's requests begun and bytes received when the timer was armed
        self.bytes_in = -1
        self.stalled = 0  # ticks in a row with a request part-way and no byte arriving
        self.head_request = 0  # the request whose head a tick saw arriving, and when it first did
        self.head_since = 0.0
        self.body_request = 0  # the same for a body
        self.body_since = 0.0

    def arm(self, requests: int, bytes_in: int, tick: Callable[[], None]) -> None:
        """Call `tick` `keep_alive_s` from now, unless armed already. (Not kept here: the timer alone
        holds the connection's method, so that a closed connection is freed by refcounting.)"""
        if self.handle is None:
            self.requests, self.bytes_in = requests, bytes_in
            self.handle = self.loop.call_later(self.keep_alive_s, tick)

    def fired(self) -> None:
        """The tick has come: the timer is no longer armed."""
        self.handle = None

    def cancel(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None

    def idle(self, requests: int) -> bool:
        """No request began since the timer was armed."""
        return requests == self.requests

    def waiting_on_answers(self) -> None:
        """Answers are owed: what arrives meanwhile is not timed (reading may be paused)."""
        self.stalled = 0
        self.head_request = 0

    def stopped_arriving(self, bytes_in: int) -> bool:
        """A request part-way, nothing owed to its client: True once no byte came for `stall_s`."""
        self.stalled = 0 if bytes_in != self.bytes_in else self.stalled + 1
        return self.stalled * self.keep_alive_s >= self.stall_s

    def head_overdue(self, requests: int) -> bool:
        """Whether the head arriving now (of request number `requests`) began over `head_timeout_s` ago."""
        now = self.loop.time()
        if self.head_request != requests:
            self.head_request, self.head_since = requests, now
            return False
        return now - self.head_since >= self.head_timeout_s

    def body_overdue(self, requests: int, reading_paused: bool) -> bool:
        """Whether the body arriving now began over `body_timeout_s` ago; never while reading is paused
        (the app has not taken what came, or answers are owed before it): that wait is not the client's."""
        now = self.loop.time()
        if reading_paused or self.body_request != requests:
            self.body_request, self.body_since = requests, now
            return False
        return now - self.body_since >= self.body_timeout_s
