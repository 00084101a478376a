"""Why run-batch stops: its exception, said in one line with the exit code, and the exit codes themselves."""

from __future__ import annotations

#: Exit codes: every line answered; lines the upstream failed (or another failure); a bad input or usage.
OK, UNANSWERED, BAD_INPUT = 0, 1, 2


class RunBatchError(Exception):
    """Why run-batch stops, in one line; `code` is the exit code."""

    def __init__(self, message: str, code: int = BAD_INPUT) -> None:
        super().__init__(message)
        self.code = code


class Stopped(Exception):
    """SIGTERM or SIGINT during the input's copy."""
