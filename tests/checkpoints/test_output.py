"""app.checkpoints.output: the start-up check of --output, and credentials kept out of messages."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from app.checkpoints.output import FolderError, OutputError, check_folder, check_output, redact_url, scrub
from tests.faults import fill_disk, small_disk
from tests.servers import run_cli, serve_once


class _BlockedFS(MemoryFileSystem):
    """A filesystem whose every look-up waits for `release`, or is denied."""

    protocol = "blockedfs"
    release = threading.Event()
    deny = False

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        if self.deny:
            raise PermissionError("Access Denied")
        self.release.wait()
        return {"name": path, "type": "directory", "size": 0}


@pytest.fixture
def blocked_fs() -> Iterator[type[_BlockedFS]]:
    fsspec.register_implementation("blockedfs", _BlockedFS, clobber=True)
    _BlockedFS.release.clear()
    _BlockedFS.deny = False
    yield _BlockedFS
    _BlockedFS.release.set()  # let the check's thread finish


@pytest.fixture
def memory() -> Iterator[MemoryFileSystem]:
    fs = MemoryFileSystem()
    fs.store.clear()
    fs.pseudo_dirs.clear()
    fs.pseudo_dirs.append("")
    yield fs
    fs.store.clear()


def test_a_local_output_that_does_not_exist_yet_passes_and_is_not_created(tmp_path: Path) -> None:
    check_output(str(tmp_path / "a" / "b" / "out"))
    assert list(tmp_path.iterdir()) == []


def test_a_local_output_under_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputError, match=r"file is a file, not a folder"):
        check_output(str(tmp_path / "file" / "out"))


def test_a_local_output_where_no_file_can_be_created_is_refused_naming_the_folder_and_why() -> None:
    # sysfs takes no new file, even from root, whom os.access lets write anywhere (tests run as root).
    with pytest.raises(
        OutputError,
        match=r"^--output /sys/out: cannot create a file in /sys \((Permission denied|Read-only file system)\)",
    ):
        check_output("/sys/out")


def test_a_local_output_check_leaves_no_file_in_an_existing_folder(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    check_output(str(tmp_path / "out"))
    assert list((tmp_path / "out").iterdir()) == []


@pytest.mark.parametrize("under", ["/sys", "file"])
def test_serve_refuses_an_output_that_takes_no_file_in_one_line_and_creates_nothing(tmp_path: Path, under: str) -> None:
    (tmp_path / "file").write_text("x")
    output = f"{under if under.startswith('/') else tmp_path / under}/out"
    done = serve_once(tmp_path / "ckpt", output)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1
    assert done.stderr.startswith(f"inferproxy serve: --output {output}: ")
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("under", ["/sys", "file"])
def test_serve_refuses_a_checkpoints_dir_that_takes_no_file_in_one_line_and_creates_nothing(
    tmp_path: Path, under: str
) -> None:
    (tmp_path / "file").write_text("x")
    checkpoints = f"{under if under.startswith('/') else tmp_path / under}/ckpt"
    done = serve_once(checkpoints, tmp_path / "out")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"inferproxy serve: --checkpoints-dir {checkpoints}: ")
    assert ("needs write and execute permission" if under == "/sys" else "is a file, not a folder") in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # neither the output nor a probe


def test_serve_refuses_a_checkpoints_dir_on_a_full_disk_in_one_line_and_leaves_nothing(tmp_path: Path) -> None:
    with small_disk(tmp_path / "disk") as disk:
        fill_disk(disk)
        before = sorted(p.name for p in disk.iterdir())
        done = serve_once(disk / "ckpt", tmp_path / "out")
        assert done.returncode == 2
        assert done.stderr.count("\n") == 1, done.stderr
        assert done.stderr.startswith(f"inferproxy serve: --checkpoints-dir {disk / 'ckpt'}: {disk} has no room")
        assert "free some space" in done.stderr
        assert sorted(p.name for p in disk.iterdir()) == before


@pytest.mark.parametrize("flag", ["--checkpoints-dir", "--output"])
def test_serve_refuses_a_folder_on_a_read_only_filesystem_saying_so_not_blaming_permissions(
    tmp_path: Path, flag: str
) -> None:
    with small_disk(tmp_path / "ro", read_only=True) as disk:
        folders = {"--checkpoints-dir": tmp_path / "ckpt", "--output": tmp_path / "out"}
        folders[flag] = disk / "x"
        done = serve_once(folders["--checkpoints-dir"], folders["--output"])
        assert done.returncode == 2, done.stderr
        assert done.stderr == (
            f"inferproxy serve: {flag} {disk / 'x'}: the filesystem is mounted read-only ({disk}: Read-only file "
            f"system): choose a folder on a writable filesystem, or remount it read-write\n"
        )
        assert list(disk.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ro"]  # neither the other folder nor a probe


def test_a_folder_check_names_the_user_that_needs_the_permission() -> None:
    with pytest.raises(FolderError, match=r"^--x /sys/y: cannot create a file in /sys \(.*\): user \S+ \(uid \d+\)"):
        check_folder("/sys/y", "--x")


@pytest.mark.parametrize(
    ("variable", "value", "said"),
    [
        ("INFERPROXY_OUTPUT", "foo://bar", "INFERPROXY_OUTPUT foo://bar: unknown protocol 'foo'"),
        ("INFERPROXY_CHECKPOINTS_DIR", "/proc/nope", "INFERPROXY_CHECKPOINTS_DIR /proc/nope: "),
    ],
)
def test_a_folder_refused_at_start_is_named_by_the_variable_that_gave_it(
    tmp_path: Path, variable: str, value: str, said: str
) -> None:
    folders = {"INFERPROXY_OUTPUT": str(tmp_path / "output"), "INFERPROXY_CHECKPOINTS_DIR": str(tmp_path / "c")}
    done = run_cli("serve", "--upstream=http://127.0.0.1:9", "--port=0", env={**os.environ, **folders, variable: value})
    assert done.returncode == 2
    assert done.stderr.startswith(f"inferproxy serve: {said}"), done.stderr
    assert len(done.stderr.splitlines()) == 1


def test_the_replicas_example_config_without_s3fs_ends_in_one_line_naming_what_to_install() -> None:
    # configs/replicas.toml publishes to s3://; s3fs is hidden from the process as if it were not installed.
    without_s3fs = "import sys; sys.modules['s3fs'] = None; from app.cli import main; sys.exit(main(sys.argv[1:]))"
    # The file's output, not the tests' default one (tests/conftest.py): the environment would win.
    env = {name: value for name, value in os.environ.items() if name != "INFERPROXY_OUTPUT"}
    done = subprocess.run(
        [sys.executable, "-c", without_s3fs, "serve", "--config", "configs/replicas.toml"],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (
        # named as the file's key: where the value was written, and is to be changed
        "inferproxy serve: configs/replicas.toml: output s3://my-bucket/synthetic-data: the S3 filesystem is not "
        "installed: "
        "pip install 'inferproxy[s3]' (from a clone: pip install -e '.[s3]')\n"
    )


def test_an_unknown_protocol_is_refused_naming_it() -> None:
    with pytest.raises(OutputError, match=r"--output foo://bar: unknown protocol 'foo'"):
        check_output("foo://bar")


def test_a_protocol_whose_package_is_missing_names_what_to_install() -> None:
    with pytest.raises(OutputError, match=r"pip install 'inferproxy\[fsspec\]'; .*gcsfs"):
        check_output("gs://bucket/run")  # gcsfs is not a dev dependency


def test_an_existing_bucket_passes_and_a_missing_one_is_refused(memory: MemoryFileSystem) -> None:
    memory.mkdir("/bucket")
    check_output("memory://bucket/run/1")
    with pytest.raises(OutputError, match=r"'other' does not exist .*create it"):
        check_output("memory://other/run")


def test_an_output_that_is_an_object_is_refused(memory: MemoryFileSystem) -> None:
    memory.pipe("/bucket/run", b"x")
    with pytest.raises(OutputError, match=r"/bucket/run is a file, not a folder"):
        check_output("memory://bucket/run")


def test_an_output_that_does_not_answer_is_refused_after_the_timeout(blocked_fs: type[_BlockedFS]) -> None:
    with pytest.raises(OutputError, match=r"blockedfs://bucket/run did not answer within 0.05 s"):
        check_output("blockedfs://bucket/run", timeout_s=0.05)


def test_an_output_that_denies_looking_is_a_warning_not_a_failure(
    blocked_fs: type[_BlockedFS], caplog: pytest.LogCaptureFixture
) -> None:
    blocked_fs.deny = True
    with caplog.at_level(logging.WARNING, logger="app.checkpoints.output"):
        check_output("blockedfs://bucket/run")
    assert "access denied (PermissionError: Access Denied); starting anyway" in caplog.text


def test_credentials_in_an_s3_url_are_refused_without_being_shown() -> None:
    with pytest.raises(OutputError) as caught:
        check_output("s3://AKIAEXAMPLE:wJalrXUtnFEMI@bucket/run")
    assert "AKIAEXAMPLE" not in str(caught.value)
    assert "wJalrXUtnFEMI" not in str(caught.value)
    assert "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in str(caught.value)


def test_redact_url_hides_the_user_the_password_and_query_values() -> None:
    assert redact_url("ftp://bob:hunter22@host:21/out?token=abc123&x=1") == "ftp://***@host:21/out?token=***&x=***"
    assert redact_url("s3://bucket/prefix") == "s3://bucket/prefix"
    assert redact_url("relative/folder") == "relative/folder"
    assert scrub("login hunter22 failed for bob", "ftp://bob:hunter22@host/") == "login *** failed for ***"


@pytest.mark.parametrize("flag", ["--checkpoints-dir", "--output"])
def test_serve_as_a_user_without_roots_capabilities_refuses_a_read_only_folder_naming_the_user(
    tmp_path: Path, flag: str
) -> None:
    # Mode 555 stops only a process without CAP_DAC_OVERRIDE: as root, the test drops every capability.
    without_capabilities = ["setpriv", "--bounding-set=-all", "--inh-caps=-all"] if os.geteuid() == 0 else []
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro").chmod(0o555)
    folders = {"--checkpoints-dir": tmp_path / "ckpt", "--output": tmp_path / "out"}
    folders[flag] = tmp_path / "ro" / "x"
    try:
        done = subprocess.run(
            [
                *without_capabilities,
                *(sys.executable, "-m", "app.cli", "serve", "--upstream=http://127.0.0.1:9", "--port=0"),
                *(f"{name}={path}" for name, path in folders.items()),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        (tmp_path / "ro").chmod(0o755)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"inferproxy serve: {flag} {tmp_path / 'ro' / 'x'}: cannot create a file in ")
    assert "(Permission denied)" in done.stderr
    if flag == "--checkpoints-dir":
        assert "needs write and execute permission on it" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ro"]
    assert list((tmp_path / "ro").iterdir()) == []
