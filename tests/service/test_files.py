"""OpenAI's Files API (`/v1/files`): driven by the real `openai` package against a proxy on a loopback port,
under both HTTP servers; hostile and refused uploads leave nothing in `<checkpoints_dir>/files`."""

from __future__ import annotations

import asyncio
import errno
import io
import logging
import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from app.service import models
from app.store.files import FileStore, FileWriter
from tests.servers import fake_upstream, serve_proxy
from tests.service.test_batches import put_file
from tests.service.test_checkpoint_routes import config

pytestmark = pytest.mark.usefixtures("http_server")

KEY = "sekrit"
BOUNDARY = "b0undary"


@pytest.fixture
async def proxy(tmp_path: Path) -> AsyncIterator[str]:
    async with fake_upstream() as (url, _), serve_proxy(config(tmp_path, url, api_key=KEY)) as served:
        yield served


def kept(tmp_path: Path) -> list[str]:
    """What the file store holds on disk."""
    return sorted(os.listdir(tmp_path / "ckpt" / "files"))


def sdk(proxy: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy + "/v1", api_key=KEY, max_retries=0)


def form(*parts: tuple[str, str | None, bytes], boundary: str = BOUNDARY, end: bool = True) -> bytes:
    """A multipart/form-data body of `(name, filename, content)` parts, as a client writes one."""
    body = b""
    for name, filename, content in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename is not None else "")
        body += f"--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + content + b"\r\n"
    return body + (f"--{boundary}--\r\n".encode() if end else b"")


MULTIPART = {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}", "Authorization": f"Bearer {KEY}"}
PURPOSE = ("purpose", None, b"batch")


async def upload(proxy: str, body: bytes | Iterator[bytes], headers: dict[str, str] | None = None) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as client:
        content: Any = body if isinstance(body, bytes) else _async(body)
        return await client.post(proxy + "/v1/files", content=content, headers=headers or MULTIPART)


async def _async(pieces: Iterator[bytes]) -> AsyncIterator[bytes]:
    for piece in pieces:
        yield piece


def one_line_error(answer: httpx.Response, status: int) -> str:
    assert answer.status_code == status, answer.text
    message = models.ErrorEnvelope.model_validate(answer.json()).error.message
    assert "\n" not in message
    return message


async def test_the_openai_sdk_uploads_lists_reads_and_deletes_files(proxy: str, tmp_path: Path) -> None:
    big = os.urandom(5 << 20) + b"\r\n--" + BOUNDARY.encode() + b"--\r\n\x00\xff"  # arbitrary bytes, a boundary too

    def scenario() -> None:
        client = sdk(proxy)
        first = client.files.create(file=("input.jsonl", io.BytesIO(b'{"custom_id": "a"}\n')), purpose="batch")
        assert (first.object, first.purpose, first.bytes, first.filename) == ("file", "batch", 19, "input.jsonl")
        assert first.status == "processed"
        assert first.id.startswith("file-")
        large = client.files.create(file=("big.bin", big), purpose="batch")
        empty = client.files.create(file=("empty.jsonl", b""), purpose="batch")
        assert (large.bytes, empty.bytes) == (len(big), 0)
        assert client.files.retrieve(large.id) == large

        assert client.files.content(large.id).content == big
        assert client.files.content(empty.id).content == b""
        assert client.files.content(first.id).content == b'{"custom_id": "a"}\n'

        newest_first = [f.id for f in client.files.list()]
        assert newest_first == [empty.id, large.id, first.id]
        assert [f.id for f in client.files.list(order="asc")] == newest_first[::-1]
        page = client.files.list(limit=2)
        assert [f.id for f in page.data] == newest_first[:2]
        assert page.has_more
        rest = client.files.list(limit=2, after=page.data[-1].id)
        assert ([f.id for f in rest.data], rest.has_more) == ([first.id], False)
        assert [f.id for f in client.files.list(limit=1)] == newest_first  # the SDK follows the pages itself
        assert [f.id for f in client.files.list(purpose="batch_output")] == []

        deleted = client.files.delete(large.id)
        assert (deleted.id, deleted.deleted) == (large.id, True)
        # the cursor of a deleted file still places the next page
        assert [f.id for f in client.files.list(after=large.id)] == [first.id]
        for gone in (
            lambda: client.files.retrieve(large.id),
            lambda: client.files.content(large.id),
            lambda: client.files.delete(large.id),
            lambda: client.files.retrieve("file-nope"),
        ):
            with pytest.raises(openai.NotFoundError, match="No such File object: file-"):
                gone()
        assert [f.id for f in client.files.list()] == [empty.id, first.id]

    await asyncio.to_thread(scenario)
    assert len(kept(tmp_path)) == 4  # two files, each its bytes and its metadata


