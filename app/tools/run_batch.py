"""`inferproxy run-batch -i INPUT -o OUTPUT --upstream URL`: one OpenAI batch file through the Batch API's
engine in this process (no HTTP server), for a script or a Slurm job, in vLLM's `run-batch` file format.

INPUT holds one `{"custom_id", "method", "url", "body"}` per line, all with one `url` (the endpoint);
OUTPUT gets one line per input line, in input order, successes and errors alike, as OpenAI's batch output
(`{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`). Either may be a local
path or an fsspec URL (`s3://bucket/key`). OUTPUT is written whole or not at all: a temporary file,
fsynced and renamed over it; for an object store, uploaded once complete.

The state (a copy of the input, the batch, its answers) is kept under `--checkpoints-dir`, else beside a
local OUTPUT in `OUTPUT.inferproxy/`:

    <state>/run-batch.json    which input (its bytes and xxh128) and which batch, replaced atomically
    <state>/run-batch.lock    flock'ed while a run-batch works on the state
    <state>/files/            the input's copy (and the engine's output and error files)
    <state>/batches/          the batch (`app.store.batches`) and the answers' cache

The ids are reserved in `run-batch.json` before anything is created under them, so that a kill at any
point leaves nothing the next run does not know of: run again with the same arguments, it finds its batch
and carries on, paying only for what was in flight. A batch that ended with lines failed by the upstream
(after every retry) is run again whole by the next run: its answered lines are hits in the answers' cache,
so only the failed ones are sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import secrets
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol, TextIO

import orjson
import xxhash

from app.checkpoints.output import (
    FolderError,
    OutputError,
    check_folder,
    check_output,
    install_hint,
    is_remote,
    redact_url,
    scrub,
)
from app.job.progress import InPlace, duration
from app.service.app import upstream_pool
from app.service.batches.answers import ENDPOINTS
from app.service.batches.engine import BatchEngine, BatchNotFound
from app.service.batches.validation import ARRAY, check_input
from app.service.coalescing import Flights
from app.service.settings import Settings
from app.service.upstream import UpstreamPool
from app.store.batches import FINAL, BatchDir, new_batch_id
from app.store.durable import atomic_write_bytes, fsync_dir, make_dirs_durable, read_regular
from app.store.files import FileStore, new_file_id
from app.store.layout import CheckpointsLayout
from app.tools.terminal import printable

#: The completion window of run-batch's batches: the engine's longest (~114 years), i.e. none.
WINDOW = "999999h"
STATE = "run-batch.json"
LOCK = "run-batch.lock"
#: Beside a local OUTPUT when no --checkpoints-dir is given.
STATE_SUFFIX = ".inferproxy"
REDRAW_S = 0.5
LOG_EVERY_S = 30.0
BAR_WIDTH = 24
#: Bad lines named in the one line that refuses an input.
SHOWN_ERRORS = 3
#: Exit codes: every line answered; lines the upstream failed (or another failure); a bad input or usage.
OK, UNANSWERED, BAD_INPUT = 0, 1, 2
PIECE = 1 << 20


class RunBatchError(Exception):
    """Why run-batch stops, in one line; `code` is the exit code."""

    def __init__(self, message: str, code: int = BAD_INPUT) -> None:
        super().__init__(message)
        self.code = code


class Stopped(Exception):
    """SIGTERM or SIGINT during the input's copy."""


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


# -- the input ----------------------------------------------------------------------------------


@contextlib.contextmanager
def open_input(url: str) -> Iterator[IO[bytes]]:
    """The input's bytes, as a stream: a local file or an fsspec URL; a one-line error if it cannot be read."""
    shown = redact_url(url)
    try:
        if is_remote(url):
            import fsspec

            opened: Any = fsspec.open(url, "rb")
            stream = opened.open()
        else:
            stream = open(url.removeprefix("file://"), "rb")  # noqa: SIM115 - closed below
    except ImportError:
        raise RunBatchError(f"-i {shown} is a URL: install fsspec and its filesystem (pip install 's3fs')") from None
    except FileNotFoundError:
        if url == "-":  # a rerun carries on from the same input, which a pipe cannot give twice
            raise RunBatchError("-i -: run-batch reads a file, not standard input: write it to a file first") from None
        raise RunBatchError(f"-i {shown}: no such file") from None
    except IsADirectoryError:
        raise RunBatchError(f"-i {shown} is a folder: give the batch file (JSONL) in it") from None
    except Exception as exc:  # OSError, or an object store client's own (botocore's ClientError, ...)
        reason = scrub(f"{type(exc).__name__}: {exc}".replace("\n", " "), url)
        raise RunBatchError(f"-i {shown} cannot be read ({reason})") from None
    with stream:
        yield stream


