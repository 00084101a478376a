"""The invariants every chaos scenario ends with, written once.

A `Ledger` records what the clients were told (documents acknowledged, answers and when they arrived,
every `last_chunk_index` seen, when the proxy died); the checks compare it with what the proxy said
and what is on disk:

- every acknowledged document (a 200 from `POST /documents`) is in the published output exactly once,
  or still checkpointed in an open chunk; every published file is whole (each line parses) and holds
  only its chunk's documents, each once; nothing else is in the output;
- `last_chunk_index` never moves back: an observation made after another one was answered is never
  lower, across restarts too (the `last_chunk` file read while the proxy is dead is one);
- `PRAGMA integrity_check` passes on every cache file, and every stored answer is whole: a stream ending
  in `data: [DONE]` without an error event, a body that parses and is no error in disguise;
- `GET /resume` agrees with what was acknowledged before it was asked: each such document is skipped,
  by position or by id;
- cached answers replay byte for byte: a HIT is whole and is the bytes of the key's last whole MISS.
  An answer is stored within `flush_interval_ms` of being sent (contract §4: "a crash can lose at most
  the last batch window"), and a commit takes an fsync more, which a loaded machine stretches: so a key
  answered whole may be generated again (MISS) only if the proxy died between its request and
  `replay_window_s` (`flush_interval_ms` plus a generous settle time) after its answer.
"""

from __future__ import annotations

import contextlib
import re
import sqlite3
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from app.job.client import Resume
from app.store.durable import temporary_target

_OUTPUT_NAME = re.compile(r"^(\d{5})_chunk_(\d+)\.jsonl$")
_CHUNK_FILE = re.compile(r"^chunk_(\d{5})\.jsonl$")
REPLAYED = frozenset({"HIT", "COALESCED"})
GENERATED = frozenset({"MISS", "REFRESH"})


@dataclass(frozen=True, slots=True)
class Answer:
    """One request to `/v1/*` and what came back: `status` 0 if no head came, `data` None if the body was
    cut, `streamed` if it is a stream (`text/event-stream`; a streamed request may get a JSON error)."""

    rank: int
    doc_id: str
    rollout_idx: int
    path: str
    body: bytes
    streamed: bool
    state: str
    status: int
    data: bytes | None
    sent_at: float
    received_at: float
    headers: tuple[tuple[bytes, bytes], ...] = ()

    @property
    def key(self) -> tuple[int, str, int, str, bytes]:
        return self.rank, self.doc_id, self.rollout_idx, self.path, self.body

    def why_not_storable(self) -> str | None:
        """Why the proxy must not store this answer, or None if it must (contract §4)."""
        if self.data is None:
            return "cut short"
        return why_not_whole(self.status, self.streamed, self.data)


@dataclass(frozen=True, slots=True)
class Observation:
    """A `last_chunk_index` seen: asked at `sent_at`, answered at `received_at` (both on `time.monotonic()`)."""

    rank: int
    value: int
    sent_at: float
    received_at: float
    source: str