@pytest.mark.parametrize(
    ("disposition", "stored"),
    [
        ("filename*=UTF-8''%C3%A9t%C3%A9.jsonl", "été.jsonl"),  # RFC 6266's form for a name beyond ASCII
        ("filename=\"ete.jsonl\"; filename*=UTF-8''%C3%A9t%C3%A9.jsonl", "été.jsonl"),  # it wins over filename
        ("filename*=ISO-8859-1'fr'%E9t%E9.jsonl", "été.jsonl"),
        ("filename=\"plain.jsonl\"; filename*=no-such-charset''x", "plain.jsonl"),  # one that does not decode
    ],
)
async def test_a_filename_given_as_filename_star_is_the_files_name(proxy: str, disposition: str, stored: str) -> None:
    body = (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; {disposition}\r\n\r\n{{}}\n\r\n'
        f"--{BOUNDARY}--\r\n"
    ).encode()
    answer = await upload(proxy, body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["filename"] == stored


async def test_every_file_route_needs_the_api_key(proxy: str) -> None:
    async with httpx.AsyncClient(base_url=proxy) as client:
        made = await client.post(
            "/v1/files",
            files={"file": ("a.jsonl", b"{}\n")},
            data={"purpose": "batch"},
            headers={"Authorization": f"Bearer {KEY}"},
        )
        file_id = made.json()["id"]
        for method, path in [
            ("POST", "/v1/files"),
            ("GET", "/v1/files"),
            ("GET", f"/v1/files/{file_id}"),
            ("GET", f"/v1/files/{file_id}/content"),
            ("DELETE", f"/v1/files/{file_id}"),
        ]:
            refused = await client.request(method, path)
            assert refused.status_code == 401, (method, path)
            wrong = await client.request(method, path, headers={"Authorization": "Bearer nope"})
            assert wrong.status_code == 401, (method, path)
        assert (await client.get(f"/v1/files/{file_id}", headers={"Authorization": f"Bearer {KEY}"})).status_code == 200


async def test_paths_under_v1_files_are_the_proxys_own_and_never_forwarded(tmp_path: Path) -> None:
    async with fake_upstream() as (url, upstream), serve_proxy(config(tmp_path, url)) as proxy:
        async with httpx.AsyncClient(base_url=proxy) as client:
            for method, path in [("GET", "/v1/files/x/y"), ("GET", "/v1/files/"), ("PUT", "/v1/files")]:
                answer = await client.request(method, path)
                assert answer.status_code in (404, 405), (method, path)
                assert "error" in answer.json()
            unknown = await client.get("/v1/files/file-0123")
            assert (
                one_line_error(unknown, 404)
                == "No such File object: file-0123 (GET /v1/files lists the files there are)"
            )
            assert (await client.get("/v1/files/x/content")).status_code == 404
        assert upstream.requests == 0, "a /v1/files path reached the upstream"


async def test_an_upload_past_max_file_bytes_is_413_and_nothing_of_it_is_kept(tmp_path: Path) -> None:
    settings = config(tmp_path, "http://127.0.0.1:9", api_key=KEY, max_file_bytes=1000, max_body_bytes=100)
    async with serve_proxy(settings) as proxy:
        fits = await upload(proxy, form(PURPOSE, ("file", "a.jsonl", b"x" * 1000)))
        assert fits.status_code == 200, fits.text  # max_body_bytes does not cap an upload
        assert len(kept(tmp_path)) == 2
        await asyncio.to_thread(sdk(proxy).files.delete, fits.json()["id"])
        declared = await upload(proxy, form(PURPOSE, ("file", "a.jsonl", b"x" * 1001)))  # with its Content-Length
        assert "max_file_bytes (1000 bytes)" in one_line_error(declared, 413)
        streamed = await upload(
            proxy, iter([form(PURPOSE, ("file", "a.jsonl", b"x" * 600), end=False)[:-2], b"y" * 600])
        )
        assert "nothing of it was kept" in one_line_error(streamed, 413)
        huge = await upload(proxy, form(PURPOSE, ("file", "a.jsonl", b"x" * (2 << 20))))  # past the form's overhead
        one_line_error(huge, 413)
    assert kept(tmp_path) == []


@pytest.mark.parametrize(
    ("headers", "body", "says"),
    [
        ({"Content-Type": "application/json"}, b"{}", "multipart/form-data"),
        ({}, form(PURPOSE, ("file", "a", b"x")), "multipart/form-data"),
        ({"Content-Type": "multipart/form-data"}, form(PURPOSE, ("file", "a", b"x")), "boundary"),
        ({"Content-Type": "multipart/form-data; boundary=" + "b" * 300}, b"", "boundary"),
        (MULTIPART, form(PURPOSE, ("file", "a", b"x"), boundary="other"), "not valid multipart"),
        (MULTIPART, form(PURPOSE, ("file", "a", b"x" * 5000))[:-40], "cut short"),
        (MULTIPART, form(PURPOSE, ("file", "a", b"x" * 5000), end=False), "cut short"),
        (MULTIPART, b"", "cut short"),
        (MULTIPART, form(PURPOSE, ("file", None, b"x")), "filename"),
        (MULTIPART, form(PURPOSE, ("file", "", b"x")), "filename"),
        (MULTIPART, form(PURPOSE, ("file", "a" * 2000, b"x")), "filename"),
        (MULTIPART, form(PURPOSE, ("upload", "a.jsonl", b"x")), "no `file` field"),
        (MULTIPART, form(("file", "a.jsonl", b"x")), "no `purpose`"),
        (MULTIPART, form(("purpose", None, b"fine-tune"), ("file", "a.jsonl", b"x")), "purpose must be batch"),
        (MULTIPART, form(("file", "a.jsonl", b"x" * 3_000_00), ("purpose", None, b"batch_output")), "purpose must be"),
        (MULTIPART, form(PURPOSE, ("file", "a", b"x"), ("file", "b", b"y")), "two `file` fields"),
        (MULTIPART, form(PURPOSE, PURPOSE, ("file", "a", b"x")), "two `purpose` fields"),
        (
            MULTIPART,
            form(
                PURPOSE,
                ("expires_after[anchor]", None, b"created_at"),
                ("expires_after[seconds]", None, b"1"),
                ("expires_after[seconds]", None, b"3600"),
                ("file", "a", b"x"),
            ),
            "two `expires_after[seconds]` fields",
        ),
        (MULTIPART, form(PURPOSE, ("notes", None, b"n" * 70_000), ("file", "a", b"x")), "fields but `file`"),
        (MULTIPART, f"--{BOUNDARY}\r\nX-Long: {'h' * 10_000}\r\n\r\n".encode(), "header size"),
        (MULTIPART, f"--{BOUNDARY}\r\n".encode() + b"X: y\r\n" * 50 + b"\r\n", "header count"),
        (MULTIPART, f"--{BOUNDARY}\r\nContent-Type: text/plain\r\n\r\nx\r\n--{BOUNDARY}--\r\n".encode(), "name="),
        (MULTIPART, b"\x00\xff" * 1000, "not valid multipart"),
    ],
)
async def test_a_malformed_or_refused_form_is_a_one_line_400_and_nothing_is_kept(
    proxy: str, tmp_path: Path, headers: dict[str, str], body: bytes, says: str
) -> None:
    answer = await upload(proxy, body, {"Authorization": f"Bearer {KEY}", **headers})
    assert says in one_line_error(answer, 400)
    assert kept(tmp_path) == []


PART_HEAD = f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"'.encode()


@pytest.mark.parametrize(
    ("body", "says"),
    [
        pytest.param(b"\x00\xff" * 1000, "not valid multipart", id="garbage"),
        pytest.param(PART_HEAD + b"\r\n\x01\x02junk\r\n\r\nbatch\r\n", "not valid multipart", id="garbage-header"),
        pytest.param(PART_HEAD + b"\rX\r\n\r\nbatch\r\n", "not valid multipart", id="header-without-crlf"),
        pytest.param(f"--{BOUNDARY}\r\n: x\r\n\r\n".encode(), "not valid multipart", id="header-without-name"),
        pytest.param(f"--{BOUNDARY}X".encode(), "not valid multipart", id="boundary-without-crlf"),
        pytest.param(f"--{BOUNDARY}\r\nX-Long: {'h' * 100_000}\r\n\r\n".encode(), "header size", id="huge-header"),
        pytest.param(form(PURPOSE, ("file", "a.jsonl", b"x" * 5000))[:-200], "cut short", id="truncated-part"),
        pytest.param(form(PURPOSE, ("file", "a.jsonl", b"x"), end=False), "cut short", id="no-closing-boundary"),
    ],
)
async def test_a_hostile_body_is_a_one_line_400_and_the_parser_logs_no_warning_for_it(
    proxy: str, tmp_path: Path, caplog: pytest.LogCaptureFixture, body: bytes, says: str
) -> None:
    caplog.set_level(logging.DEBUG)
    for _ in range(3):  # a client sending many: as many log lines would fill the log
        assert says in one_line_error(await upload(proxy, body), 400)
    assert kept(tmp_path) == []
    parser = [r for r in caplog.records if r.name.startswith("python_multipart")]
    assert [r.getMessage() for r in parser if r.levelno >= logging.WARNING] == []


async def test_a_client_that_leaves_mid_upload_leaves_nothing(proxy: str, tmp_path: Path) -> None:
    head = form(PURPOSE, ("file", "a.jsonl", b""), end=False)[:-2]
    port = int(proxy.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        f"POST /v1/files HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: {MULTIPART['Content-Type']}\r\nContent-Length: {len(head) + (10 << 20)}\r\n\r\n".encode()
        + head
        + b"z" * (3 << 20)
    )
    await writer.drain()
    files = tmp_path / "ckpt" / "files"
    for _ in range(1000):  # until the upload is being written
        if any(name.endswith(".part") for name in os.listdir(files)):
            break
        await asyncio.sleep(0.01)
    assert any(name.endswith(".part") for name in os.listdir(files))
    writer.transport.abort()  # the client is gone, 7 MiB short
    for _ in range(500):
        if not os.listdir(files):
            break
        await asyncio.sleep(0.01)
    assert kept(tmp_path) == []
    listed = await asyncio.to_thread(lambda: sdk(proxy).files.list().data)
    assert listed == []
    del reader


async def test_a_full_disk_is_507_and_a_read_only_one_503_and_nothing_is_kept(
    proxy: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    body = form(PURPOSE, ("file", "a.jsonl", b"x" * (3 << 20)))
    real_write = FileWriter.write

    def full(self: FileWriter, data: bytes) -> None:
        if self.size > 1 << 20:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(self, data)

    monkeypatch.setattr(FileWriter, "write", full)
    message = one_line_error(await upload(proxy, body), 507)
    assert "the checkpoints disk is full (No space left on device)" in message
    assert "free space under" in message
    assert kept(tmp_path) == []
    monkeypatch.undo()

    def read_only(self: FileStore, *args: Any, **kwargs: Any) -> FileWriter:
        raise OSError(errno.EROFS, "Read-only file system", str(self.root))

    monkeypatch.setattr(FileStore, "start", read_only)
    refused = await upload(proxy, body)
    assert "the checkpoints dir cannot be written (Read-only file system" in one_line_error(refused, 503)
    assert refused.headers["retry-after"] == "10"
    assert kept(tmp_path) == []


async def test_a_download_the_client_leaves_is_read_no_further(
    proxy: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="app.service.routes.files")
    size = 64 << 20
    file_id = put_file(tmp_path / "ckpt", [], raw=b"x" * size)
    path = str(tmp_path / "ckpt" / "files" / file_id)
    port = int(proxy.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET /v1/files/{file_id}/content HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode())
    got = b""
    while len(got) < 8192:
        piece = await reader.read(4096)
        assert piece, "the answer ended early"
        got += piece
    assert got.startswith(b"HTTP/1.1 200")
    writer.transport.abort()  # gone, having read 8 KiB of 64 MiB

    def said() -> list[str]:
        return [m for m in caplog.messages if m.startswith(f"{file_id}: the client left after")]

    deadline = time.monotonic() + 30
    while not said() or opened_by_this_process(path):
        assert time.monotonic() < deadline, f"still reading {path} after the client left ({said()})"
        await asyncio.sleep(0.01)
    read = int(said()[0].split(" after ")[1].split(" of ")[0])
    assert read < size // 2, said()


def opened_by_this_process(path: str) -> bool:
    fds = Path("/proc/self/fd")
    return any(os.path.realpath(fd) == path for fd in fds.iterdir() if fd.exists())