def check_remote_input(url: str, *, timeout_s: float = 30.0) -> None:
    """An object-store INPUT must be there and readable with the credentials at hand, said in one line
    before anything else: fsspec's clients raise their own errors (botocore's NoCredentialsError, ...), after
    retrying for a while, hence a daemon thread and a bound (as `check_output` does for an output)."""
    shown = redact_url(url)
    outcome: list[Any] = []

    def probe() -> None:
        try:
            import fsspec

            fs, path = fsspec.core.url_to_fs(url)
            outcome.append(fs.info(path))
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=probe, name="check-input", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not outcome:
        raise RunBatchError(f"-i {shown} did not answer within {timeout_s:g} s: check the URL and the endpoint")
    found = outcome[0]
    if isinstance(found, ImportError):
        raise RunBatchError(f"-i {shown} is a URL: {install_hint(url)}")
    if isinstance(found, FileNotFoundError):
        raise RunBatchError(f"-i {shown}: no such object (check the URL and the endpoint)")
    if isinstance(found, BaseException):
        reason = scrub(f"{type(found).__name__}: {found}".replace("\n", " "), url)
        raise RunBatchError(f"-i {shown} cannot be reached ({reason}): check the URL, the endpoint and the credentials")
    if isinstance(found, dict) and found.get("type") == "directory":
        raise RunBatchError(f"-i {shown} is a folder: give the batch file (JSONL) in it")


@dataclass(frozen=True)
class Identity:
    """What says two runs read the same input: its size and its content's hash."""

    bytes: int
    xxh128: str
    endpoint: str | None
    endpoint_line: int


class Sink(Protocol):
    def write(self, data: bytes, /) -> object: ...


def scan_input(url: str, into: Sink | None, stop: threading.Event) -> Identity:
    """Read the input once, as a stream: its identity, the endpoint its first line names, and a copy `into`."""
    hasher = xxhash.xxh3_128()
    size, endpoint, endpoint_line = 0, None, 0
    with open_input(url) as f:
        for number, raw in enumerate(f, 1):
            if stop.is_set():
                raise Stopped
            hasher.update(raw)
            size += len(raw)
            if into is not None:
                into.write(raw)
            if endpoint is None and raw.strip():
                with contextlib.suppress(orjson.JSONDecodeError):
                    line = orjson.loads(raw)
                    if isinstance(line, dict) and isinstance(line.get("url"), str):
                        endpoint, endpoint_line = line["url"], number
    return Identity(size, hasher.hexdigest(), endpoint, endpoint_line)


def refusal(shown: str, identity: Identity, path: Path) -> str | None:
    """Why the input copied to `path` cannot run (one line naming its first bad lines), or None."""
    known = identity.endpoint in ENDPOINTS
    # with no endpoint to check against, checked against any: the bad lines named all the same, the url aside
    checked = check_input(path, identity.endpoint if identity.endpoint is not None and known else ENDPOINTS[0])
    if checked.not_json_lines == ARRAY:
        return f"-i {shown} {ARRAY}"
    if checked.not_json_lines is not None:
        return f"-i {shown} {checked.not_json_lines} (run-batch reads plain JSON Lines)"
    if identity.endpoint is None:
        problems = [e for e in checked.errors if e["code"] != "mismatched_url"]
        if problems:
            shown_errors = "; ".join(f"line {e['line']}: {e['message']}" for e in problems[:SHOWN_ERRORS])
            return f"-i {shown} holds no request, nothing was sent: {shown_errors}"
        return f"-i {shown} holds no request: one JSON object per line, {{custom_id, method, url, body}}"
    if not known:
        return (
            f"-i {shown}: line {identity.endpoint_line} asks for url {identity.endpoint!r}: run-batch sends "
            f"{', '.join(ENDPOINTS)}"
        )
    mixed = next((e for e in checked.errors if e["code"] == "mismatched_url"), None)
    if mixed is not None:
        other = str(mixed["message"]).rpartition(", got ")[2]
        return (
            f"-i {shown} mixes endpoints: line {identity.endpoint_line} asks for {identity.endpoint}, line "
            f"{mixed['line']} for {other}; one endpoint per file: split it by `url`. Nothing was sent"
        )
    if checked.bad:
        shown_errors = "; ".join(f"line {e['line']}: {e['message']}" for e in checked.errors[:SHOWN_ERRORS])
        more = f" (and {checked.bad - SHOWN_ERRORS:,} more)" if checked.bad > SHOWN_ERRORS else ""
        lines = "1 bad line" if checked.bad == 1 else f"{checked.bad:,} bad lines"
        return f"-i {shown} has {lines}, nothing was sent: {shown_errors}{more}"
    if not checked.lines:
        return f"-i {shown} holds no request: one JSON object per line, {{custom_id, method, url, body}}"
    return None


