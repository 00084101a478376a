"""`inferproxy inspect CHECKPOINTS_DIR`: what a checkpoints dir holds, per rank, read without writing a byte.

For a person looking at a running proxy's dir, or at a dead one's after a
crash or a lost node: each rank's last published chunk, its open chunk files
and their documents, the torn lines a restart will cut off, its request
cache, its owner lock, and what `GET /resume` will answer once a restarted
proxy has restored it. Every number comes from the code the proxy restores a
rank with (`app.checkpoints.resume`, `app.store.durable.scan_jsonl`, `app.store.cache.count_entries`,
`app.store.ownership.probe_owner`), in their read-only forms: nothing is created,
modified or truncated, SQLite's WAL and index included. Only real folders and
regular files are opened, as the proxy opens them (a link or a FIFO there is a
problem line), small files are read with a bound, and what a file says is
escaped before it is printed.

The Batch API's batches and files in the same dir are reported after the ranks
(`app.tools.inspect_batches`), read by the store's own readers in the same way.

A live proxy's files move while they are read: its numbers are a moment's,
and a line it is appending may show as torn.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from app.checkpoints.documents import Document
from app.checkpoints.output import redact_url
from app.checkpoints.publish import ChunkPublisher
from app.checkpoints.resume import (
    RecordsPerChunkMismatch,
    ResumePoint,
    check_records_per_chunk,
    decode_chunk,
    read_last_chunk_file,
    recorded_records_per_chunk,
    resume_after_restore,
)
from app.store.cache import SQLITE_SUFFIXES, count_entries
from app.store.durable import CorruptFileError, UnsafeFileError, check_safe, scan_jsonl
from app.store.layout import DEFAULT_OUTPUT_FILENAME, META_FILENAME, CheckpointsLayout, RankPaths
from app.store.ownership import OwnerLock, probe_owner
from app.tools import inspect_batches
from app.tools.inspect_batches import ApiReport
from app.tools.terminal import printable

ChunkState = Literal["open", "full", "published"]
#: Where a rank's resume point comes from: its checkpoints; or, for a rank without any, the
#: output's listing (looked at with `--output`; `unchecked_output`: assumed to hold none of its chunks).
ResumeSource = Literal["checkpoints", "output", "unchecked_output"]


class NotACheckpointsDir(ValueError):
    """The path given is not a checkpoints dir that can be read."""


@dataclass(frozen=True, slots=True)
class ChunkReport:
    chunk_index: int
    bytes: int
    documents: int | None  # distinct ids in its whole lines; None if it cannot be read
    state: ChunkState  # full: a restart publishes it; published: left by a crash, a restart deletes it
    torn_at: int | None  # where a torn last line starts: a restart cuts the file back to this size


@dataclass(slots=True)
class RankReport:
    rank: int
    last_chunk_index: int  # as last_chunk/<rank>.txt says: -1 if absent or unreadable
    chunks: list[ChunkReport] = field(default_factory=list)
    cache_entries: int | None = None  # None: no cache file (or an unreadable one)
    cache_bytes: int | None = None
    owner: OwnerLock | None = None  # None: no owner lock file
    resume: ResumePoint | None = None  # None: a restarted proxy could not restore the rank (see problems)
    resume_source: ResumeSource = "checkpoints"
    problems: list[str] = field(default_factory=list)


@dataclass(slots=True)
class DirReport:
    root: str
    records_per_chunk: int | None
    ranks: list[RankReport]
    problems: list[str]
    api: ApiReport = field(default_factory=lambda: ApiReport(False))  # the Batch API's batches and files
    notes: list[str] = field(default_factory=list)  # what is so of the dir, nothing wrong
    checkpointed: bool = True  # whether any rank has a chunk or last_chunk file (else no records_per_chunk yet)


def inspect_dir(
    root: str,
    *,
    ranks: Iterable[int] | None = None,
    records_per_chunk: int | None = None,
    output: str | None = None,
    output_filename: str | None = None,
) -> DirReport:
    """Read the checkpoints dir `root` (the ranks given, or every rank with anything in it).

    `records_per_chunk` is what a proxy would be restarted with, needed where the dir does
    not record it; `output` (and its `output_filename`) is looked at for ranks without any
    checkpoint, as a restarted proxy does. Raises `NotACheckpointsDir`.
    """
    if not root:  # os.path.abspath would make it the current folder
        raise NotACheckpointsDir("the path is empty: give the --checkpoints-dir of the proxy to inspect")
    root = os.path.abspath(root)
    layout = CheckpointsLayout(root)
    names = _check_dir(root)
    problems: list[str] = []
    notes: list[str] = []
    unlisted: list[OSError] = []  # last_chunk/ or owners/, which cannot be listed
    known = layout.known_ranks(unlisted)
    problems += [
        f"cannot list {exc.filename}: {exc.strerror}: a rank named only there is not shown" for exc in unlisted
    ]
    checkpointed = _any_checkpoint(layout, known)
    try:
        recorded = recorded_records_per_chunk(layout)
    except (CorruptFileError, OSError) as exc:
        problems.append(f"a restarted proxy refuses to start: {exc}")
        recorded = None
    if recorded is not None and records_per_chunk is not None:
        try:
            check_records_per_chunk(layout, records_per_chunk, record=False)
        except RecordsPerChunkMismatch as exc:
            problems.append(f"--records-per-chunk {records_per_chunk}: a proxy started with it refuses to: {exc}")
    elif recorded is None and META_FILENAME not in names and known and not checkpointed:
        # A proxy records it with the first document it checkpoints: before, its ranks hold caches only,
        # and every rank resumes at its start whatever the value.
        notes.append(
            f"{META_FILENAME} is not written yet: no document checkpointed yet, the ranks hold request caches "
            f"only (a proxy records records_per_chunk with the first one)"
        )
    elif recorded is None and META_FILENAME not in names and known:
        given = (
            f"the numbers below use --records-per-chunk {records_per_chunk}"
            if records_per_chunk is not None
            else "pass --records-per-chunk N (the value the job was run with) to see what /resume will answer"
        )
        problems.append(
            f"{layout.meta_file} is missing, so records_per_chunk is unknown (checkpoints written by datatrove "
            f"or an older inferproxy): "
            f"a restarted proxy trusts and records its own --records-per-chunk; {given}"
        )
    publisher = ChunkPublisher(output, root, output_filename or DEFAULT_OUTPUT_FILENAME) if output else None
    rpc = recorded if recorded is not None else records_per_chunk
    chosen = known if ranks is None else sorted(set(ranks))
    shared = layout.rank(0).folders[1:]  # last_chunk/ and owners/
    refused = [f"a restarted proxy refuses every rank: {why}" for folder in shared if (why := _unsafe(folder, True))]
    problems += refused
    reports = [_rank_report(layout.rank(rank), rpc, publisher, refused=bool(refused)) for rank in chosen]
    api = inspect_batches.inspect_api(layout, _cache_numbers)
    return DirReport(root, recorded, reports, problems + api.problems, api, notes, checkpointed)


def _any_checkpoint(layout: CheckpointsLayout, ranks: list[int]) -> bool:
    """Whether any of `ranks` has a chunk file or a last_chunk file (one that cannot be listed is taken to)."""
    for rank in ranks:
        try:
            if layout.rank(rank).has_checkpoints():
                return True
        except OSError:
            return True
    return False


def _unsafe(path: str, folder: bool = False) -> UnsafeFileError | None:
    """Why the proxy would refuse to open `path` (a link, a FIFO, ...), if it would."""
    try:
        check_safe(path, folder=folder)
    except UnsafeFileError as exc:
        return exc
    return None


def _check_dir(root: str) -> list[str]:
    """The names in `root`, or `NotACheckpointsDir` saying what is wrong with it."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        raise NotACheckpointsDir(f"{root} does not exist: give the --checkpoints-dir of the proxy to inspect") from None
    except NotADirectoryError:
        above = _file_above(root)
        if above is not None:
            raise NotACheckpointsDir(f"{root} cannot be a checkpoints dir: {above} is a file, not a folder") from None
        raise NotACheckpointsDir(f"{root} is a file, not a checkpoints dir") from None
    except OSError as exc:
        raise NotACheckpointsDir(f"cannot read {root}: {exc.strerror}") from None
    what = "checkpoint_meta.json, last_chunk/, owners/, rank folders (00000/, ...), files/ or batches/"
    if not names:
        raise NotACheckpointsDir(f"{root} is empty: not a checkpoints dir, which holds {what}")
    if not _is_checkpoints_dir(root, names):
        children = [name for name in sorted(names) if _child_is_checkpoints_dir(os.path.join(root, name))]
        if children:  # `inferproxy-data`, the parent of the default `inferproxy-data/checkpoints`
            held = " and ".join(f"{name}/" for name in children)
            meant = " or ".join(os.path.join(root, name) for name in children)
            raise NotACheckpointsDir(f"{root} is not a checkpoints dir: it holds {held}: did you mean {meant}?")
        raise NotACheckpointsDir(f"{root} is not a checkpoints dir: it holds none of {what}")
    return names