@dataclass
class Ledger:
    """What the clients were told, and when the proxy died. `inputs[rank]` is the rank's input, in order."""

    inputs: dict[int, list[str]]
    records_per_chunk: int
    replay_window_s: float
    acknowledged: dict[int, dict[str, float]] = field(default_factory=lambda: defaultdict(dict))
    answers: list[Answer] = field(default_factory=list)
    observations: list[Observation] = field(default_factory=list)
    deaths: list[float] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.positions = {rank: {doc: i for i, doc in enumerate(docs)} for rank, docs in self.inputs.items()}

    def chunk_of(self, rank: int, doc_id: str) -> int:
        return self.positions[rank][doc_id] // self.records_per_chunk

    def last_chunk(self, rank: int) -> int:
        """The chunk of the rank's last input document."""
        return (len(self.inputs[rank]) - 1) // self.records_per_chunk

    def acknowledge(self, rank: int, doc_id: str) -> None:
        self.acknowledged[rank].setdefault(doc_id, time.monotonic())

    def acks(self) -> int:
        return sum(len(docs) for docs in self.acknowledged.values())

    def observe(self, rank: int, value: int, sent_at: float, received_at: float, source: str) -> None:
        self.observations.append(Observation(rank, value, sent_at, received_at, source))

    def check_resume(self, rank: int, resume: Resume, sent_at: float, received_at: float) -> None:
        """A `GET /resume` answer against the documents acknowledged before it was asked."""
        last, skip, processed = resume.last_chunk_index, resume.docs_to_skip, resume.processed_ids
        self.observe(rank, last, sent_at, received_at, "/resume")
        if resume.records_per_chunk != self.records_per_chunk or skip != (last + 1) * self.records_per_chunk:
            self.violations.append(
                f"rank {rank}: /resume answered {resume} for records_per_chunk={self.records_per_chunk}"
            )
        positions = self.positions[rank]
        forgotten = [
            doc
            for doc, at in self.acknowledged[rank].items()
            if at < sent_at and positions[doc] >= skip and doc not in processed
        ]
        if forgotten:
            self.violations.append(
                f"rank {rank}: /resume (last_chunk_index {last}, docs_to_skip {skip}) would generate "
                f"{len(forgotten)} acknowledged documents again, e.g. {sorted(forgotten)[:3]}"
            )
        strangers = [doc for doc in processed if doc not in positions or positions[doc] < skip]
        if strangers:
            self.violations.append(f"rank {rank}: /resume lists ids it should not: {sorted(strangers)[:3]}")


def why_not_whole(status: int, streamed: bool, data: bytes) -> str | None:
    """Why an answer is not one the proxy may store and replay (cut, an error, an error in disguise), or None.

    Written apart from the proxy's own test, so that a fault in that one shows here.
    """
    if not (200 <= status < 300 or status == 400):
        return f"status {status}"
    if streamed:
        events = [event for event in data.split(b"\n\n") if event.strip()]
        if not events or events[-1].strip() != b"data: [DONE]":
            return "a stream without its final data: [DONE]"
        for event in events[:-1]:
            for line in event.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue
                try:
                    payload = orjson.loads(line[5:])
                except orjson.JSONDecodeError:
                    return f"a stream event that is not JSON: {line[:80]!r}"
                if isinstance(payload, dict) and "error" in payload:
                    return "a stream with an error event"
        return None
    try:
        payload = orjson.loads(data)
    except orjson.JSONDecodeError:
        return f"a body that is not JSON: {data[:80]!r}"
    if status != 400 and isinstance(payload, dict) and ("error" in payload or payload.get("object") == "error"):
        return "an error envelope in a 2xx"
    return None


# ------------------------------------------------------------------------------------------------ on disk


def whole_lines(path: Path, *, torn_tail_allowed: bool) -> tuple[list[dict[str, Any]], str | None]:
    """The JSON lines of a file, and what is wrong with it: a line that does not parse, or a torn tail
    (only a crash mid-append leaves one, and only in a checkpoint file, never in a published one)."""
    data = path.read_bytes()
    *lines, tail = data.split(b"\n")
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            records.append(orjson.loads(line))
        except orjson.JSONDecodeError:
            return records, f"{path}: line {number} does not parse: {line[:80]!r}"
    if tail and not torn_tail_allowed:
        return records, f"{path}: ends in a partial line {tail[:80]!r}"
    return records, None


