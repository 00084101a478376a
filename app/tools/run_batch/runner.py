"""The command's flow: the checks before anything is sent, the state locked and loaded, the input copied (a
first run) or checked unchanged (a rerun), the upstream waited for, the batch created or resumed and driven to
its end, OUTPUT written, and the one line that says how it ended."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import stat
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from app.checkpoints.output import (
    FolderError,
    OutputError,
    check_folder,
    check_output,
    is_remote,
    redact_url,
    scrub,
)
from app.checkpoints.publish import in_daemon_thread
from app.service.app import upstream_pool
from app.service.batches.engine import BatchEngine, BatchNotFound
from app.service.coalescing import Flights
from app.service.settings import Settings
from app.service.upstream import UpstreamPool
from app.store.batches import FINAL, BatchDir, new_batch_id
from app.store.files import FileStore, new_file_id
from app.store.layout import CheckpointsLayout
from app.tools.run_batch.errors import BAD_INPUT, OK, UNANSWERED, RunBatchError, Stopped
from app.tools.run_batch.input import SHOWN_ERRORS, check_remote_input, refusal, scan_input
from app.tools.run_batch.output import upstream_errors, write_output
from app.tools.run_batch.report import REDRAW_S, Progress, failure, shorten
from app.tools.run_batch.state import Identity, State
from app.tools.terminal import printable

#: The completion window of run-batch's batches: the engine's longest (~114 years), i.e. none.
WINDOW = "999999h"
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


def main(options: Options, stream: TextIO | None = None) -> int:
    """Run the batch to its end; the exit code, after one line on `stream` (stderr as it is now) saying how
    it ended."""
    import uvloop

    stream = stream or sys.stderr
    try:
        check_locations(options)
        code, message = uvloop.run(Runner(options, stream).run())
    except (RunBatchError, OutputError, FolderError, OSError) as exc:  # before the state's lock was held
        code, message = failure(exc)
    stream.write(f"inferproxy run-batch: {message}\n")
    stream.flush()
    return code


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
            except BatchNotFound:  # its folder removed under it (the engine said so in a WARNING line)
                code, message = (
                    UNANSWERED,
                    (
                        f"the run's state in {self.options.state} was removed while it ran, and what it had done with "
                        f"it: rerun the same command to start over"
                    ),
                )
            if code == BAD_INPUT and self.state.created:
                # nothing of this run is worth keeping: no folder left behind either, removed while the lock
                # is held so that no other run-batch can have begun on it
                await asyncio.to_thread(shutil.rmtree, self.options.state, ignore_errors=True)
            return code, message
        finally:
            self.state.unlock()

    async def _reading(self, read: Callable[[], Identity]) -> Identity:
        """`read()` of the input, in a daemon thread; given up (`Stopped`) at SIGTERM or SIGINT if it does not
        stop by itself within a second: a FIFO no process writes to yet (`-i pipe`), or a pipe whose
        writer is idle, blocks its open or its read for ever, and must not keep the run from stopping
        (the thread goes with the process; what it copied is swept at the next run)."""
        reading = asyncio.ensure_future(in_daemon_thread(read, "read input"))
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait((reading, stopping), return_when=asyncio.FIRST_COMPLETED)
            if not reading.done():
                await asyncio.wait((reading,), timeout=1.0)
            if not reading.done():
                raise Stopped
            return reading.result()
        finally:
            stopping.cancel()

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
            identity = await self._reading(lambda: scan_input(options.input, None, self.stop))
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
            # batch.json's counts are saved every 2 s: a kill leaves the lines since in results.jsonl alone
            folder = BatchDir(Path(self.batches_dir) / record.id)
            done = max(record.completed + record.failed, sum(1 for _ in folder.results_in_order()))
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
            identity = await self._reading(copy)
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
        check_output_file(path, output)
        if path.is_dir():
            raise RunBatchError(f"-o {output} is a folder: give the output file's path (e.g. {path / 'out.jsonl'})")
        if not is_remote(options.input) and path.resolve() == Path(options.input.removeprefix("file://")).resolve():
            raise RunBatchError(f"-o {output} is the input: give another path for the output")
        check_folder(str(path.absolute().parent), "-o")
    check_folder(str(options.state), "--checkpoints-dir", room=True)


def check_output_file(path: Path, shown: str) -> None:
    """OUTPUT is written whole, a finished file renamed over it: what is there must be a regular file (or
    nothing, or a folder, said apart). Renamed over, a device (`-o /dev/null`), a FIFO or a socket would
    be replaced by a file, and a symbolic link by one in its place, the file it points to left as it was."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if stat.S_ISLNK(mode):
        raise RunBatchError(
            f"-o {shown} is a symbolic link (to {os.readlink(path)}): give the path of the file itself "
            f"(run-batch writes OUTPUT whole, renaming a finished file over it, which would replace the link)"
        )
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
        raise RunBatchError(
            f"-o {shown} is {kind}, not a file: give a file's path (run-batch writes OUTPUT whole, renaming a "
            f"finished file over it, which would replace {shown})"
        )