def _file_above(path: str) -> str | None:
    """The first of the folders on the way to `path` that is a file, if one is."""
    for parent in reversed(Path(path).parents):
        if os.path.lexists(parent) and not os.path.isdir(parent):
            return str(parent)
    return None


def _is_checkpoints_dir(root: str, names: list[str]) -> bool:
    layout = CheckpointsLayout(root)
    unlisted: list[OSError] = []  # an owners/ or last_chunk/ that cannot be read is one all the same
    ranks = layout.known_ranks(unlisted)
    return META_FILENAME in names or bool(ranks or unlisted) or inspect_batches.has_batch_api(layout)


def _child_is_checkpoints_dir(path: str) -> bool:
    """Whether `path` is a real folder (not a link: not followed) that is a checkpoints dir."""
    if os.path.islink(path) or not os.path.isdir(path):
        return False
    try:
        return _is_checkpoints_dir(path, os.listdir(path))
    except OSError:
        return False


def _rank_report(
    paths: RankPaths, records_per_chunk: int | None, publisher: ChunkPublisher | None, *, refused: bool
) -> RankReport:
    """What a restore of the rank finds. A proxy refuses a rank with a link or a special file among its
    entries (`UnsafeFileError`): then nothing of it is predicted, and a linked folder is not read."""
    report = RankReport(paths.rank, -1)
    unsafe_dir = _unsafe(paths.rank_dir, True)
    if refused or unsafe_dir is not None:
        if unsafe_dir is not None:
            report.problems.append(f"a restarted proxy refuses this rank: {unsafe_dir}")
        return report
    try:
        last = read_last_chunk_file(paths.last_chunk_file)
    except UnsafeFileError as exc:
        report.problems.append(f"a restarted proxy refuses this rank: {exc}")
        refused = True
    else:
        report.last_chunk_index = last.value
        if last.problem is not None:
            report.problems.append(last.problem)
    try:
        files = paths.chunk_files()
    except OSError as exc:
        # Its chunk files and cache are unknown, and so what a restore finds: the cache is not looked for.
        report.problems.append(f"cannot list {paths.rank_dir}: {exc.strerror}: its chunks and cache are not read")
        restorable = None
    else:
        restorable = _read_chunks(files, records_per_chunk, report)
        refused = not _read_cache(paths, report) or refused
    try:
        owner = probe_owner(paths.owner_file)
    except UnsafeFileError as exc:
        report.problems.append(f"a restarted proxy refuses this rank: {exc}")
        refused = True
    except OSError as exc:
        report.problems.append(f"cannot read {paths.owner_file}: {exc}")
    else:
        report.owner = None if owner is None else _checked_owner(paths.owner_file, owner, report)
    checkpoints = paths.has_checkpoints() if restorable is not None and not refused else True
    if restorable is None or refused or (records_per_chunk is None and checkpoints):
        return report
    start = report.last_chunk_index
    if publisher is not None and start >= 0:
        # As a restarted proxy checks it: what last_chunk says is published must be in the output.
        try:
            missing = publisher.missing_chunks(paths.rank, start)
        except Exception as exc:  # an object store's errors are its own
            report.problems.append(f"cannot list the output {publisher.output}: {exc}")
        else:
            if missing:
                shown = ", ".join(map(str, missing[:10])) + (", ..." if len(missing) > 10 else "")
                report.problems.append(
                    f"chunks [{shown}] are recorded as published (last_chunk {start}) but are not in the output "
                    f"{redact_url(publisher.output)}: a restarted proxy refuses the rank (409 output_lost_error) "
                    f"until they are put back, or {missing[0] - 1} is written into {paths.last_chunk_file}"
                )
                return report  # /resume answers 409: nothing to predict
    if not checkpoints:
        # A restarted proxy first recovers such a rank's last chunk from the output's listing.
        report.resume_source = "unchecked_output"
        if publisher is not None:
            try:
                start = publisher.last_published_chunk(paths.rank)
                report.resume_source = "output"
            except Exception as exc:  # an object store's errors are its own
                report.problems.append(f"cannot list the output {publisher.output}: {exc}")
    if records_per_chunk is None:
        if start >= 0:  # chunks in the output, of a size unknown
            return report
        records_per_chunk = 1  # nothing to skip, whatever the size: the rank resumes at its start
    report.resume = resume_after_restore(start, restorable, records_per_chunk)
    return report