def read_output(
    output: Path, ledger: Ledger, problems: list[str], *, temporaries_allowed: bool
) -> dict[int, dict[str, int]]:
    """Every published document: `{rank: {doc_id: chunk_index}}`; what is wrong goes to `problems`.

    `temporaries_allowed`: a chunk's `.<name>.<random>.tmp`, which a crash mid-publication leaves until
    the rank is restored after the restart, is no fault yet.
    """
    published: dict[int, dict[str, int]] = defaultdict(dict)
    if not output.exists():
        return published
    for path in sorted(output.iterdir()):
        target = temporary_target(path.name)
        temporary = _OUTPUT_NAME.match(target) if target is not None else None
        if path.name.startswith(".") and temporary and temporaries_allowed:
            continue
        match = _OUTPUT_NAME.match(path.name)
        if match is None or int(match.group(1)) not in ledger.inputs:
            problems.append(f"output: {path.name} is not a published chunk (left by a crash?)")
            continue
        rank, chunk = int(match.group(1)), int(match.group(2))
        records, problem = whole_lines(path, torn_tail_allowed=False)
        if problem:
            problems.append(f"output: {problem}")
        expected = {doc for doc in ledger.inputs[rank][chunk * ledger.records_per_chunk :][: ledger.records_per_chunk]}
        ids = [record.get("id") for record in records]
        for doc_id in ids:
            if doc_id not in expected:
                problems.append(f"output: {path.name} holds {doc_id!r}, not a document of that chunk")
            elif doc_id in published[rank]:
                problems.append(f"output: {doc_id!r} of rank {rank} is published twice")
            published[rank][doc_id] = chunk
        if chunk < ledger.last_chunk(rank) and set(ids) != expected:
            problems.append(f"output: {path.name} lacks {sorted(expected - set(ids))[:3]} of its full chunk")
    return published


def read_last_chunk(checkpoints: Path, rank: int) -> int:
    try:
        return int((checkpoints / "last_chunk" / f"{rank:05d}.txt").read_text())
    except FileNotFoundError:
        return -1


def check_at_rest(ledger: Ledger, checkpoints: Path, output: Path, *, finished: bool = False) -> list[str]:
    """What must hold on disk whenever the proxy is not running (killed, or stopped); with `finished`,
    once every rank's job is done too: every document published once, the working files gone."""
    problems: list[str] = []
    published = read_output(output, ledger, problems, temporaries_allowed=not finished)
    for rank in ledger.inputs:
        last = read_last_chunk(checkpoints, rank)
        rank_dir = checkpoints / f"{rank:05d}"
        checkpointed: set[str] = set()
        for path in sorted(rank_dir.glob("chunk_*.jsonl")) if rank_dir.exists() else []:
            match = _CHUNK_FILE.match(path.name)
            if match is None:
                continue
            records, problem = whole_lines(path, torn_tail_allowed=True)
            if problem:
                problems.append(f"checkpoints: {problem}")
            if int(match.group(1)) > last:  # a file at or below it is a crash's leftover, removed on restore
                checkpointed.update(record["id"] for record in records)
        for chunk in range(min(last + 1, ledger.last_chunk(rank))):
            if chunk not in published[rank].values():
                problems.append(f"rank {rank}: last_chunk_index is {last} but chunk {chunk} is not published")
        lost = [doc for doc in ledger.acknowledged[rank] if doc not in published[rank] and doc not in checkpointed]
        if lost:
            problems.append(
                f"rank {rank}: {len(lost)} acknowledged documents are neither published nor checkpointed in an "
                f"open chunk (last_chunk_index {last}), e.g. {sorted(lost)[:3]}"
            )
        if finished:
            missing = set(ledger.inputs[rank]) - set(published[rank])
            if missing:
                problems.append(f"rank {rank}: {len(missing)} documents never published, e.g. {sorted(missing)[:3]}")
            if last != ledger.last_chunk(rank):
                problems.append(f"rank {rank}: last_chunk is {last}, not its last chunk {ledger.last_chunk(rank)}")
            if rank_dir.exists():
                problems.append(f"rank {rank}: its working files are still there after its last chunk completed")
    for cache in sorted(checkpoints.glob("*/replay.sqlite3")):
        problems += check_cache_file(cache)
    return problems


