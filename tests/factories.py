"""Plain-function factories for documents, writers and managers used across the tests."""

from __future__ import annotations

import json
import os
import stat
from collections import defaultdict
from typing import Any

from app.checkpoints.manager import CheckpointManager, Document, RequestCache


def document(doc_id: str | int, text: str | None = None, **metadata: Any) -> Document:
    return Document(text=f"text of {doc_id}" if text is None else text, id=str(doc_id), metadata=dict(metadata))


def documents(n: int, start: int = 0) -> list[Document]:
    return [document(i) for i in range(start, start + n)]


class RecordingWriter:
    """An output writer with datatrove's DiskWriter surface that remembers every call.

    Like datatrove's JsonlWriter, a write to a file name that was closed starts that file afresh.
    """

    def __init__(self) -> None:
        self.writes: list[tuple[str, int, int | None]] = []
        self.closed: list[str] = []
        self.files: dict[str, list[str]] = defaultdict(list)
        self._open: set[str] = set()

    def write(self, document: Any, rank: int = 0, **kwargs: Any) -> None:
        chunk_index = kwargs.get("chunk_index")
        name = self._get_output_filename(document, rank, chunk_index=chunk_index)
        if name not in self._open:
            self.files[name] = []  # reopened in "wt" mode: truncated
            self._open.add(name)
        self.files[name].append(document.id)
        self.writes.append((document.id, rank, chunk_index))

    def close_file(self, original_name: str) -> None:
        self._open.discard(original_name)
        self.closed.append(original_name)

    def _get_output_filename(
        self, document: Any, rank: int | str = 0, chunk_index: int | None = None, **kwargs: Any
    ) -> str:
        return f"{int(rank):05d}_chunk_{chunk_index}.jsonl"


def manager(path: str | os.PathLike[str], records_per_chunk: int = 3, **kwargs: Any) -> CheckpointManager:
    return CheckpointManager(str(path), records_per_chunk=records_per_chunk, **kwargs)


async def open_cache(path: str | os.PathLike[str], rank: int = 0) -> RequestCache:
    cache = RequestCache(str(path))
    await cache.initialize(rank)
    return cache


def chunk_path(root: str | os.PathLike[str], chunk_index: int, rank: int = 0) -> str:
    return os.path.join(root, f"{rank:05d}", f"chunk_{chunk_index:05d}.jsonl")


def last_chunk_path(root: str | os.PathLike[str], rank: int = 0) -> str:
    return os.path.join(root, "last_chunk", f"{rank:05d}.txt")


def chunk_ids(root: str | os.PathLike[str], chunk_index: int, rank: int = 0) -> list[str]:
    with open(chunk_path(root, chunk_index, rank)) as f:
        return [json.loads(line)["id"] for line in f if line.strip()]


def write_chunk_file(root: str | os.PathLike[str], chunk_index: int, ids: list[str], rank: int = 0) -> str:
    """A chunk file as datatrove writes it, one document per line."""
    path = chunk_path(root, chunk_index, rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "ab") as f:
        for doc_id in ids:
            f.write(json.dumps({"text": f"text of {doc_id}", "id": doc_id, "media": [], "metadata": {}}).encode())
            f.write(b"\n")
    return path


def chat_request(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "fake-model", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
    body.update(overrides)
    return body


def completion_request(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "fake-model", "prompt": "Once upon a time", "max_tokens": 8}
    body.update(overrides)
    return body


def doc_headers(doc_id: str = "doc-1", rollout_idx: int = 0, **extra: str) -> dict[str, str]:
    return {"X-Doc-Id": doc_id, "X-Rollout-Idx": str(rollout_idx), **extra}


def dir_snapshot(root: str | os.PathLike[str]) -> dict[str, tuple[int, int, bytes | None]]:
    """Every entry under `root`: `(size, mtime_ns, bytes)` of each file, `(0, mtime_ns, None)` of each folder
    (whose mtime moves when a name is created in it, even if it is removed again), and of a link or a
    special file `(mode, mtime_ns, its target or None)`: neither followed nor opened."""
    entries: dict[str, tuple[int, int, bytes | None]] = {}
    for folder, folders, files in os.walk(root):
        entries[folder] = (0, os.stat(folder).st_mtime_ns, None)
        for name in files + folders:
            path = os.path.join(folder, name)
            info = os.lstat(path)
            if stat.S_ISREG(info.st_mode):
                with open(path, "rb") as f:
                    entries[path] = (info.st_size, info.st_mtime_ns, f.read())
            elif not stat.S_ISDIR(info.st_mode):
                target = os.fsencode(os.readlink(path)) if stat.S_ISLNK(info.st_mode) else None
                entries[path] = (info.st_mode, info.st_mtime_ns, target)
    return entries
