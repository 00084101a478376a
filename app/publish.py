"""`ChunkPublisher`: the checkpoint service's output writer.

The service's documents are durable in the chunk's checkpoint file as soon
as they are acknowledged, so nothing is streamed to the output meanwhile
(`write` does nothing). When the checkpoint manager completes a chunk it
closes the chunk's output file, and that is when the publisher reads the
chunk file and publishes it as one file named by `output_filename`:

- locally: written under a temporary name in the target folder, fsynced,
  renamed over the final name, the folder fsynced: the file is whole or absent;
- to an fsspec URL (`s3://bucket/prefix`, ...): uploaded in one piece (one
  PUT on S3, which stores an object only once its whole body has arrived);
- `.gz` and `.zst` endings compress (zstd needs the `zstandard` package);
- documents marked `__no_rollouts_remove` are left out, a document id that
  repeats in the chunk file is published once, and a chunk with nothing
  left to publish produces no file.

Publishing is deterministic (same documents, same order, gzip without a
timestamp), so a chunk published again after a crash replaces the file
with the same bytes: never a second copy.

`check_output(output)` is `inferproxy serve`'s start-up check of the output,
run before anything is created: the filesystem package is installed, the
folder or bucket is there and answers. Credentials written into an output
URL are never shown: messages use `redact_url` and `scrub`.
"""

from __future__ import annotations

import asyncio
import gzip
import logging
import os
import threading
from string import Template
from typing import Any
from urllib.parse import parse_qsl, urlsplit, urlunsplit

import orjson

from app.documents import NO_ROLLOUTS_MARKER
from app.durable import atomic_write_bytes, read_jsonl_whole_lines

logger = logging.getLogger(__name__)

DEFAULT_OUTPUT_FILENAME = "${rank}_chunk_${chunk_index}.jsonl"
_ALLOWED_FIELDS = frozenset({"rank", "chunk_index"})
_S3_PROTOCOLS = frozenset({"s3", "s3a"})
# S3 takes up to 5 GiB in one PutObject; s3fs switches to a multipart upload
# at twice its chunksize (100 MiB by default): raise it so a chunk is one PUT.
_S3_SINGLE_PUT = {"chunksize": 5 * 2**30}


def check_output_filename(template: str) -> Template:
    """Only the integers rank and chunk_index become part of an output path, and both must:
    one proxy serves every rank, and two ranks' chunks must never share a name."""
    parsed = Template(template)
    fields = set(parsed.get_identifiers())
    if fields != _ALLOWED_FIELDS:
        raise ValueError(f"output_filename must use ${{rank}} and ${{chunk_index}} and nothing else, got {template!r}")
    if template.endswith(".zst"):
        try:
            import zstandard  # noqa: F401
        except ImportError:
            raise ValueError("output_filename ends with .zst: install the zstandard package") from None
    return parsed


class PublishError(RuntimeError):
    """A complete chunk could not be published; its documents stay checkpointed and it is retried."""


def is_remote(output: str) -> bool:
    return "://" in output and not output.startswith("file://")