#: What an owner lock file holds, as inferproxy writes it: (key, types, what it is).
_OWNER_FIELDS: tuple[tuple[str, tuple[type, ...], str], ...] = (
    ("host", (str,), "a host name"),
    ("pid", (int,), "a process id"),
    ("port", (int,), "a port"),
    ("since", (int, float), "a time"),
)


def _checked_owner(path: str, lock: OwnerLock, report: RankReport) -> OwnerLock:
    """The lock with only what inferproxy could have written in it (`host` made printable); anything else is
    a problem line and left out, so that `--json` keeps its types."""
    kept: dict[str, object] = {}
    for key, types, what in _OWNER_FIELDS:
        value = lock.owner.get(key)
        if value is None:
            continue
        if isinstance(value, types) and not isinstance(value, bool):
            kept[key] = printable(value) if isinstance(value, str) else value
        else:
            report.problems.append(f"{path} names no {key} ({what}): it holds {printable(repr(value)[:80])}")
    return OwnerLock(lock.held, kept)


def _read_chunks(
    files: list[tuple[int, str]], records_per_chunk: int | None, report: RankReport
) -> dict[int, set[str]] | None:
    """Fill `report.chunks` from the rank's chunk `files`; return the ids of each chunk a restart restores,
    None if one cannot be."""
    restorable: dict[int, set[str]] | None = {}
    for chunk_index, path in files:
        published = chunk_index <= report.last_chunk_index  # a restart deletes it unread
        size, documents, torn_at = 0, None, None
        try:
            size = os.lstat(path).st_size
            scan = scan_jsonl(path)
            torn_at = scan.torn_at
            ids = {document.id for document in decode_chunk(path, scan.records, records_per_chunk, Document.from_dict)}
            documents = len(ids)
            if restorable is not None and not published:
                restorable[chunk_index] = ids
        except (OSError, CorruptFileError, RecordsPerChunkMismatch) as exc:
            report.problems.append(
                f"chunk {chunk_index}: {exc}" if published else f"a restarted proxy cannot restore this rank: {exc}"
            )
            if not published:
                restorable = None
        state: ChunkState = (
            "published" if published else "full" if documents is not None and documents == records_per_chunk else "open"
        )
        report.chunks.append(ChunkReport(chunk_index, size, documents, state, torn_at))
    return restorable


