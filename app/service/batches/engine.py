"""The Batch API's engine: batches run inside `serve`, through the upstream pool, resumed after any crash.

A batch goes `validating` -> `in_progress` -> `finalizing` -> `completed` (or `failed` at validation,
`cancelling` -> `cancelled`, `expired`), each change saved in its `batch.json` before it shows
(`app.store.batches`). This module keeps the life cycle (start, adopt, close), the routes' operations and
the running of each batch; its lines are read from the input file as they are needed, never held whole:

- each line's answer is looked up in the answers' cache (every batch's answers on this host: one SQLite
  WAL file cannot be shared by hosts, `host_answers`; keyed by the line's `custom_id`, its endpoint and
  its body's hash), else joins an identical line in flight (`Flights`),
  else is sent upstream as a background request, tried again on a 429, a 5xx, a timeout or a lost
  connection (`answers.py`);
- a line is done once its result is fsynced in `results.jsonl`: after a crash, the done lines are read
  back from it, and only what was in flight is sent again (its answer, if it came and was stored, is
  then a hit);
- while the disk refuses the batch's writes (a full disk), it sends no new line, whose answer could not be
  kept: its answers wait in memory and its writes are tried again every `DISK_RETRY_S`, one WARNING when
  they start failing and one INFO line once they go through (`Running.refused`, /stats' `paused`).

The lines of all running batches share `max_inflight_per_upstream` x replicas slots at the upstream, and
twice that until their answers are on disk, in turn (`FairShare`), so that a large batch does not starve a
small one (`running.py`, with what the engine keeps of each batch). Once a batch ends, its output and
error files are written from results.jsonl and copied to an object-store output (`outputs.py`). A batch
is run by the proxy that holds its `owner.lock`; a proxy sharing the checkpoints dir takes over the
batches of one that died.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import logging
import os
import re
import secrets
import shutil
import sqlite3
import time
from pathlib import Path
from typing import Any

import orjson

from app.checkpoints.output import is_remote
from app.ops.metrics import RankCounters
from app.service.batches.answers import Answerer
from app.service.batches.outputs import add_tokens, failure_result, upload, write_files
from app.service.batches.running import FairShare, Lines, Running
from app.service.batches.validation import check_input
from app.service.coalescing import Flights
from app.service.errors import FileInUse
from app.service.settings import Settings
from app.service.upstream import UpstreamPool
from app.store.batches import (
    ACTIVE,
    ANSWERS,
    FINAL,
    FORGOTTEN,
    SERIALS,
    BatchDir,
    BatchRecord,
    forget_answers,
    forgotten_answers,
    host_answers,
    is_batch_id,
    new_batch_id,
    take_shared_answers,
)
from app.store.cache import CacheWriteError, RequestCache
from app.store.durable import (
    CorruptFileError,
    UnsafeFileError,
    is_disk_full,
    make_dirs_durable,
    open_to_read,
    refusal_reason,
)
from app.store.files import FileStore, new_file_id
from app.tasks import cancel_and_wait, cancelling, run_to_end

logger = logging.getLogger(__name__)

_WINDOW = re.compile(r"([1-9][0-9]{1,5})h")  # ASCII digits, no leading zero, nothing after
#: How long a round of answers gathers before it is written and fsynced, beyond the answers that come
#: while the last round is fsynced (group commit). A line keeps its place in the share until it is on disk,
#: so any wait here is a wait per line (bench/README.md).
RESULTS_ROUND_S = 0.0
#: How often a running batch's counts are saved to its batch.json (for other proxies, and `status`).
SAVE_EVERY_S = 2.0
#: How often the batches folder is looked through for batches no proxy runs (their owner died).
ADOPT_EVERY_S = 5.0
#: How long a stop lets the batch lines in flight finish (at most shutdown_grace_s, counted from the stop's
#: beginning); then they are cancelled, and run again at the next start.
LINES_GRACE_S = 5.0
#: The final statuses as /stats' `batches_done` lists them.
ENDED_ORDER = ("completed", "failed", "cancelled", "expired")
#: How often a batch whose files were damaged by hand (a garbage line, a link) is tried again, quietly.
DAMAGED_RETRY_S = 10.0
#: How often a batch tries again the writes its disk refused (a full disk: until space is freed).
DISK_RETRY_S = 2.0


def window_seconds(window: str) -> int | None:
    """`completion_window` in seconds: `24h` or longer, in hours; None if it is not one."""
    match = _WINDOW.fullmatch(window)
    if match is None or int(match.group(1)) < 24:
        return None
    return int(match.group(1)) * 3600


def reads_input(record: BatchRecord) -> bool:
    """The batch reads its input file still: validating or sending it, or writing the error lines of its
    expired lines."""
    return record.status in ("validating", "in_progress", "cancelling") or (
        record.status == "finalizing" and record.ending == "expired"
    )


class BatchNotFound(LookupError):
    pass


#: The changes of status a cancel made before them overrides: the end of the input's check, and the end of
#: the lines.
_CANCEL_OVERRIDES = frozenset({"in_progress", "failed", "finalizing"})


def _kept_cancel(record: BatchRecord, changes: dict[str, Any]) -> dict[str, Any]:
    """`changes` to `record` with a cancel kept: a batch cancelled (while its input was checked, or as its
    last lines ended) is not run, nor failed, nor ended otherwise; it ends `cancelled`, with the errors its
    check found."""
    status = changes.get("status")
    if status not in _CANCEL_OVERRIDES or "cancelled" not in (record.ending, changes.get("ending")):
        return changes
    kept = {name: value for name, value in changes.items() if name not in ("in_progress_at", "failed_at")}
    if status == "finalizing":
        kept["ending"] = "cancelled"
    else:
        kept["status"] = "cancelling"
    return kept


class BatchEngine:
    """Every batch under `<checkpoints_dir>/batches`: created, run, cancelled, listed, resumed at start."""

    def __init__(
        self,
        settings: Settings,
        pool: UpstreamPool,
        flights: Flights,
        files: FileStore,
        root: str,
        counts: RankCounters | None = None,
        *,
        per_host: bool = False,
    ) -> None:
        """`per_host`: keep the answers' cache in this host's own folder (`host_answers`), for a proxy, whose
        checkpoints dir other hosts' proxies may share; else in one (`inferproxy run-batch`: one process)."""
        self.settings = settings
        self.pool = pool
        self.flights = flights
        self.files = files
        self.root = Path(root)
        slots = (settings.max_inflight_per_upstream or 256) * len(pool.replicas)
        # Lines at the upstream at once: `slots`. Lines not yet on disk (sent, or answered and waiting for
        # their write): twice that, so that the writes' fsyncs never leave the upstream short of lines; it
        # is what a kill can make the next start pay for again.
        self.upstream_slots = asyncio.Semaphore(slots)
        self.share = FairShare(2 * slots)
        self.answers_root = str(self.root / ANSWERS)
        self.per_host = per_host
        self.answers = RequestCache(
            host_answers(self.answers_root) if per_host else self.answers_root,
            flush_interval_ms=settings.flush_interval_ms,
            replay_same_run=True,
        )
        #: the serials whose answers this proxy's cache dropped (`FORGOTTEN`, looked at by `adopt`)
        self._forgotten: set[int] = set()
        self._forgotten_unread = False  # said once, while the folder of them cannot be read
        self.answerer = Answerer(settings, pool, flights, self.answers, counts or RankCounters())
        self.running: dict[str, Running] = {}
        #: The final status of each batch in the dir that this proxy saw end or found ended (`adopt`, at the
        #: start and every ADOPT_EVERY_S): /stats counts them without listing the dir. A final status is
        #: final, so `adopt` reads such a batch's record no more.
        self.ended: dict[str, str] = {}
        self._skipped: set[str] = set()  # folders adopt cannot take (damaged, a link), each said once
        self.fsync = settings.fsync == "always"
        self._adopter: asyncio.Task[None] | None = None
        self._closing = False
        self._stopping_since: float | None = None  # time.monotonic() when the proxy began to stop

    # -- life -------------------------------------------------------------------------------

    async def start(self) -> None:
        await asyncio.to_thread(make_dirs_durable, str(self.root))
        if self.per_host:
            assert self.answers.base_dir is not None
            await asyncio.to_thread(take_shared_answers, self.answers_root, self.answers.base_dir)
        await self.answers.initialize(0)
        await self.adopt()
        self._adopter = asyncio.create_task(self._adopt_forever(), name="batches-adopt")

    def stop_sending(self) -> None:
        """No new line from now (the proxy is stopping); what is in flight goes on until `close`."""
        self._closing = True
        self._stopping_since = time.monotonic()
        for batch in self.running.values():
            batch.stopping.set()

    async def close(self) -> None:
        """Stop every batch (SIGTERM, shutdown): no new line is sent; the lines in flight get a few
        seconds, then are cancelled (they run again at the next start); every result is durable."""
        self._closing = True
        if self._adopter is not None:
            await cancel_and_wait(self._adopter)
        running = list(self.running.values())
        for batch in running:
            batch.stopping.set()
        tasks = [b.task for b in running if b.task is not None]
        if tasks:
            # The lines in flight have had since the stop began (while the live requests were answered):
            # what is left of LINES_GRACE_S, so that a stop stays within shutdown_grace_s.
            waited = 0.0 if self._stopping_since is None else time.monotonic() - self._stopping_since
            grace = max(min(LINES_GRACE_S, self.settings.shutdown_grace_s) - waited, 0.0)
            _, pending = await asyncio.wait(tasks, timeout=grace)  # 0: at once, what is done is done
            for task in pending:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for batch in running:
            with contextlib.suppress(Exception):
                await self._save(batch)
            batch.dir.release()
        self.running.clear()
        try:
            await self.answers.close()
        except CacheWriteError as exc:  # a full disk: the batches' results are durable, only the reuse is lost
            logger.warning(
                "the batches' answers cache could not keep its last answers (%s): a later batch asking the same "
                "lines generates them again",
                exc.__cause__ or exc,
            )

    async def adopt(self) -> None:
        """Run every active batch no proxy runs: this one's after a restart, a dead proxy's; and forget the
        answers of the batches whose output another proxy deleted."""
        await self._drop_forgotten()
        for folder in await asyncio.to_thread(self._folders):
            if folder.id in self.running or folder.id in self.ended or self._closing:
                continue
            try:
                record = await asyncio.to_thread(folder.load)
                claimed = record.status in ACTIVE and await asyncio.to_thread(folder.claim)
            except FileNotFoundError:
                continue  # being created
            except (OSError, ValueError) as exc:  # damaged or planted by hand: never run, said once
                if folder.id not in self._skipped:
                    self._skipped.add(folder.id)
                    logger.warning("batch %s is not run: %s (inferproxy inspect names what is wrong)", folder.id, exc)
                continue
            if record.status in FINAL:
                self.ended[folder.id] = record.status
            elif claimed:
                record = await asyncio.to_thread(folder.load)  # as its last owner left it
                if record.status in ACTIVE:
                    logger.info("batch %s: carrying on (%s)", record.id, record.status)
                    batch = Running(folder, record)
                    if record.status != "validating":
                        # batch.json's counts may lag what was shown before a kill (saved every SAVE_EVERY_S):
                        # the durable ones are read back before the batch shows, so they never go back
                        try:
                            await self._load_results(batch)
                            batch.loaded = True
                        except Exception:  # read again by the batch's own task, which says why
                            pass
                    self._run(folder, record, batch)
                else:
                    if record.status in FINAL:  # ended by its owner as this proxy claimed it
                        self.ended[folder.id] = record.status
                    folder.release()

    async def _adopt_forever(self) -> None:
        while True:
            await asyncio.sleep(ADOPT_EVERY_S)
            try:
                await self.adopt()
            except Exception:
                logger.exception("looking for batches to carry on failed")

    def _folders(self) -> list[BatchDir]:
        if not self.root.is_dir():
            return []
        return [BatchDir(p) for p in self.root.iterdir() if is_batch_id(p.name) and p.is_dir() and not p.is_symlink()]

    # -- the routes' operations ---------------------------------------------------------------

    async def create(
        self,
        input_file_id: str,
        endpoint: str,
        completion_window: str,
        metadata: dict[str, str] | None,
        *,
        batch_id: str | None = None,
    ) -> BatchRecord:
        """A new batch, running. `batch_id`: the id to create it under, one the caller reserved (and recorded)
        beforehand, so that a crash right after the creation leaves no batch the caller does not know of."""
        window = window_seconds(completion_window)
        assert window is not None, "checked by the route"
        made = time.time()
        now = int(made)
        record = BatchRecord(
            id=batch_id or new_batch_id(made),
            endpoint=endpoint,
            input_file_id=input_file_id,
            completion_window=completion_window,
            created_at=now,
            expires_at=now + window,
            serial=secrets.randbelow(SERIALS),
            metadata=metadata,
        )
        folder = BatchDir(self.root / record.id)
        try:
            claimed = await asyncio.to_thread(folder.create, record)
        except OSError:  # a full or read-only disk: no folder is left of a batch never created
            folder.release()
            await asyncio.to_thread(shutil.rmtree, folder.root, True)
            raise
        if not claimed:
            raise RuntimeError(f"batch {record.id} was claimed by another process as it was created")
        self._run(folder, record)
        return record

    def get(self, batch_id: str) -> BatchRecord:
        running = self.running.get(batch_id)
        if running is not None:
            self._see_cancel(running)
            return running.record
        if not is_batch_id(batch_id):
            raise BatchNotFound(batch_id)
        try:
            return BatchDir(self.root / batch_id).load()
        except (OSError, ValueError):
            raise BatchNotFound(batch_id) from None

    def all(self) -> list[BatchRecord]:
        """Every batch, newest first."""
        found = [record for folder in self._folders() if (record := self._record(folder.id)) is not None]
        return sorted(found, key=lambda r: r.id, reverse=True)  # ids sort as the batches were made

    def _record(self, batch_id: str) -> BatchRecord | None:
        """A batch's record: this proxy's own, if it runs the batch, else as `batch.json` has it; None for one
        damaged, or removed meanwhile. Called in threads (`all`, `page`): one look-up of `running`."""
        running = self.running.get(batch_id)
        try:
            return running.record if running is not None else BatchDir(self.root / batch_id).load()
        except (OSError, ValueError):
            return None

    def _see_cancel(self, batch: Running) -> None:
        """A cancel asked through another proxy sharing the folder (its `cancel` file), taken by this one, which
        runs the batch, when it is asked about the batch (else it would show `in_progress`, and send new lines,
        after the other answered `cancelling`), at each save and at the end of its lines. Kept in batch.json
        at the next save, never saved over."""
        record = batch.record
        if record.status != "in_progress":
            return
        try:
            asked = batch.dir.cancel_asked()
        except OSError:
            return  # looked at again at the next save
        if asked is not None:
            record.status, record.cancelling_at, record.ending = "cancelling", asked, "cancelled"
            batch.stopping.set()
            batch.saved_counts = (-2, -2)  # saved at the next save: batch.json says it, not only the file

    async def cancel(self, batch_id: str) -> BatchRecord:
        """`cancelling` at once (no new line is sent), `cancelled` once the lines in flight are done and the
        files are written. A batch another proxy runs is cancelled by it, when it sees the record."""
        record = self.get(batch_id)
        if record.status not in ("validating", "in_progress"):
            return record
        running = self.running.get(batch_id)
        cancel: dict[str, Any] = {"status": "cancelling", "cancelling_at": int(time.time()), "ending": "cancelled"}
        if running is None:  # not ours to run: the owner sees it at once (`get`), or at its next save
            folder = BatchDir(self.root / batch_id)
            await asyncio.to_thread(folder.ask_cancel, cancel["cancelling_at"])
            return dataclasses.replace(record, **cancel)
        # kept before it is shown and carried out: a cancel the disk refused is neither (the client's retry is)
        async with running.saving:  # decided on the record as no other change can make it meanwhile
            if running.record.status not in ("validating", "in_progress"):
                return running.record
            await self._saved(running, cancel)
        running.stopping.set()
        return record

    def page(self, after: str | None, limit: int) -> tuple[list[BatchRecord], bool]:
        """The newest `limit` batches made before `after` (any if None: ids sort as the batches were made), and
        whether there are more; reading only those records (and one more), not every batch's: in a thread."""
        names = sorted((folder.id for folder in self._folders() if after is None or folder.id < after), reverse=True)
        found: list[BatchRecord] = []
        for name in names:
            record = self._record(name)
            if record is not None:
                found.append(record)
            if len(found) > limit:
                return found[:limit], True
        return found, False

    async def check_deletable(self, file_id: str) -> None:
        """`FileInUse` for the input file of a batch that still reads it."""
        for record in await asyncio.to_thread(self.all):  # every proxy's on a shared dir, not only this one's
            if record.input_file_id == file_id and reads_input(record):
                if record.status == "cancelling":
                    todo = "wait for it to end (its lines in flight), then delete the file"
                else:
                    todo = (
                        f"cancel the batch (POST /v1/batches/{record.id}/cancel) or wait for it to end, then delete "
                        f"the file"
                    )
                raise FileInUse(f"file {file_id} is the input of batch {record.id}, which is {record.status}: {todo}")

    def inputs_read(self) -> set[str]:
        """The input files of the batches that still read them, every proxy's on a shared dir: kept past their
        expiry until those batches end."""
        return {record.input_file_id for record in self.all() if reads_input(record)}

    async def forget_output(self, file_id: str) -> None:
        """A file about to be deleted: if it is a batch's output or error file, the answers of that batch are
        forgotten (a later batch with the same lines generates them again; an error kept, a 400, is the only
        answer a batch whose lines all failed has, and the error file its only file), by this proxy's cache
        at once and by the other hosts' at their next `adopt` (the serial written under `FORGOTTEN`).
        `OSError` if that cannot be written: the file is then not to be deleted."""
        for record in await asyncio.to_thread(self.all):
            if file_id in (record.output_file_id, record.error_file_id):
                await asyncio.to_thread(forget_answers, self.answers_root, record.serial)
                await self._drop(record.serial)

    async def _drop(self, serial: int) -> None:
        self._forgotten.add(serial)
        with contextlib.suppress(CacheWriteError):  # a full disk: the drop stays queued, and is retried
            await self.answers.drop_chunk(serial)

    async def _drop_forgotten(self) -> None:
        """Drop the answers of the batches forgotten through another proxy (`forget_output`) from this one's
        cache. A folder of them that cannot be read is said once (WARNING), and again once it can."""
        try:
            serials = await asyncio.to_thread(forgotten_answers, self.answers_root)
        except OSError as exc:
            if not self._forgotten_unread:
                self._forgotten_unread = True
                logger.warning(
                    "the batches whose output was deleted cannot be read (%s): answers deleted through other "
                    "proxies may be served by this one until it can; fix or remove %s",
                    exc,
                    os.path.join(self.answers_root, FORGOTTEN),
                )
            return
        if self._forgotten_unread:
            self._forgotten_unread = False
            logger.info("the batches whose output was deleted can be read again")
        for serial in serials:
            if serial not in self._forgotten:
                await self._drop(serial)

    # -- running a batch ----------------------------------------------------------------------

    def _run(self, folder: BatchDir, record: BatchRecord, batch: Running | None = None) -> None:
        batch = batch or Running(folder, record)
        self.running[record.id] = batch
        batch.task = asyncio.create_task(self._drive(batch), name=f"batch-{record.id}")

    async def _drive(self, batch: Running) -> None:
        record = batch.record
        try:
            while True:
                try:
                    await self._step(batch)
                except asyncio.CancelledError:
                    if batch.gone:
                        break
                    raise
                except Exception as exc:
                    if self._closing:
                        raise
                    if not batch.gone and not await asyncio.to_thread(batch.dir.root.is_dir):
                        self._gone(batch)  # removed by hand while it was finalized, say: never tried again
                    if batch.gone:
                        break
                    if is_disk_full(exc):  # said once (`_refused`), no traceback: tried again until space is freed
                        self._refused(batch, "step", exc)
                        await asyncio.sleep(DISK_RETRY_S)
                    elif isinstance(exc, (CorruptFileError, UnsafeFileError)):  # its files damaged by hand
                        why = f"{exc}: repair or remove it (inferproxy inspect names it), or cancel the batch"
                        if batch.refused.get("damaged") != why:
                            logger.error("batch %s: %s; tried again every %g s", record.id, why, DAMAGED_RETRY_S)
                        batch.refused["damaged"] = why
                        await asyncio.sleep(DAMAGED_RETRY_S)
                    else:
                        logger.exception("batch %s: %s failed; trying again in 10 s", record.id, record.status)
                        await asyncio.sleep(10)
                    continue
                self._written(batch, "step")
                self._written(batch, "damaged")
                if record.status not in ACTIVE or self._closing:
                    break
                if record.status == "in_progress" and batch.stopping.is_set() and record.ending is None:
                    break
        finally:
            if record.status in FINAL:
                self.ended[record.id] = record.status
            if not self._closing:
                self.running.pop(record.id, None)
                batch.dir.release()

    async def _step(self, batch: Running) -> None:
        record = batch.record
        if record.status == "validating":
            await self._validate(batch)
        elif record.status == "in_progress":
            await self._execute(batch)
        elif record.status in ("finalizing", "cancelling"):
            await self._finalize(batch)

    async def _validate(self, batch: Running) -> None:
        record = batch.record
        stored = self.files.get(record.input_file_id, expired_too=True)  # accepted before it expired: read
        missing = "the input file was deleted before the batch ran: upload it again and create a new batch"
        try:
            checked = (
                None
                if stored is None
                else await asyncio.to_thread(check_input, self.files.path(stored.id), record.endpoint)
            )
        except FileNotFoundError:  # its bytes removed by hand
            checked = None
        except UnsafeFileError as exc:  # a link put in its place: never read through
            checked, missing = None, str(exc)
        changes: dict[str, Any]
        if checked is None:
            errors = [{"code": "missing_input_file", "line": None, "param": "input_file_id", "message": missing}]
            changes = {"errors": errors, "status": "failed", "failed_at": int(time.time())}
        elif checked.bad or not checked.lines:
            errors = checked.errors or [
                {"code": "empty_file", "line": None, "param": None, "message": "the input file has no lines"}
            ]
            changes = {"errors": errors, "status": "failed", "failed_at": int(time.time())}
            logger.info("batch %s failed validation: %d bad lines", record.id, checked.bad)
        else:
            changes = {"total": checked.lines, "status": "in_progress", "in_progress_at": int(time.time())}
        fresh = await asyncio.to_thread(batch.dir.load)
        if fresh.status == "cancelling" and record.ending != "cancelled":  # through another proxy, meanwhile
            changes.update(cancelling_at=fresh.cancelling_at, ending="cancelled")
        await self._transition(batch, **changes)  # cancelled while it was being checked: `cancelling` (`_saved`)

    async def _load_results(self, batch: Running) -> None:
        """The lines done so far, from results.jsonl (the counts are its: a crash cannot set them back)."""
        record = batch.record

        def read() -> tuple[int, int, dict[str, int]]:
            batch.dir.close_results()  # reopened at the next append, past a torn tail cut off here
            batch.done = Lines()
            completed = failed = 0
            usage = {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0}
            for done in batch.dir.results():
                if batch.is_done(done.line):
                    continue
                batch.mark_done(done.line)
                if done.ok:
                    completed += 1
                else:
                    failed += 1
                add_tokens(usage, done.tokens)
            return completed, failed, usage

        # to its end (its repair of a torn tail cuts results.jsonl): never past the batch's lock
        record.completed, record.failed, record.usage = await run_to_end(asyncio.to_thread(read))
        batch.completed_at_start = record.completed + record.failed

    async def _wind_down(self, batch: Running, *helpers: asyncio.Task[None]) -> None:
        """The batch's helpers (its saver and writer) stopped, and every answer in written, before the counts
        are looked at; on a full disk while stopping, those lines run again at the next start."""
        await cancel_and_wait(*helpers)
        try:
            await self._write_results(batch)
        except OSError:
            if not (self._closing or batch.gone):
                raise

    async def _execute(self, batch: Running) -> None:
        record = batch.record
        await self._write_results(batch)  # what a round before left unwritten (a full disk)
        if not batch.loaded:  # else just read back by `adopt`
            await self._load_results(batch)
        batch.loaded = False
        # A step the disk refused before (`_drive`) is being done again, and its writes went through: were the
        # refusal kept until this step returns, its lines (which wait for the writes to go through) never would.
        self._written(batch, "step")
        saver = asyncio.create_task(self._save_progress(batch))
        writer = asyncio.create_task(self._writer(batch))
        lost: str | None = None
        try:
            try:
                await self._dispatch(batch)
            except (FileNotFoundError, UnsafeFileError) as exc:  # its bytes removed by hand, or a link put there
                lost = str(exc) if isinstance(exc, UnsafeFileError) else "its bytes were removed"
            finally:
                if not cancelling():
                    # every line sent is recorded (or given up) before the batch goes on, or tries again
                    await asyncio.gather(*batch.in_flight, return_exceptions=True)
        except asyncio.CancelledError:  # shutdown: the lines in flight (or waiting for a full disk) run again
            for task in batch.in_flight:
                task.cancel()
            await asyncio.gather(*batch.in_flight, return_exceptions=True)
            raise
        finally:
            # to its end even if the stop's grace runs out meanwhile: no helper left running past the owner
            # lock, every answer received written
            await run_to_end(self._wind_down(batch, saver, writer))
        if self._closing:
            return
        if not await asyncio.to_thread(batch.dir.root.is_dir):  # removed by hand: given up (`_drive`)
            raise FileNotFoundError(errno.ENOENT, "the batch's folder was removed", str(batch.dir.root))
        self._see_cancel(batch)
        if record.status == "cancelling":
            return
        now = int(time.time())
        if record.completed + record.failed >= record.total:
            ending = "completed"
        elif lost is not None:  # the lines not run cannot be: what finished goes to the files, the batch fails
            message = (
                f"the input file could not be read any more ({lost}) with {record.completed + record.failed} of "
                f"{record.total} lines done, which are in the output and error files: upload the file again and "
                f"create a new batch for the rest (the lines done are answered from the cache)"
            )
            logger.warning("batch %s failed: %s", record.id, message)
            errors = [{"code": "missing_input_file", "line": None, "param": "input_file_id", "message": message}]
            await self._transition(batch, errors=errors, status="finalizing", finalizing_at=now, ending="failed")
            return
        elif now >= record.expires_at:
            ending = "expired"
        else:
            if not batch.stopping.is_set():  # lines that could not be recorded (a full disk): again, later
                await asyncio.sleep(5)
            return  # or stopped (shutdown): carries on at the next start
        await self._transition(batch, status="finalizing", finalizing_at=now, ending=ending)

    async def _save(self, batch: Running) -> None:
        """`batch.json` replaced with the batch's record."""
        await self._transition(batch)

    async def _transition(self, batch: Running, **changes: Any) -> None:
        """The record's `changes` (a status and what goes with it) saved, then made: one the disk refuses
        leaves the record as it was, and as `batch.json` says, so that the step that asked for them is done
        again once it takes them. Made first, a status would be shown (and acted on) that no restart finds,
        and the step that saves it not done again (a batch `finalizing` for ever, one never sent)."""
        async with batch.saving:
            await self._saved(batch, changes)

    async def _saved(self, batch: Running, changes: dict[str, Any]) -> None:
        """Save the record with `changes`, then make them; with `batch.saving` held, so that saves land in the
        order they were made (a save of the counts begun before a cancel and ending after it put `in_progress`
        back in `batch.json`: a kill then, and the batch ran every line). A cancel made meanwhile is kept
        over a change decided before it (`_kept_cancel`). The save's thread is waited for even if the caller
        is cancelled: the next save must not land before it."""
        changes = _kept_cancel(batch.record, changes)
        record = dataclasses.replace(batch.record, **changes) if changes else batch.record
        try:
            await run_to_end(asyncio.to_thread(batch.dir.save, record))
        except OSError as exc:
            if is_disk_full(exc):
                self._refused(batch, "record", exc)
            raise
        self._written(batch, "record")
        for name, value in changes.items():
            setattr(batch.record, name, value)

    def _refused(self, batch: Running, what: str, exc: OSError | sqlite3.Error) -> None:
        """A write of the batch refused by a full disk: the batch pauses (no new line) until it goes through.
        Said once, when the first of its writes starts failing, without a traceback (it is no bug)."""
        # under the checkpoints dir (run-batch's state dir), which holds the batches' folder and the files'
        why = f"the checkpoints disk is full ({refusal_reason(exc)}): free space under {self.root.parent}"
        if not batch.refused:
            logger.warning(
                "batch %s: %s; it sends no new line meanwhile (their answers could not be kept), tries again every "
                "%g s and carries on by itself",
                batch.record.id,
                why,
                DISK_RETRY_S,
            )
            batch.resumed.clear()
        batch.refused[what] = why

    def _written(self, batch: Running, what: str) -> None:
        if batch.refused.pop(what, None) is not None and not batch.refused:
            logger.info("batch %s: its writes go through again; carrying on", batch.record.id)
            batch.resumed.set()

    async def _resumed(self, batch: Running) -> bool:
        """Wait until the batch's writes go through again (True), or it stops meanwhile (False)."""
        waits = [asyncio.ensure_future(batch.resumed.wait()), asyncio.ensure_future(batch.stopping.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        return not batch.stopping.is_set()

    async def _dispatch(self, batch: Running) -> None:
        record = batch.record
        path = self.files.path(record.input_file_id)
        with open_to_read(path) as f:
            for number, raw in enumerate(f, 1):
                if batch.stopping.is_set() or time.time() >= record.expires_at:
                    return
                if batch.is_done(number) or not raw.strip():
                    continue
                if not batch.resumed.is_set() and not await self._resumed(batch):
                    return
                await self.share.acquire(record.id)
                if batch.stopping.is_set():
                    self.share.release()
                    return
                task = asyncio.create_task(self._line(batch, number, raw))
                batch.in_flight.add(task)
                task.add_done_callback(lambda t: self._line_done(batch, t))

    def _line_done(self, batch: Running, task: asyncio.Task[None]) -> None:
        batch.in_flight.discard(task)
        self.share.release()
        if not task.cancelled() and task.exception() is not None:
            logger.error("batch %s: a line failed to be recorded", batch.record.id, exc_info=task.exception())

    def _gone(self, batch: Running) -> None:
        """The batch's folder was removed by hand: it is run no more (its lines in flight are given up), and
        said once; a batch is no batch without its record."""
        logger.warning(
            "batch %s: its folder %s was removed: it is run no more, its lines in flight given up",
            batch.record.id,
            batch.dir.root,
        )
        batch.gone = True
        batch.stopping.set()
        if batch.task is not None:
            batch.task.cancel()

    async def _save_progress(self, batch: Running) -> None:
        record = batch.record
        while True:
            await asyncio.sleep(SAVE_EVERY_S)
            counts = (record.completed, record.failed)
            if not await asyncio.to_thread(batch.dir.root.is_dir):
                self._gone(batch)
                return
            try:
                self._see_cancel(batch)
                if counts != batch.saved_counts:  # also after a save the disk refused: tried again
                    await self._save(batch)
                    batch.saved_counts = counts
            except OSError as exc:  # a full disk: said once, by `_refused`
                if not is_disk_full(exc):
                    logger.warning("batch %s: its progress could not be saved (%s)", record.id, exc)

    async def _line(self, batch: Running, number: int, raw: bytes) -> None:
        try:
            async with self.upstream_slots:
                if batch.stopping.is_set():
                    return  # stopped (cancelled, shutdown) while it waited: nothing sent, it runs again
                batch.sending += 1
                try:
                    queued = await self._answer_line(batch, number, raw)
                finally:
                    batch.sending -= 1
        except Exception as exc:  # never a line left unanswered for ever: it goes to the error file, saying why
            logger.exception("batch %s: line %d could not be run", batch.record.id, number)
            custom_id = orjson.loads(raw).get("custom_id", "")
            message = f"the proxy could not run this line: {type(exc).__name__}: {exc}"
            batch.pending.append(
                failure_result(batch.record.serial, number, custom_id, "internal_error", message[:1000])
            )
            batch.wake.set()
            queued = True
        if queued:  # its place is kept until its answer is on disk: a kill loses no more than the share
            async with batch.written:
                await batch.written.wait_for(lambda: batch.is_done(number))

    async def _answer_line(self, batch: Running, number: int, raw: bytes) -> bool:
        result = await self.answerer.answer(batch, number, raw)
        if result is None:
            return False  # stopped before an answer: the line runs again
        batch.pending.append(result)  # done once the writer has it on disk (`_write_results`)
        batch.wake.set()
        return True

    async def _writer(self, batch: Running) -> None:
        """The lines answered, appended to results.jsonl and fsynced a round at a time (a round: what was
        answered while the last one was written, `RESULTS_ROUND_S`), then counted."""
        while True:
            await batch.wake.wait()
            await asyncio.sleep(RESULTS_ROUND_S)
            batch.wake.clear()
            try:
                await self._write_results(batch)
            except OSError as exc:  # kept, tried again (a full disk: said once, by `_refused`)
                if not is_disk_full(exc):
                    logger.warning(
                        "batch %s: %d answers could not be written (%s)", batch.record.id, len(batch.pending), exc
                    )
                batch.wake.set()
                await asyncio.sleep(DISK_RETRY_S)

    async def _write_results(self, batch: Running) -> None:
        results = batch.pending
        if not results:
            return
        batch.pending = []
        try:
            await asyncio.to_thread(batch.dir.append, results, fsync=self.fsync)
        except BaseException as exc:
            batch.pending[:0] = results
            if is_disk_full(exc):
                self._refused(batch, "results", exc)
            raise
        self._written(batch, "results")
        record = batch.record
        for result in results:
            batch.mark_done(result.line)
            if result.ok:
                record.completed += 1
            else:
                record.failed += 1
            add_tokens(record.usage, result.tokens)
        async with batch.written:  # their lines give their slots up
            batch.written.notify_all()

    async def _finalize(self, batch: Running) -> None:
        """Write the output and error files from results.jsonl (under ids reserved first, so that a crash
        here writes them again under the same ids), then the batch's final status."""
        record = batch.record
        if record.ending is None:
            record.ending = "cancelled" if record.status == "cancelling" else "completed"
        if record.output_file_id is None and record.error_file_id is None:
            ids = {"output_file_id": new_file_id(time.time()), "error_file_id": new_file_id(time.time())}
            await self._transition(batch, **ids)
        await self._load_results(batch)  # the done lines (for the expired ones' errors) and the counts
        # To its end, even if the proxy stops meanwhile: the batch's lock is let go only after it, else the proxy
        # taking the batch over would write the same reserved file ids as this thread.
        has = await run_to_end(asyncio.to_thread(write_files, self.files, batch))
        if is_remote(self.settings.output):
            written = [i for i, kept in zip((record.output_file_id, record.error_file_id), has, strict=True) if kept]
            await upload(self.files, self.settings, record, [file_id for file_id in written if file_id is not None])
        now = int(time.time())
        changes: dict[str, Any] = {
            "output_file_id": record.output_file_id if has[0] else None,
            "error_file_id": record.error_file_id if has[1] else None,
            "status": record.ending,
        }
        if record.ending == "completed":
            changes["completed_at"] = now
        elif record.ending == "expired":
            changes["expired_at"] = now
            changes["failed"] = record.total - record.completed  # the lines not run are in the error file
        elif record.ending == "failed":
            changes["failed_at"] = now
        else:
            changes["cancelled_at"] = now
        await self._transition(batch, **changes)
        logger.info(
            "batch %s %s: %d completed, %d failed of %d",
            record.id,
            record.status,
            record.completed,
            record.failed,
            record.total,
        )

    # -- progress ---------------------------------------------------------------------------

    def ended_counts(self) -> dict[str, int]:
        """How many batches ended in each final status, of those this proxy knows (`ended`), for /stats."""
        counts = dict.fromkeys(ENDED_ORDER, 0)
        for status in list(self.ended.values()):  # a copy: /stats reads this in a thread
            counts[status] += 1
        return counts

    def progress(self) -> list[dict[str, Any]]:
        """The running batches, for /stats: counts, rate since this proxy took them, ETA."""
        out = []
        for batch in self.running.values():
            record = batch.record
            done = record.completed + record.failed
            elapsed = time.monotonic() - batch.started_at
            rate = (done - batch.completed_at_start) / elapsed if elapsed > 0 else 0.0
            left = max(record.total - done, 0)
            out.append(
                {
                    "id": record.id,
                    "status": record.status,
                    "total": record.total,
                    "completed": record.completed,
                    "failed": record.failed,
                    "in_flight": batch.sending,
                    "usage": dict(record.usage),
                    "hits": batch.hits,
                    "lines_per_s": round(rate, 2),
                    "eta_s": round(left / rate) if rate > 0 and left else None,
                    "paused": next(iter(batch.refused.values()), None),
                }
            )
        return out