# -- the state ----------------------------------------------------------------------------------


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


# -- the output ---------------------------------------------------------------------------------


@dataclass
class Written:
    lines: int = 0
    errors: int = 0  # answered with a 4xx (or a 2xx body that is an error)
    upstream_errors: int = 0  # no answer after every retry
    last_error: str = ""  # the message of the last of those, in input order


def _write_lines(folder: BatchDir, out: IO[bytes]) -> Written:
    written = Written()
    for result in folder.results_in_order():
        written.lines += 1
        if not result.ok:
            why = _unanswered(result.out)
            if why is not None:
                written.upstream_errors += 1
                written.last_error = why
            else:
                written.errors += 1
        out.write(result.out + b"\n")
    return written


def _unanswered(out: bytes) -> str | None:
    """Why the upstream never answered the line (every retry failed), if that is what its error says."""
    if b'"upstream_error"' not in out:
        return None
    error = orjson.loads(out).get("error")
    if not isinstance(error, dict) or error.get("code") != "upstream_error":
        return None
    return str(error.get("message") or "no reason given")


def upstream_errors(folder: BatchDir) -> int:
    return sum(1 for r in folder.results_in_order() if not r.ok and _unanswered(r.out) is not None)


def write_output(folder: BatchDir, output: str, state: Path, fsync: bool) -> Written:
    """Every line's result, in input order, to OUTPUT whole: a temporary file fsynced and renamed over it
    (local), or uploaded once complete (an object store: never a partial object)."""
    if is_remote(output):
        part = state / f".output.{secrets.token_hex(6)}.tmp"
        try:
            with part.open("wb") as out:
                written = _write_lines(folder, out)
            import fsspec

            fs, path = fsspec.core.url_to_fs(output)
            fs.put_file(str(part), path)
        finally:
            with contextlib.suppress(OSError):
                part.unlink()
        return written
    target = Path(output.removeprefix("file://")).absolute()
    make_dirs_durable(str(target.parent))
    part = target.parent / f".{target.name}.{secrets.token_hex(6)}.tmp"
    try:
        with part.open("wb") as out:
            written = _write_lines(folder, out)
            out.flush()
            if fsync:
                os.fsync(out.fileno())
        os.replace(part, target)
    except BaseException:
        with contextlib.suppress(OSError):
            part.unlink()
        raise
    if fsync:
        fsync_dir(str(target.parent))
    return written


# -- progress -----------------------------------------------------------------------------------