def _read_cache(paths: RankPaths, report: RankReport) -> bool:
    """Fill the rank's cache numbers; False where a proxy would refuse to open the cache."""
    try:
        numbers = _cache_numbers(paths.cache_file, report.problems)
    except UnsafeFileError as exc:
        report.problems.append(f"a restarted proxy refuses this rank: {exc}")
        return False
    if numbers is not None:
        report.cache_entries, report.cache_bytes = numbers
    return True


def _cache_numbers(cache_file: str, problems: list[str]) -> tuple[int | None, int] | None:
    """`(entries, bytes)` of a request cache file and its WAL (entries None if it cannot be read, a problem
    line saying why), None without the file; `UnsafeFileError` where a proxy would refuse to open it."""
    try:
        for suffix in SQLITE_SUFFIXES:
            check_safe(cache_file + suffix)
        size = os.lstat(cache_file).st_size
    except FileNotFoundError:
        return None
    except UnsafeFileError:
        raise
    except OSError as exc:  # a folder on the way that cannot be searched
        problems.append(f"cannot read {cache_file}: {exc.strerror}")
        return None
    try:
        wal = os.lstat(cache_file + "-wal").st_size
    except FileNotFoundError:
        wal = 0
    try:
        return count_entries(cache_file), size + wal
    except (sqlite3.Error, OSError) as exc:
        problems.append(f"cannot read the request cache {cache_file}: {exc}")
        return None, size + wal


