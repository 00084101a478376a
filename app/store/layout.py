"""Where everything of a checkpoints dir lives: the one place that formats its paths.

    <root>/checkpoint_meta.json              records_per_chunk, for the resume check
    <root>/<rank:05d>/chunk_<i:05d>.jsonl    a rank's unfinished chunks, one document per line
    <root>/<rank:05d>/replay.sqlite3         a rank's RequestCache
    <root>/last_chunk/<rank:05d>.txt         a rank's last_chunk_index
    <root>/owners/<rank:05d>.lock            which proxy owns the rank (flock'ed; never deleted)
    <root>/empty_chunks/<rank:05d>.txt       chunks published as no file (every document removed)
    <root>/files/                            the Batch API's files (`app.store.files`)
    <root>/batches/                          the Batch API's batches, their state and answers

The first four are datatrove's layout, file for file; `owners/`,
`empty_chunks/`, `files/` and `batches/` are inferproxy's own and datatrove ignores them. A published chunk's name comes
from the output filename template, `${rank}` (zero-padded to five digits,
as datatrove's writers pad it) and `${chunk_index}`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from string import Template

META_FILENAME = "checkpoint_meta.json"
CACHE_FILENAME = "replay.sqlite3"
DEFAULT_OUTPUT_FILENAME = "${rank}_chunk_${chunk_index}.jsonl"
_CHUNK_FILE = re.compile(r"^chunk_(\d+)\.jsonl$")
_RANK_NAME = re.compile(r"^\d{5}$")


def rank_name(rank: int | str) -> str:
    """A rank as it appears in every path: five digits, as datatrove pads it."""
    return str(rank).zfill(5)


@dataclass(frozen=True, slots=True)
class RankPaths:
    """Every path of one rank in a checkpoints dir."""

    root: str
    rank: int

    @property
    def name(self) -> str:
        return rank_name(self.rank)

    @property
    def rank_dir(self) -> str:
        return os.path.join(self.root, self.name)

    @property
    def cache_file(self) -> str:
        return os.path.join(self.rank_dir, CACHE_FILENAME)

    @property
    def last_chunk_file(self) -> str:
        return os.path.join(self.root, "last_chunk", f"{self.name}.txt")

    @property
    def empty_chunks_file(self) -> str:
        """The chunks of the rank published as nothing (no file in the output), one index a line: so that
        a check of the output against `last_chunk` does not take them for lost."""
        return os.path.join(self.root, "empty_chunks", f"{self.name}.txt")

    @property
    def owner_file(self) -> str:
        return os.path.join(self.root, "owners", f"{self.name}.lock")

    @property
    def folders(self) -> tuple[str, str, str]:
        """The folders holding the rank's files: its own, `last_chunk/` and `owners/`."""
        return self.rank_dir, os.path.dirname(self.last_chunk_file), os.path.dirname(self.owner_file)

    def chunk_file(self, chunk_index: int) -> str:
        return os.path.join(self.rank_dir, f"chunk_{chunk_index:05d}.jsonl")

    def chunk_files(self) -> list[tuple[int, str]]:
        """`(chunk_index, path)` of every chunk file in the rank dir, by chunk index."""
        try:
            names = os.listdir(self.rank_dir)
        except FileNotFoundError:
            return []
        found = []
        for name in names:
            match = _CHUNK_FILE.match(name)
            if match:
                found.append((int(match.group(1)), os.path.join(self.rank_dir, name)))
        return sorted(found)

    def has_working_files(self) -> bool:
        return os.path.isdir(self.rank_dir)

    def has_checkpoints(self) -> bool:
        """Whether any checkpoint of this rank is on disk: a chunk file or its last_chunk file.

        A rank dir holding only the request cache does not count: opening the cache (a generation
        request) creates it, and the rank's checkpoints may still be lost.
        """
        return os.path.exists(self.last_chunk_file) or bool(self.chunk_files())


@dataclass(frozen=True, slots=True)
class CheckpointsLayout:
    """A checkpoints dir."""

    root: str

    def rank(self, rank: int) -> RankPaths:
        return RankPaths(self.root, rank)

    @property
    def meta_file(self) -> str:
        return os.path.join(self.root, META_FILENAME)

    @property
    def files_dir(self) -> str:
        return os.path.join(self.root, "files")

    @property
    def batches_dir(self) -> str:
        return os.path.join(self.root, "batches")

    def known_ranks(self, unlisted: list[OSError] | None = None) -> list[int]:
        """Ranks with anything in the checkpoints dir: a rank folder (or anything named as one), a last_chunk
        file or an owner lock file; `last_chunk/` and `owners/` are not listed where they are links. A folder
        that cannot be listed (its permissions) names no rank: why goes to `unlisted`, raised without it."""
        ranks = {int(name) for name in _names(self.root, unlisted) if _RANK_NAME.match(name)}
        for folder, suffix in (("last_chunk", ".txt"), ("owners", ".lock")):
            path = os.path.join(self.root, folder)
            ranks.update(
                int(name.removesuffix(suffix))
                for name in ([] if os.path.islink(path) else _names(path, unlisted))
                if name.endswith(suffix) and _RANK_NAME.match(name.removesuffix(suffix))
            )
        return sorted(ranks)


def _names(directory: str, unlisted: list[OSError] | None) -> list[str]:
    try:
        return os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as exc:
        if unlisted is None:
            raise
        unlisted.append(exc)
        return []


class OutputNames:
    """The names of published chunks, from an output filename template with `${rank}` and `${chunk_index}`."""

    def __init__(self, template: str = DEFAULT_OUTPUT_FILENAME) -> None:
        self.template = Template(template)

    def name(self, rank: int | str, chunk_index: int) -> str:
        return self.template.substitute(rank=rank_name(rank), chunk_index=int(chunk_index))

    def pattern(self, rank: int) -> re.Pattern[str]:
        """Matches the names of `rank`'s chunks; group 1 is the chunk index."""
        marker = "\x00"
        text = self.template.template.replace("${chunk_index}", marker).replace("$chunk_index", marker)
        text = Template(text).substitute(rank=rank_name(rank))
        return re.compile("^" + "(\\d+)".join(re.escape(part) for part in text.split(marker)) + "$")