def check_cache_file(path: Path) -> list[str]:
    """`PRAGMA integrity_check`, and every stored answer whole."""
    problems = []
    with contextlib.closing(sqlite3.connect(path)) as conn:
        integrity = conn.execute("PRAGMA integrity_check").fetchall()
        if integrity != [("ok",)]:
            problems.append(f"{path}: integrity_check says {integrity[:3]}")
        rows = conn.execute("SELECT doc_id, rollout_idx, status_code, streamed, result FROM request_cache")
        for doc_id, rollout_idx, status, streamed, result in rows:
            why = why_not_whole(status, bool(streamed), result)
            if why:
                problems.append(f"{path}: the answer stored for {doc_id!r} rollout {rollout_idx} is {why}")
    return problems


# ------------------------------------------------------------------------------------------------ in time


def check_last_chunk_never_moves_back(observations: Iterable[Observation]) -> list[str]:
    """An observation asked after another was answered never sees a lower `last_chunk_index`."""
    problems = []
    by_rank: dict[int, list[Observation]] = defaultdict(list)
    for seen in observations:
        by_rank[seen.rank].append(seen)
    for rank, seen in by_rank.items():
        answered = sorted(seen, key=lambda o: o.received_at)
        highest: Observation | None = None
        i = 0
        for later in sorted(seen, key=lambda o: o.sent_at):
            while i < len(answered) and answered[i].received_at < later.sent_at:
                if highest is None or answered[i].value > highest.value:
                    highest = answered[i]
                i += 1
            if highest is not None and later.value < highest.value:
                problems.append(
                    f"rank {rank}: last_chunk_index went back from {highest.value} ({highest.source}) to "
                    f"{later.value} ({later.source}, asked {later.sent_at - highest.received_at:.3f} s later)"
                )
                break
    return problems


def check_replays(ledger: Ledger) -> list[str]:
    """Cached answers replay byte for byte, and none is lost outside the window a crash may take."""
    problems = []
    by_key: dict[tuple[int, str, int, str, bytes], list[Answer]] = defaultdict(list)
    for answer in ledger.answers:
        by_key[answer.key].append(answer)
    for answers in by_key.values():
        answers.sort(key=lambda a: a.sent_at)
        for later in answers:
            if later.data is None or later.state not in REPLAYED | GENERATED:
                continue
            earlier = [a for a in answers if a.received_at < later.sent_at]
            stored = [a for a in earlier if a.state in GENERATED and a.why_not_storable() is None]
            name = f"rank {later.rank} {later.doc_id!r} rollout {later.rollout_idx}"
            if later.state in REPLAYED:
                why = later.why_not_storable()
                if why:
                    problems.append(f"{name}: replayed an answer that is {why}")
                elif stored and later.data != stored[-1].data:
                    problems.append(f"{name}: replayed bytes differ from the answer it stored")
                elif not stored and all(a.data is not None for a in earlier):
                    problems.append(f"{name}: replayed an answer no client ever received whole (nor was cut)")
            elif stored:
                first = stored[-1]
                excuse = [d for d in ledger.deaths if first.sent_at <= d <= first.received_at + ledger.replay_window_s]
                if not any(d <= later.sent_at for d in excuse):
                    problems.append(
                        f"{name}: generated again (MISS) {later.sent_at - first.received_at:.3f} s after its whole "
                        f"answer, with no crash within {ledger.replay_window_s} s of that answer: it was lost"
                    )
    return problems


def assert_invariants(ledger: Ledger, problems: list[str]) -> None:
    """The ledger's own checks and `problems`, as one failure that shows a few of each kind."""
    kinds = {
        "what the clients were told": ledger.violations,
        "on disk, and the scenario's own": problems,
        "last_chunk_index over time": check_last_chunk_never_moves_back(ledger.observations),
        "replayed answers": check_replays(ledger),
    }
    broken = {kind: found for kind, found in kinds.items() if found}
    assert not broken, "invariants broken:\n" + "\n".join(
        f"- {kind} ({len(found)}):\n    " + "\n    ".join(found[:8]) for kind, found in broken.items()
    )