# ----------------------------------------------------------------------- output


def to_json(report: DirReport) -> dict[str, Any]:
    """The `--json` shape (docs/contract.md, "inferproxy inspect"): stable, every key always present."""
    return {
        "checkpoints_dir": report.root,
        "records_per_chunk": report.records_per_chunk,
        "problems": [printable(problem) for problem in report.problems],
        "notes": [printable(note) for note in report.notes],
        "ranks": [
            {
                "rank": rank.rank,
                "last_chunk_index": rank.last_chunk_index,
                "chunks": [
                    {
                        "chunk_index": chunk.chunk_index,
                        "documents": chunk.documents,
                        "bytes": chunk.bytes,
                        "state": chunk.state,
                        "torn": None
                        if chunk.torn_at is None
                        else {"offset": chunk.torn_at, "bytes": chunk.bytes - chunk.torn_at},
                    }
                    for chunk in rank.chunks
                ],
                "torn_lines": _torn_lines(rank),
                "cache": None
                if rank.cache_bytes is None
                else {"entries": rank.cache_entries, "bytes": rank.cache_bytes},
                "owner": None
                if rank.owner is None
                else {"held": rank.owner.held}
                | {key: rank.owner.owner.get(key) for key in ("host", "pid", "port", "since")},
                "resume": None
                if rank.resume is None
                else {
                    "last_chunk_index": rank.resume.last_chunk_index,
                    "docs_to_skip": rank.resume.docs_to_skip,
                    "processed_id_count": len(rank.resume.processed_ids),
                    "source": rank.resume_source,
                },
                "problems": [printable(problem) for problem in rank.problems],
            }
            for rank in report.ranks
        ],
        **inspect_batches.to_json(report.api),
    }


def render(report: DirReport) -> str:
    """The report as a person reads it: one row per rank, then notes and problems, one line each."""
    rpc = report.records_per_chunk
    # not recorded: said only where a rank has checkpoints (a dir of caches and batches has no use for it)
    recorded = (
        [f"records_per_chunk {rpc} ({META_FILENAME})"]
        if rpc is not None
        else ["records_per_chunk not recorded"]
        if report.checkpointed
        else []
    )
    ranks = f"{len(report.ranks)} rank{'s' if len(report.ranks) != 1 else ''}"
    lines = [f"checkpoints dir {report.root}: " + ", ".join([*recorded, ranks]) + _counted(report.api)]
    header = ("RANK", "LAST CHUNK", "OPEN CHUNKS: DOCUMENTS", "TORN", "CACHE", "OWNER", "RESUME AFTER A RESTART")
    rows = [header, *(_row(rank) for rank in report.ranks)]
    if report.ranks:
        widths = [max(len(row[column]) for row in rows) for column in range(len(header))]
        lines.append("")
        lines.extend(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows
        )
    lines += inspect_batches.tables(report.api, _size)
    notes = [
        *report.notes,
        *(note for rank in report.ranks for note in _notes(rank)),
        *inspect_batches.notes(report.api),
    ]
    live = [str(rank.rank) for rank in report.ranks if rank.owner is not None and rank.owner.held]
    if live:
        notes.append(
            f"rank {live[0]} is owned by a live proxy: its files move while they are read"
            if len(live) == 1
            else f"ranks {', '.join(live)} are owned by a live proxy: their files move while they are read"
        )
    problems = report.problems + [f"rank {rank.rank}: {problem}" for rank in report.ranks for problem in rank.problems]
    problems += inspect_batches.problems(report.api)
    if notes or problems:
        lines.append("")
    lines.extend(notes)
    lines.extend(f"problem: {problem}" for problem in problems)
    return "\n".join(printable(line) for line in lines)