class Progress:
    """A bar redrawn in place on a terminal, else a line every `LOG_EVERY_S`: done, failed, rate, ETA."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.interactive = stream.isatty()
        self._first: tuple[float, int] | None = None
        self._last = 0.0
        self._bar = InPlace(stream)  # a log record clears it first: never written into its middle

    def __enter__(self) -> Progress:
        if self.interactive:
            self._bar.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self._bar.close()

    def line(self, done: int, failed: int, total: int, now: float) -> str:
        if self._first is None:
            self._first = (now, done)
        started, done_then = self._first
        rate = (done - done_then) / (now - started) if now > started else 0.0
        share = min(done / total, 1.0) if total else 0.0
        parts = ["run-batch"]
        if self.interactive:
            filled = round(share * BAR_WIDTH)
            parts.append("[" + "#" * filled + "-" * (BAR_WIDTH - filled) + "]")
        # "failed": answered with an error, or never (the summary tells which)
        parts.append(f"{done:,}/{total:,} lines {share:.0%}, {failed:,} failed")
        if rate > 0:  # none yet, or all done before the first look (a rerun): no rate to show
            parts[-1] += f", {rate:,.1f} lines/s"
        if rate > 0 and done < total:
            parts.append(f"ETA {duration((total - done) / rate)}")
        return " ".join(parts)

    def update(self, done: int, failed: int, total: int, *, final: bool = False) -> None:
        if not total:  # still being checked
            return
        now = time.monotonic()
        line = self.line(done, failed, total, now)
        if not final and now - self._last < (REDRAW_S if self.interactive else LOG_EVERY_S):
            return
        self._last = now
        if self.interactive:
            self._bar.draw(line, end=final)
        else:
            self.stream.write(line + "\n")
            self.stream.flush()


# -- the run ------------------------------------------------------------------------------------


#: How long a run with lines to send waits for the first answer of `GET /v1/models` (`--upstream-wait-s`):
#: an upstream being started (vLLM loading its model) is waited for, a mistyped one fails the run.
UPSTREAM_WAIT_S = 60.0
PROBE_EVERY_S = 1.0


@dataclass(frozen=True)
class Options:
    input: str
    output: str
    settings: Settings
    state: Path
    upstream_wait_s: float = UPSTREAM_WAIT_S


def main(options: Options, stream: TextIO = sys.stderr) -> int:
    """Run the batch to its end; the exit code, after one line on `stream` saying how it ended."""
    import uvloop

    try:
        check_locations(options)
        code, message = uvloop.run(Runner(options, stream).run())
    except (RunBatchError, OutputError, FolderError, OSError) as exc:  # before the state's lock was held
        code, message = failure(exc)
    stream.write(f"inferproxy run-batch: {message}\n")
    stream.flush()
    return code


def failure(exc: RunBatchError | OutputError | FolderError | OSError) -> tuple[int, str]:
    """The exit code of a run that raised `exc`, and what it says."""
    if isinstance(exc, RunBatchError):
        return exc.code, str(exc)
    if isinstance(exc, OutputError | FolderError):
        return BAD_INPUT, str(exc)
    # the state's disk refused a write, or went away
    return UNANSWERED, f"stopped: {exc}; rerun the same command to carry on once that is fixed"


class Runner:
    def __init__(self, options: Options, stream: TextIO) -> None:
        self.options = options
        self.stream = stream
        self.shown = redact_url(options.input)
        self.state = State(options.state)
        layout = CheckpointsLayout(str(options.state))
        self.files = FileStore(layout.files_dir, fsync=options.settings.fsync == "always")
        self.batches_dir = layout.batches_dir
        self.stop = threading.Event()  # for the input's copy, in a thread
        self._stopping = asyncio.Event()
        self.signal = 0

    def _on_signal(self, signum: int) -> None:
        self.signal = signum
        self.stop.set()
        self._stopping.set()

    async def run(self) -> tuple[int, str]:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._on_signal, signum)
        self.state.lock()  # refused: nothing of this run to remove, and the folder is another's
        try:
            try:
                code, message = await self._run()
            except Stopped:
                code, message = self._stopped("before the batch started")
            except (RunBatchError, OutputError, FolderError, OSError) as exc:
                code, message = failure(exc)
            if code == BAD_INPUT and self.state.created:
                # nothing of this run is worth keeping: no folder left behind either, removed while the lock
                # is held so that no other run-batch can have begun on it
                await asyncio.to_thread(shutil.rmtree, self.options.state, ignore_errors=True)
            return code, message
        finally:
            self.state.unlock()

    def _stopped(self, where: str) -> tuple[int, str]:
        name = signal.Signals(self.signal).name
        return 128 + self.signal, f"stopped by {name} {where}; rerun the same command to carry on"

    async def _run(self) -> tuple[int, str]:
        options = self.options
        await asyncio.to_thread(self.state.load)
        # the state is this run's alone while it holds the lock: what a kill left half-written (a copy of the
        # input as large as it, at each kill) is no other run's under way, and is swept at once
        await asyncio.to_thread(self.files.open, stale_after_s=0)
        input_id = os.path.abspath(options.input) if not is_remote(options.input) else options.input
        data = self.state.data
        if data.get("xxh128") is None:
            await self._first_run(input_id)
        else:
            identity = await asyncio.to_thread(scan_input, options.input, None, self.stop)
            if (identity.bytes, identity.xxh128) != (data["bytes"], data["xxh128"]):
                raise RunBatchError(self._not_this_input(input_id, identity))
        sends = await asyncio.to_thread(self._outlook)
        settings = options.settings
        pool = upstream_pool(settings)
        await pool.start()
        engine = BatchEngine(settings, pool, Flights(), self.files, self.batches_dir)
        try:
            if sends:
                await self._wait_for_upstream(pool)
            await engine.start()
            return await self._drive(engine)
        finally:
            await engine.close()
            await pool.close()

    def _not_this_input(self, input_id: str, identity: Identity) -> str:
        """Why the state, recorded for another input or for this one before it changed, cannot be used."""
        data, state = self.state.data, self.options.state
        what_to_do = f"give another -o or --checkpoints-dir, or delete {state} to start over"
        if data.get("input") == input_id:
            then = (
                "same path and size, other content"
                if identity.bytes == data["bytes"]
                else f"{data['bytes']:,} bytes then, {identity.bytes:,} now"
            )
            return f"-i {self.shown} has changed since this run began ({then}): {what_to_do}"
        return (
            f"{state} holds the run of another input ({redact_url(str(data.get('input')))}, {data['bytes']:,} "
            f"bytes), not of -i {self.shown}: {what_to_do}"
        )

    def say(self, message: str) -> None:
        self.stream.write(f"inferproxy run-batch: {message}\n")
        self.stream.flush()

    def _outlook(self) -> bool:
        """Say what this run does with the batch the state names (resume it, run its unanswered lines
        again, only write OUTPUT again); whether it has lines to send."""
        try:
            record = BatchDir(Path(self.batches_dir) / self.state.data["batch_id"]).load()
        except (OSError, ValueError):  # not created yet (a first run, or killed before it was): run it all
            return True
        if record.status not in FINAL:
            done = record.completed + record.failed
            self.say(f"resuming: {done:,} of {record.total:,} lines already done" if record.total else "resuming")
            return True
        if record.status == "failed":
            return False
        unanswered = upstream_errors(BatchDir(Path(self.batches_dir) / record.id))
        if record.status == "completed" and not unanswered:
            self.say(f"already complete: nothing sent, {redact_url(self.options.output)} written again from the state")
            return False
        left = unanswered if record.status == "completed" else record.total - record.completed
        self.say(
            f"{left:,} of {record.total:,} lines got no answer last time: sending those again (the others are "
            f"answered from the state)"
        )
        return True

    async def _wait_for_upstream(self, pool: UpstreamPool) -> None:
        """Until one replica answers `GET /v1/models`, for at most `upstream_wait_s`; said in one line when
        none does at first, and a `RunBatchError` (exit 2, nothing sent) when none has by then."""
        wait_s = self.options.upstream_wait_s
        deadline = time.monotonic() + wait_s
        urls = ", ".join(r.url for r in pool.replicas)
        check = "check --upstream, --upstream-api-key and that the server is up"
        waited = False
        while True:
            timeout_s = min(5.0, max(deadline - time.monotonic(), 1.0))
            reasons = await asyncio.gather(*(pool.why_not_answering(r, timeout_s) for r in pool.replicas))
            if any(reason is None for reason in reasons):
                if waited:
                    self.say(f"the upstream answers at {urls}: starting")
                return
            reason = next(r for r in reasons if r is not None)
            if time.monotonic() >= deadline:
                after = f" after {wait_s:g} s" if waited else ""
                raise RunBatchError(
                    f"no upstream answers GET /v1/models at {urls} ({reason}){after}: {check}; nothing was sent"
                )
            if not waited:
                self.say(
                    f"no upstream answers GET /v1/models at {urls} yet ({reason}): waiting up to {wait_s:g} s for "
                    f"one (--upstream-wait-s); {check}"
                )
                waited = True
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), min(PROBE_EVERY_S, deadline - time.monotonic()))
            if self._stopping.is_set():
                raise Stopped

    async def _first_run(self, input_id: str) -> None:
        """Copy the input into the state's file store (streamed), check it, and record it: its ids first."""
        stale = self.state.data.get("input_file_id")
        if isinstance(stale, str):  # a copy a kill cut short of being recorded
            await asyncio.to_thread(self.files.delete, stale)
        file_id, batch_id = new_file_id(time.time()), new_batch_id(time.time())
        await asyncio.to_thread(self.state.save, input=input_id, input_file_id=file_id, batch_id=batch_id)

        def copy() -> Identity:
            with self.files.writing(Path(input_id).name, "batch", file_id=file_id) as out:
                return scan_input(self.options.input, out, self.stop)

        try:
            identity = await asyncio.to_thread(copy)
            why = await asyncio.to_thread(refusal, self.shown, identity, self.files.path(file_id))
        except RunBatchError:
            await asyncio.to_thread(self.state.clear)
            raise
        if why is not None:
            await asyncio.to_thread(self.files.delete, file_id)
            await asyncio.to_thread(self.state.clear)
            raise RunBatchError(why)
        await asyncio.to_thread(
            self.state.save, bytes=identity.bytes, xxh128=identity.xxh128, endpoint=identity.endpoint
        )

    async def _drive(self, engine: BatchEngine) -> tuple[int, str]:
        data = self.state.data
        batch_id: str = data["batch_id"]
        record = None
        with contextlib.suppress(BatchNotFound):
            record = engine.get(batch_id)
        if record is not None and record.status in FINAL:
            folder = BatchDir(Path(self.batches_dir) / batch_id)
            if record.status == "failed":
                errors = "; ".join(f"line {e['line']}: {e['message']}" for e in record.errors[:SHOWN_ERRORS])
                return BAD_INPUT, f"the batch failed: {errors}"
            unanswered = await asyncio.to_thread(upstream_errors, folder)
            if record.status != "completed" or unanswered:
                # lines without an answer: the whole input again, as a new batch; what was answered is a hit
                batch_id = new_batch_id(time.time())
                await asyncio.to_thread(
                    self.state.save, batch_id=batch_id, previous=[*data.get("previous", []), record.id]
                )
                record = None
        if record is None:
            metadata = {"run_batch_input": str(data["input"])[:512]}
            record = await engine.create(data["input_file_id"], data["endpoint"], WINDOW, metadata, batch_id=batch_id)
        elif record.status not in FINAL and batch_id not in engine.running:
            raise RunBatchError(
                f"batch {batch_id} in {self.batches_dir} is run by another process (it holds its owner.lock): "
                f"stop that process (an inferproxy serve on this folder?), then rerun",
                UNANSWERED,
            )
        with Progress(self.stream) as progress:
            while record.status not in FINAL:
                progress.update(record.completed + record.failed, record.failed, record.total)
                if self._stopping.is_set():
                    await engine.close()
                    record = engine.get(batch_id)
                    done = record.completed + record.failed
                    progress.update(done, record.failed, record.total, final=True)
                    return self._stopped(f"with {done:,} of {record.total:,} lines done")
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), REDRAW_S)
                record = engine.get(batch_id)
            progress.update(record.completed + record.failed, record.failed, record.total, final=True)
        if record.status != "completed":
            return UNANSWERED, f"the batch ended {record.status}: rerun the same command to run its lines again"
        folder = BatchDir(Path(self.batches_dir) / batch_id)
        try:
            written = await asyncio.to_thread(
                write_output, folder, self.options.output, self.options.state, self.options.settings.fsync == "always"
            )
        except (OSError, OutputError, ValueError) as exc:
            reason = scrub(f"{type(exc).__name__}: {exc}".replace("\n", " "), self.options.output)
            return UNANSWERED, (
                f"every line is answered, but -o {redact_url(self.options.output)} could not be written ({reason}); "
                f"rerun the same command to write it (nothing is sent again)"
            )
        output = redact_url(self.options.output)
        if written.upstream_errors:
            return UNANSWERED, (
                f"{written.upstream_errors:,} of {written.lines:,} lines got no answer from the upstream after every "
                f"retry (the last: {shorten(printable(written.last_error))}; error.code upstream_error in "
                f"{output}); rerun the same command to retry only those"
            )
        errors = f" ({written.errors:,} answered with an error)" if written.errors else ""
        return OK, f"{written.lines:,} lines answered{errors}, written to {output}"


def shorten(text: str, most: int = 240) -> str:
    """`text` cut to `most` characters: an upstream's error may carry a whole page."""
    return text if len(text) <= most else text[: most - 1] + "…"


def check_locations(options: Options) -> None:
    """An object-store INPUT must be readable, OUTPUT's folder (or bucket) and the state's folder must take
    files: said before anything is sent."""
    if is_remote(options.input):
        check_remote_input(options.input)
    output = options.output
    if is_remote(output):
        check_output(output.rstrip("/").rsplit("/", 1)[0])
    else:
        path = Path(output.removeprefix("file://"))
        if path.is_dir():
            raise RunBatchError(f"-o {output} is a folder: give the output file's path (e.g. {path / 'out.jsonl'})")
        if not is_remote(options.input) and path.absolute() == Path(options.input.removeprefix("file://")).absolute():
            raise RunBatchError(f"-o {output} is the input: give another path for the output")
        check_folder(str(path.absolute().parent), "-o")
    check_folder(str(options.state), "--checkpoints-dir", room=True)
