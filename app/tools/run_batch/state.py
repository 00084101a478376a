"""The state folder of a run-batch: its lock (`run-batch.lock`, one run at a time), `run-batch.json` (the input
it is for, the ids reserved before use), where it goes, and the input's identity it records."""

from __future__ import annotations

import contextlib
import fcntl
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from app.checkpoints.output import is_remote, redact_url
from app.store.durable import atomic_write_bytes, fsync_dir, make_dirs_durable, read_regular
from app.tools.run_batch.errors import RunBatchError

STATE = "run-batch.json"
LOCK = "run-batch.lock"
#: Beside a local OUTPUT when no --checkpoints-dir is given.
STATE_SUFFIX = ".inferproxy"


def state_dir(output: str, checkpoints_dir: Path | None) -> Path:
    """Where the state goes: `--checkpoints-dir`, else `OUTPUT.inferproxy` beside a local OUTPUT."""
    if checkpoints_dir is not None:
        return checkpoints_dir
    if is_remote(output):
        raise RunBatchError(
            f"-o {redact_url(output)} is an object store: give --checkpoints-dir, a local folder for the run's "
            f"state (the same one on every rerun)"
        )
    return Path(output.removeprefix("file://") + STATE_SUFFIX)


@dataclass(frozen=True)
class Identity:
    """What says two runs read the same input: its size and its content's hash."""

    bytes: int
    xxh128: str
    endpoint: str | None
    endpoint_line: int


class State:
    """`run-batch.json`: the input it is for, the input's copy and the batch, each id reserved before use."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.path = root / STATE
        self.data: dict[str, Any] = {}
        #: whether this run made the folder and found nothing in it but its lock: then all it holds is this
        #: run's, which may remove it (and only then: another's state is never removed)
        self.created = False
        self._lock_fd = -1

    def lock(self) -> None:
        """Take the state's lock, or a `RunBatchError` (nothing created or removed) if another run holds it."""
        existed = self.root.exists()
        while True:
            make_dirs_durable(str(self.root))
            fd = os.open(self.root / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise RunBatchError(
                    f"another inferproxy run-batch works on {self.root} (it holds {LOCK}): wait for it, or stop it"
                ) from None
            # The holder of a state it created removes it when it fails (before unlocking): a lock file opened
            # before that and locked after is no longer the folder's, and locks nothing. Open the new one.
            try:
                if os.path.samestat(os.fstat(fd), os.stat(self.root / LOCK)):
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        self._lock_fd = fd
        self.created = not existed and os.listdir(self.root) == [LOCK]

    def unlock(self) -> None:
        if self._lock_fd >= 0:
            fd, self._lock_fd = self._lock_fd, -1
            os.close(fd)

    def load(self) -> None:
        if not self.path.exists():
            self.data = {}
            return
        try:
            data = orjson.loads(read_regular(str(self.path)))
        except (OSError, orjson.JSONDecodeError) as exc:
            raise RunBatchError(f"{self.path} cannot be read ({exc}): move it aside to start over") from None
        if not isinstance(data, dict):
            raise RunBatchError(f"{self.path} is not run-batch's state: move it aside to start over")
        self.data = data

    def save(self, **changes: Any) -> None:
        self.data.update(changes)
        atomic_write_bytes(str(self.path), orjson.dumps(self.data, option=orjson.OPT_INDENT_2))

    def clear(self) -> None:
        self.data = {}
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        fsync_dir(str(self.root))