def _counted(api: ApiReport) -> str:
    """`, 2 batches, 3 files` for a dir the Batch API has used (every proxy makes its folders)."""
    if not api.batches and not api.files:
        return ""
    batches, files = len(api.batches), len(api.files)
    return f", {batches} batch{'es' if batches != 1 else ''}, {files} file{'s' if files != 1 else ''}"


def _row(rank: RankReport) -> tuple[str, ...]:
    chunks = ", ".join(
        f"{chunk.chunk_index}: {'?' if chunk.documents is None else chunk.documents}"
        + ("" if chunk.state == "open" else f" ({chunk.state})")
        for chunk in rank.chunks
    )
    cache = "-" if rank.cache_bytes is None else f"{_entries(rank.cache_entries)}, {_size(rank.cache_bytes)}"
    resume = "?"
    if rank.resume is not None:
        resume = (
            f"last_chunk_index {rank.resume.last_chunk_index}, docs_to_skip {rank.resume.docs_to_skip}, "
            f"{len(rank.resume.processed_ids)} processed_ids"
        )
    return (
        str(rank.rank),
        str(rank.last_chunk_index),
        chunks or "-",
        str(_torn_lines(rank)),
        cache,
        _owner(rank),
        resume,
    )


def _owner(rank: RankReport) -> str:
    if rank.owner is None:
        return "-"
    record = rank.owner.owner
    who = f"pid {record.get('pid', '?')} on {record.get('host', '?')}" + (
        f", port {record['port']}" if record.get("port") else ""
    )
    if rank.owner.held:
        return f"held by {who}"
    return f"free ({who} is gone)" if record else "free (released)"


def _notes(rank: RankReport) -> list[str]:
    notes = []
    for chunk in rank.chunks:
        if chunk.torn_at is not None:
            notes.append(
                f"rank {rank.rank}: chunk {chunk.chunk_index} ends in a torn line ({chunk.bytes - chunk.torn_at} "
                f"bytes): a restart cuts the file back to {chunk.torn_at} bytes"
            )
        if chunk.state == "full":
            notes.append(f"rank {rank.rank}: chunk {chunk.chunk_index} is full: a restart publishes it")
        elif chunk.state == "published":
            notes.append(
                f"rank {rank.rank}: chunk {chunk.chunk_index} is published already (left by a crash): "
                f"a restart deletes its file"
            )
    if rank.resume is not None and rank.resume_source == "unchecked_output":
        notes.append(
            f"rank {rank.rank} has no checkpoints: a restarted proxy first looks for its published chunks in the "
            f"output, and resumes after them; the resume above assumes there are none (pass --output to look there)"
        )
    return notes


def _torn_lines(rank: RankReport) -> int:
    return sum(chunk.torn_at is not None for chunk in rank.chunks)


def _entries(count: int | None) -> str:
    return "? entries" if count is None else f"{count:,} entr{'y' if count == 1 else 'ies'}"


def _size(size: int) -> str:
    if size < 1024:
        return f"{size} bytes"
    value, unit = size / 1024, "KiB"
    for larger in ("MiB", "GiB", "TiB"):
        if value < 1024:
            break
        value, unit = value / 1024, larger
    return f"{value:.1f} {unit}"