class ChunkPublisher:
    def __init__(self, output: str, checkpoints_dir: str, output_filename: str = DEFAULT_OUTPUT_FILENAME) -> None:
        self.output = output.removeprefix("file://")
        self.checkpoints_dir = checkpoints_dir
        self.template = check_output_filename(output_filename)
        self.published: list[str] = []
        self._chunks: dict[str, tuple[int, int]] = {}
        self._fs: Any = None
        if is_remote(self.output):
            try:
                import fsspec
            except ImportError:
                raise ValueError(f"output {redact_url(output)} is a URL: {install_hint(output)}") from None
            self._fs, self._root = fsspec.core.url_to_fs(self.output)
            self._put_options = _S3_SINGLE_PUT if _protocols(output) & _S3_PROTOCOLS else {}

    # -- the DiskWriter surface CheckpointManager uses
    def write(self, document: Any, rank: int = 0, **kwargs: Any) -> None:
        """Nothing to do: the document is in the chunk's checkpoint file already."""

    def _get_output_filename(
        self, document: Any, rank: int | str = 0, chunk_index: int | None = None, **kwargs: Any
    ) -> str:
        assert chunk_index is not None
        name = self.template.substitute(rank=f"{int(rank):05d}", chunk_index=int(chunk_index))
        self._chunks[name] = (int(rank), int(chunk_index))
        return name

    def close_file(self, original_name: str) -> None:
        self._publish(original_name)

    async def close_file_async(self, original_name: str) -> None:
        """Publish off the event loop: reading, compressing and uploading a chunk takes a while."""
        try:
            await asyncio.to_thread(self._publish, original_name)
        except Exception as exc:
            raise PublishError(f"publishing {original_name} failed: {scrub(str(exc), self.output)}") from exc

    # -- publishing
    def _publish(self, name: str) -> None:
        rank, chunk_index = self._chunks[name]
        chunk_file = os.path.join(self.checkpoints_dir, f"{rank:05d}", f"chunk_{chunk_index:05d}.jsonl")
        data = self._render(chunk_file, name)
        if data is not None:
            if self._fs is not None:
                self._fs.pipe_file(f"{self._root.rstrip('/')}/{name}", data, **self._put_options)
            else:
                atomic_write_bytes(os.path.join(self.output, name), data)
            self.published.append(name)
        self._chunks.pop(name, None)

    def _render(self, chunk_file: str, name: str) -> bytes | None:
        try:
            records = read_jsonl_whole_lines(chunk_file)
        except FileNotFoundError:
            return None
        seen: set[str] = set()
        lines = []
        for record in records:
            if record["id"] in seen or NO_ROLLOUTS_MARKER in (record.get("metadata") or {}):
                continue
            seen.add(record["id"])
            # datatrove's JsonlWriter line: the document's non-empty fields
            lines.append(orjson.dumps({k: v for k, v in record.items() if v}, option=orjson.OPT_APPEND_NEWLINE))
        if not lines:
            return None
        data = b"".join(lines)
        if name.endswith(".gz"):
            return gzip.compress(data, mtime=0)
        if name.endswith(".zst"):
            import zstandard

            return bytes(zstandard.ZstdCompressor().compress(data))
        return data


# -- the start-up check


class OutputError(ValueError):
    """The output cannot take chunks; the message (one line) says what to fix."""


