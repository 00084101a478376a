"""`check_output`: `inferproxy serve`'s start-up check of `--output`, before anything is created.

A missing filesystem package, an unknown protocol, a bucket that does not
exist or an endpoint that does not answer must stop the proxy with one line
saying what to fix, before the lifespan creates the checkpoints dir and its
lock file, rather than as a traceback at the first publication. Credentials
written into an output URL never appear in a message: `redact_url` and
`scrub`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qsl, urlsplit, urlunsplit

logger = logging.getLogger(__name__)

S3_PROTOCOLS = frozenset({"s3", "s3a"})


def is_remote(output: str) -> bool:
    """Whether `output` is a URL of a remote filesystem (s3://, gs://, ...) rather than a local folder."""
    return "://" in output and not output.startswith("file://")


class OutputError(ValueError):
    """The output cannot take chunks; the message (one line) says what to fix."""


def bounded(call: Callable[[], Any], timeout_s: float, *, name: str) -> tuple[Any, BaseException | None] | None:
    """`call()` in a daemon thread, waited for up to `timeout_s`: `(its result, None)`, `(None, what it raised)`,
    or None if it had not ended by then. For an object store's first look: fsspec's clients retry for a while,
    and a daemon thread cannot keep the process from exiting."""
    outcome: list[tuple[Any, BaseException | None]] = []

    def run() -> None:
        try:
            outcome.append((call(), None))
        except BaseException as exc:
            outcome.append((None, exc))

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return outcome[0] if outcome else None


def check_output(output: str, *, timeout_s: float = 30.0, name: str = "--output") -> None:
    """Fail with an `OutputError` if `output` cannot take chunks, leaving nothing behind.

    A folder: it, or the nearest folder above it that exists, must be a
    folder that takes a new file (one is created and removed). A URL: its protocol must be known to fsspec and its
    package installed, and the location, or one above it (for S3, the
    bucket), must exist, all within `timeout_s`. Whether the credentials may
    write is only known at the first upload: nothing is written to find out. The messages call the
    setting `name`: where its value was given (the flag, the variable, the config file's key).
    """
    if not is_remote(output):
        _check_folder(output.removeprefix("file://"), name)
        return
    shown = redact_url(output)
    try:
        import fsspec
    except ImportError:
        raise OutputError(f"{name} {shown} is a URL: {install_hint(output)}") from None
    if protocols(output) & S3_PROTOCOLS and "@" in urlsplit(output).netloc:
        raise OutputError(
            f"{name} {shown}: s3fs does not read credentials from the URL: set AWS_ACCESS_KEY_ID and "
            f"AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) instead, and give s3://bucket/prefix"
        )
    for protocol in sorted(protocols(output)):
        try:
            fsspec.get_filesystem_class(protocol)
        except ValueError:
            raise OutputError(
                f"{name} {shown}: unknown protocol {protocol!r}: give a folder or an fsspec URL "
                f"such as s3://bucket/prefix or gs://bucket/prefix"
            ) from None
        except ImportError:
            raise OutputError(f"{name} {shown}: {install_hint(output)}") from None

    def probe() -> None:
        fs, root = fsspec.core.url_to_fs(output)
        _check_location(fs, root, f"{name} {shown}")

    outcome = bounded(probe, timeout_s, name="check-output")
    if outcome is None:
        raise OutputError(f"{name} {shown} did not answer within {timeout_s:g} s: check the URL and the endpoint")
    error = outcome[1]
    if error is None:
        return
    if isinstance(error, OutputError):
        raise error
    reason = scrub(f"{type(error).__name__}: {error}".replace("\n", " "), output)
    if isinstance(error, PermissionError):
        # Credentials may be allowed to write under the prefix but not to look: let the first upload tell.
        logger.warning(
            "inferproxy serve: could not check %s %s, access denied (%s); starting anyway", name, shown, reason
        )
        return
    raise OutputError(f"{name} {shown} cannot be reached ({reason}): check the URL, the endpoint and the credentials")


def _check_location(fs: Any, root: str, shown: str) -> None:
    """The output location, or the nearest one above it that exists, must be a folder (a bucket); `shown`
    is the setting and the URL, as the messages name them."""
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
            raise OutputError(f"{shown}: {path} is a file, not a folder: choose another output")
        return
    top = root.strip("/").split("/", 1)[0]
    raise OutputError(
        f"{shown}: {top!r} does not exist (for an object store: no such bucket at this endpoint): "
        f"create it, or check the URL and the endpoint (AWS_ENDPOINT_URL_S3 for S3-compatible stores)"
    )


def _check_folder(path: str, name: str) -> None:
    try:
        check_folder(path, name)
    except FolderError as exc:
        raise OutputError(str(exc)) from None


class FolderError(ValueError):
    """A folder given to `inferproxy serve` cannot take its files; the message (one line) says what to fix."""


#: What `check_folder(room=True)` writes to find out whether the disk has room: a few of a chunk file's pages.
ROOM_PROBE_BYTES = 64 * 1024


def check_folder(path: str, flag: str, *, room: bool = False) -> None:
    """The folder, or the nearest one above it that exists (it is created later), must take a new file,
    and with `room`, `ROOM_PROBE_BYTES` of it; a `FolderError` naming `flag` says otherwise. Nothing is
    left behind.

    A file is created there and removed, rather than asking `os.access`: that
    says yes to root whatever the folder, and knows nothing of what refuses
    a file all the same (sysfs and other special filesystems, a full disk or
    quota, NFS mapping root to nobody, security modules).
    """
    here = os.path.abspath(path)
    while not os.path.exists(here):
        here = os.path.dirname(here)
    if not os.path.isdir(here):
        raise FolderError(f"{flag} {path}: {here} is a file, not a folder: choose another folder")
    # A leftover (a kill between the calls) is a dot file ending in .tmp: never taken for a chunk.
    probe = os.path.join(here, f".inferproxy-write-check.{secrets.token_hex(6)}.tmp")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno == errno.EROFS:  # no permission makes it writable: saying which would mislead
            raise FolderError(
                f"{flag} {path}: the filesystem is mounted read-only ({here}: {exc.strerror}): choose a folder "
                f"on a writable filesystem, or remount it read-write"
            ) from None
        raise FolderError(
            f"{flag} {path}: cannot create a file in {here} ({exc.strerror}): user {_user()} needs write and "
            f"execute permission on it (and a writable filesystem); fix that, or choose another folder"
        ) from None
    try:
        if room:
            os.write(fd, bytes(ROOM_PROBE_BYTES))
            os.fsync(fd)
    except OSError as exc:
        raise FolderError(
            f"{flag} {path}: {here} has no room for a file ({exc.strerror}): free some space on its disk, "
            f"or choose another folder"
        ) from None
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(probe)


def _user() -> str:
    """The name this process writes files as (its uid where it has none)."""
    uid = os.geteuid()
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def protocols(output: str) -> set[str]:
    """The protocols of an fsspec URL, chained ones (`simplecache::s3://...`) included."""
    head = output.split("://", 1)[0]
    return {part for part in head.split("::") if part}


def install_hint(output: str) -> str:
    """What to install for an output URL, as one instruction."""
    if protocols(output) & S3_PROTOCOLS:
        return "the S3 filesystem is not installed: pip install 'inferproxy[s3]' (from a clone: pip install -e '.[s3]')"
    try:
        from fsspec.registry import known_implementations
    except ImportError:
        return "fsspec is not installed: pip install 'inferproxy[fsspec]' and the filesystem's package"
    needs = [
        str(known_implementations[p].get("err", "")) for p in sorted(protocols(output)) if p in known_implementations
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