def check_output(output: str, *, timeout_s: float = 30.0) -> None:
    """Fail with an `OutputError` if `output` cannot take chunks, creating nothing.

    A folder: it, or the nearest folder above it that exists, must be a
    writable folder. A URL: its protocol must be known to fsspec and its
    package installed, and the location, or one above it (for S3, the
    bucket), must exist, all within `timeout_s`. Whether the credentials may
    write is only known at the first upload: nothing is written to find out.
    """
    if not is_remote(output):
        _check_folder(output.removeprefix("file://"))
        return
    shown = redact_url(output)
    try:
        import fsspec
    except ImportError:
        raise OutputError(f"--output {shown} is a URL: {install_hint(output)}") from None
    if _protocols(output) & _S3_PROTOCOLS and "@" in urlsplit(output).netloc:
        raise OutputError(
            f"--output {shown}: s3fs does not read credentials from the URL: set AWS_ACCESS_KEY_ID and "
            f"AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) instead, and give s3://bucket/prefix"
        )
    for protocol in sorted(_protocols(output)):
        try:
            fsspec.get_filesystem_class(protocol)
        except ValueError:
            raise OutputError(
                f"--output {shown}: unknown protocol {protocol!r}: give a folder or an fsspec URL "
                f"such as s3://bucket/prefix or gs://bucket/prefix"
            ) from None
        except ImportError:
            raise OutputError(f"--output {shown}: {install_hint(output)}") from None
    outcome: list[BaseException | None] = []

    def probe() -> None:
        try:
            fs, root = fsspec.core.url_to_fs(output)
            _check_location(fs, root, shown)
        except BaseException as exc:
            outcome.append(exc)
        else:
            outcome.append(None)

    # fsspec's clients retry for a while; a daemon thread cannot keep the process from exiting
    thread = threading.Thread(target=probe, name="check-output", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not outcome:
        raise OutputError(f"--output {shown} did not answer within {timeout_s:g} s: check the URL and the endpoint")
    error = outcome[0]
    if error is None:
        return
    if isinstance(error, OutputError):
        raise error
    reason = scrub(f"{type(error).__name__}: {error}".replace("\n", " "), output)
    if isinstance(error, PermissionError):
        # Credentials may be allowed to write under the prefix but not to look: let the first upload tell.
        logger.warning(
            "inferproxy serve: could not check --output %s, access denied (%s); starting anyway", shown, reason
        )
        return
    raise OutputError(f"--output {shown} cannot be reached ({reason}): check the URL, the endpoint and the credentials")


def _check_location(fs: Any, root: str, shown: str) -> None:
    """The output location, or the nearest one above it that exists, must be a folder (a bucket)."""
    path = root.rstrip("/")
    while path:
        try:
            info = fs.info(path)
        except FileNotFoundError:
            parent = fs._parent(path).rstrip("/")
            if parent == path:
                break
            path = parent
            continue
        if info.get("type") != "directory":
            raise OutputError(f"--output {shown}: {path} is a file, not a folder: choose another output")
        return
    top = root.strip("/").split("/", 1)[0]
    raise OutputError(
        f"--output {shown}: {top!r} does not exist (for an object store: no such bucket at this endpoint): "
        f"create it, or check the URL and the endpoint (AWS_ENDPOINT_URL_S3 for S3-compatible stores)"
    )


def _check_folder(path: str) -> None:
    """The folder, or the nearest one above it that exists (it is created later), must be writable."""
    here = os.path.abspath(path)
    while not os.path.exists(here):
        here = os.path.dirname(here)
    if not os.path.isdir(here):
        raise OutputError(f"--output {path}: {here} is a file, not a folder: choose another output")
    if not os.access(here, os.W_OK | os.X_OK):
        raise OutputError(f"--output {path}: {here} is not writable: choose another output or fix its permissions")


def _protocols(output: str) -> set[str]:
    """The protocols of an fsspec URL, chained ones (`simplecache::s3://...`) included."""
    head = output.split("://", 1)[0]
    return {part for part in head.split("::") if part}


def install_hint(output: str) -> str:
    """What to install for an output URL, as one instruction."""
    if _protocols(output) & _S3_PROTOCOLS:
        return "the S3 filesystem is not installed: pip install 'inferproxy[s3]'"
    try:
        from fsspec.registry import known_implementations
    except ImportError:
        return "fsspec is not installed: pip install 'inferproxy[fsspec]' and the filesystem's package"
    needs = [
        str(known_implementations[p].get("err", "")) for p in sorted(_protocols(output)) if p in known_implementations
    ]
    return f"pip install 'inferproxy[fsspec]'; {'; '.join(n for n in needs if n) or 'and the filesystem package'}"


def _secrets(url: str) -> list[str]:
    parts = urlsplit(url)
    found = [parts.password, parts.username] if "@" in parts.netloc else []
    found += [value for _, value in parse_qsl(parts.query)]
    return sorted((s for s in found if s), key=len, reverse=True)


def redact_url(url: str) -> str:
    """The URL without the credentials it may hold: `user:password@` and query values become `***`."""
    if "://" not in url:
        return url
    parts = urlsplit(url)
    netloc = "***@" + parts.netloc.rsplit("@", 1)[1] if "@" in parts.netloc else parts.netloc
    query = "&".join(f"{key}=***" for key, _ in parse_qsl(parts.query, keep_blank_values=True))
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def scrub(text: str, url: str) -> str:
    """`text` with every credential of `url` replaced by `***`."""
    for secret in _secrets(url):
        text = text.replace(secret, "***")
    return text
