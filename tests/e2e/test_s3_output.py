"""--output s3://...: inferproxy serve publishing to a local S3 server (moto), as real processes.

The S3 server is `tests/s3_server.py`: moto behind a recorder of every
request, so that the tests count the PUTs each object received, and able to
hold an upload before its body is read, so that a proxy can be killed with
its upload in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import httpx
import orjson
import pytest

from app.checkpoints.documents import DocumentLike
from app.checkpoints.publish import ChunkPublisher
from app.job.run import run_job
from tests.e2e.conftest import Upstream, start_proxy
from tests.ops.test_memory import thread_heaps
from tests.servers import free_port, process, wait_for_http

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).parents[2]
RECORDS_PER_CHUNK = 4
DOCS = [{"id": f"doc-{i}", "text": f"question {i}"} for i in range(10)]


def aws_env(endpoint: str) -> dict[str, str]:
    """What a user of an S3-compatible store sets: the endpoint and the keys, nothing in the URL."""
    return {
        "AWS_ENDPOINT_URL_S3": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        # nothing from this machine's own AWS set-up
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "AWS_EC2_METADATA_DISABLED": "true",
    }


@dataclass
class S3:
    endpoint: str
    bucket: str
    client: Any

    @property
    def env(self) -> dict[str, str]:
        return aws_env(self.endpoint)

    def url(self, prefix: str = "run") -> str:
        return f"s3://{self.bucket}/{prefix}"

    def objects(self) -> dict[str, bytes]:
        listed = self.client.list_objects_v2(Bucket=self.bucket).get("Contents", [])
        return {o["Key"]: self.client.get_object(Bucket=self.bucket, Key=o["Key"])["Body"].read() for o in listed}

    def etag(self, key: str) -> str:
        return str(self.client.head_object(Bucket=self.bucket, Key=key)["ETag"]).strip('"')

    def requests(self) -> list[dict[str, Any]]:
        """The S3 requests of this test's bucket, as the server received them."""
        every: list[dict[str, Any]] = httpx.get(self.endpoint + "/_test/requests").json()
        return [r for r in every if r["path"] == f"/{self.bucket}" or r["path"].startswith(f"/{self.bucket}/")]

    def puts(self, key: str) -> list[dict[str, Any]]:
        return [r for r in self.requests() if r["method"] == "PUT" and r["path"] == f"/{self.bucket}/{key}"]


@pytest.fixture(scope="module")
def s3_server() -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.s3_server", str(port)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        endpoint = f"http://127.0.0.1:{port}"
        wait_for_http(endpoint + "/_test/requests")
        yield endpoint
    finally:
        proc.kill()
        proc.wait(timeout=10)


@pytest.fixture
def s3(s3_server: str) -> Iterator[S3]:
    """A fresh bucket for the test on the shared server; uploads let through (and allowed) again at the end."""
    client = boto3.client(
        "s3",
        endpoint_url=s3_server,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )
    bucket = f"test-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    try:
        yield S3(s3_server, bucket, client)
    finally:
        httpx.post(s3_server + "/_test/release")
        httpx.post(s3_server + "/_test/allow")
        client.close()


def proxy_args(upstream: Upstream, tmp_path: Path, s3: S3) -> tuple[list[str], str]:
    args, port = start_proxy(upstream.url, tmp_path, f"--output={s3.url()}", f"--records-per-chunk={RECORDS_PER_CHUNK}")
    return args, f"http://127.0.0.1:{port}"


async def rollout(document: DocumentLike, rollout_idx: int, headers: dict[str, str], proxy: str) -> str:
    body = {"model": "fake-model", "messages": [{"role": "user", "content": document.id}], "max_tokens": 4}
    async with httpx.AsyncClient(base_url=proxy, timeout=30) as client:
        answer = await client.post("/v1/chat/completions", json=body, headers=headers)
    answer.raise_for_status()
    return str(answer.json()["choices"][0]["message"]["content"])


def job(proxy: str, documents: list[dict[str, Any]] = DOCS) -> Any:
    async def fn(document: DocumentLike, rollout_idx: int, headers: dict[str, str]) -> str:
        return await rollout(document, rollout_idx, headers, proxy)

    return asyncio.run(run_job(documents, fn, base_url=proxy, rollouts_per_document=2, concurrency=4))


def ids_by_file(objects: dict[str, bytes]) -> dict[str, list[str]]:
    """Each object's document ids, sorted: a job writes a chunk's documents as their generations finish,
    in whatever order that is (64 in flight)."""
    return {key: sorted(orjson.loads(line)["id"] for line in data.splitlines()) for key, data in objects.items()}


def test_every_chunk_lands_whole_with_one_put_and_a_rerun_uploads_nothing(
    upstream: Upstream, tmp_path: Path, s3: S3
) -> None:
    args, url = proxy_args(upstream, tmp_path, s3)
    with process(*args, env=s3.env):
        wait_for_http(url + "/healthz")
        report = job(url)
        assert (report.written, report.chunks) == (10, 3)
        again = job(url)
        assert (again.written, again.skipped) == (0, 10)

    objects = s3.objects()
    assert sorted(objects) == ["run/00000_chunk_0.jsonl", "run/00000_chunk_1.jsonl", "run/00000_chunk_2.jsonl"]
    published = [i for ids in ids_by_file(objects).values() for i in ids]
    assert sorted(published) == sorted(d["id"] for d in DOCS)
    for key, data in objects.items():
        # One request per object, and a single-part one: a multipart upload would show as a POST
        # (?uploads) and PUTs with ?partNumber, and give an ETag that is not the MD5 of the body.
        assert [r["query"] for r in s3.puts(key)] == [""]
        assert s3.etag(key) == hashlib.md5(data).hexdigest()
    assert not [r for r in s3.requests() if "upload" in r["query"].lower()]


def test_a_proxy_killed_mid_upload_leaves_no_partial_object_and_publishes_the_chunk_whole_after_restart(
    upstream: Upstream, tmp_path: Path, s3: S3
) -> None:
    # 4 documents of 6 MB: an upload far larger than the loopback socket buffers, so that the
    # killed proxy has not sent all of it; the server then gets a cut body, and S3 (moto too)
    # stores nothing of a PUT whose body did not arrive whole.
    big = [{"id": f"doc-{i}", "text": f"{i}" * 6_000_000} for i in range(RECORDS_PER_CHUNK)]
    key = "run/00000_chunk_0.jsonl"
    args, url = proxy_args(upstream, tmp_path, s3)
    with process(*args, env=s3.env) as proxy:
        wait_for_http(url + "/healthz")
        httpx.post(s3.endpoint + "/_test/hold")
        for document in big[:-1]:
            assert httpx.post(url + "/documents", json=document, headers={"X-Chunk-Index": "0"}, timeout=60).is_success
        # The last document completes the chunk: its answer waits for the upload, which the server holds.
        last = threading.Thread(target=post_ignoring_errors, args=(url + "/documents", big[-1]), daemon=True)
        last.start()
        wait_until(lambda: any(r["held"] for r in s3.puts(key)), "the upload of chunk 0 reached the server")
        proxy.kill()
        proxy.wait(timeout=10)
        httpx.post(s3.endpoint + "/_test/release")
        wait_until(lambda: "status" in s3.puts(key)[0], "the server answered the cut upload")
        last.join(timeout=30)
    before = s3.objects()
    assert before == {} or documents_of(before[key]) == big  # absent, or whole: never a part of it

    with process(*args, env=s3.env):
        wait_for_http(url + "/healthz")
        # the restarted proxy restores the rank on its first request, publishing the complete chunk first
        resume = httpx.get(url + "/resume", timeout=60).json()
        assert (resume["last_chunk_index"], resume["docs_to_skip"]) == (0, RECORDS_PER_CHUNK)
        assert list(s3.objects()) == [key]
        whole = s3.objects()[key]
        assert documents_of(whole) == big
        report = job(url, big + DOCS[RECORDS_PER_CHUNK:])
        assert (report.skipped, report.written, report.chunks) == (4, 6, 3)

    objects = s3.objects()
    assert objects[key] == whole
    assert ids_by_file(objects) == {
        key: ["doc-0", "doc-1", "doc-2", "doc-3"],
        "run/00000_chunk_1.jsonl": ["doc-4", "doc-5", "doc-6", "doc-7"],
        "run/00000_chunk_2.jsonl": ["doc-8", "doc-9"],
    }
    assert not [r for r in s3.requests() if "upload" in r["query"].lower()]


def test_a_rank_whose_checkpoints_are_lost_resumes_from_the_buckets_listing(
    upstream: Upstream, tmp_path: Path, s3: S3
) -> None:
    args, url = proxy_args(upstream, tmp_path, s3)
    with process(*args, env=s3.env):
        wait_for_http(url + "/healthz")
        assert job(url).chunks == 3
    # The node is lost with its disk: no checkpoint of any rank is left, the bucket is.
    shutil.rmtree(tmp_path / "checkpoints")
    s3.client.delete_object(Bucket=s3.bucket, Key="run/00000_chunk_2.jsonl")  # as if chunk 2 never got there
    with process(*args, env=s3.env):
        wait_for_http(url + "/healthz")
        resume = httpx.get(url + "/resume", timeout=60).json()
        assert (resume["last_chunk_index"], resume["docs_to_skip"]) == (1, 2 * RECORDS_PER_CHUNK)
        generated = upstream.stats()["generations"]
        report = job(url)
        assert (report.skipped, report.written) == (8, 2)
        assert upstream.stats()["generations"] - generated == 2 * 2  # chunk 2's documents, 2 rollouts each
    assert sorted(i for ids in ids_by_file(s3.objects()).values() for i in ids) == sorted(d["id"] for d in DOCS)


def documents_of(data: bytes) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in data.splitlines()]


def wait_until(condition: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.02)


def post_ignoring_errors(url: str, document: dict[str, Any]) -> None:
    with contextlib.suppress(httpx.HTTPError):  # the proxy is killed while this request waits for its upload
        httpx.post(url, json=document, headers={"X-Chunk-Index": "0"}, timeout=60)


def serve_fails(tmp_path: Path, output: str, env: dict[str, str], *, blocked: tuple[str, ...] = ()) -> str:
    """Run `inferproxy serve --output OUTPUT` to its end; it must fail at start in one line and create nothing."""
    block = "".join(f"sys.modules[{name!r}] = None; " for name in blocked)  # `import name` raises ImportError
    code = f"import sys; {block}from app.cli import main; sys.exit(main())"
    args = [f"--checkpoints-dir={tmp_path / 'checkpoints'}", f"--output={output}", f"--port={free_port()}"]
    done = subprocess.run(
        [sys.executable, "-c", code, "serve", *args],
        env={**os.environ, **env},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith("inferproxy serve: --output ")
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "a failed start created files"
    return done.stderr


@pytest.mark.parametrize("blocked", [("s3fs",), ("fsspec", "s3fs")])
def test_without_the_s3_extra_serve_fails_at_start_naming_it_and_creates_nothing(
    tmp_path: Path, blocked: tuple[str, ...]
) -> None:
    stderr = serve_fails(tmp_path, "s3://bucket/run", aws_env("http://127.0.0.1:9"), blocked=blocked)
    assert "pip install 'inferproxy[s3]'" in stderr


def test_an_unknown_protocol_fails_at_start_in_one_line(tmp_path: Path) -> None:
    assert "unknown protocol 'foo'" in serve_fails(tmp_path, "foo://bar", {})


def test_a_bucket_that_does_not_exist_fails_at_start_in_one_line(tmp_path: Path, s3: S3) -> None:
    stderr = serve_fails(tmp_path, "s3://no-such-bucket/run", s3.env)
    assert "'no-such-bucket' does not exist" in stderr
    requests = httpx.get(s3.endpoint + "/_test/requests").json()
    assert not [r for r in requests if r["path"].startswith("/no-such-bucket") and r["method"] in ("PUT", "POST")]


def test_an_unreachable_endpoint_fails_at_start_in_one_line(tmp_path: Path) -> None:
    stderr = serve_fails(tmp_path, "s3://bucket/run", aws_env(f"http://127.0.0.1:{free_port()}"))
    assert "cannot be reached (EndpointConnectionError" in stderr


@pytest.mark.parametrize(
    "output",
    ["s3://AKIAEXAMPLEKEY:wJalrXUtnSECRET@bucket/run", "ftp://bob:wJalrXUtnSECRET@127.0.0.1:{port}/out"],
)
def test_credentials_in_the_output_url_are_never_printed(tmp_path: Path, output: str) -> None:
    output = output.format(port=free_port())  # here, not in the test's id: every collection sees the same ids
    stderr = serve_fails(tmp_path, output, aws_env("http://127.0.0.1:9"))
    assert "wJalrXUtnSECRET" not in stderr
    assert "AKIAEXAMPLEKEY" not in stderr
    assert "***@" in stderr


def test_the_listing_for_a_lost_rank_sees_what_other_proxies_published_since_an_earlier_one(
    s3: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Proxies on several nodes share one output. s3fs keeps every listing it made, for good: a proxy
    # that had listed the prefix once (recovering one rank) recovered the next lost rank from that old
    # listing and missed every chunk published by the other proxies since, generating them again.
    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    s3.client.put_object(Bucket=s3.bucket, Key="run/00000_chunk_0.jsonl", Body=b'{"id":"a"}\n')
    publisher = ChunkPublisher(s3.url(), str(tmp_path / "checkpoints"))
    assert publisher.last_published_chunk(0) == 0
    s3.client.put_object(Bucket=s3.bucket, Key="run/00001_chunk_0.jsonl", Body=b'{"id":"b"}\n')  # another proxy
    assert publisher.last_published_chunk(1) == 0


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc arenas are glibc's")
def test_a_proxy_publishing_to_s3_keeps_to_one_heap_besides_the_main_one(
    upstream: Upstream, tmp_path: Path, s3: S3
) -> None:
    # serve capped the arenas after it had checked the s3:// output: fsspec's thread and the resolver's,
    # started by that check, had each made an arena of its own (3 thread heaps at start, measured).
    args, url = proxy_args(upstream, tmp_path, s3)
    with process(*args, env=s3.env) as served:
        wait_for_http(url + "/healthz")
        report = job(url)
        assert report.chunks == 3
        assert thread_heaps(served.pid) <= 1


def test_a_listing_that_lands_after_the_cache_was_cleared_never_hides_a_published_chunk(
    tmp_path: Path, s3: S3, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Under a /resume storm, one check of the output stored its listing (taken before a chunk's upload)
    # just after another check had cleared the cache: that check took the stale listing for the output,
    # and the chunk just published for "lost" (a 409 output_lost_error in the chaos suite).
    from app.checkpoints.publish import ChunkPublisher

    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    publisher = ChunkPublisher(s3.url(), str(tmp_path / "ckpt"))
    s3.client.put_object(Bucket=s3.bucket, Key="run/00000_chunk_0.jsonl", Body=b'{"id":"a","text":"a"}\n')
    fs, real = publisher._fs, publisher._fs.invalidate_cache

    def cleared_then_a_stale_listing_lands(path: str | None = None) -> None:
        real(path)
        fs.dircache[f"{s3.bucket}/run"] = []  # what a listing in flight since before the upload saw

    monkeypatch.setattr(fs, "invalidate_cache", cleared_then_a_stale_listing_lands)
    assert publisher.missing_chunks(0, 0) == []


def test_a_batchs_files_are_copied_whole_to_an_object_store_output_once_it_takes_them(
    upstream: Upstream, tmp_path: Path, s3: S3
) -> None:
    from tests.service.test_batches import CHAT, chat_line, put_file

    lines = [chat_line(f"q-{i}", f"question {i}") for i in range(20)]
    lines.append(chat_line("bad", "x", fake_upstream={"status": 400}))
    file_id = put_file(tmp_path / "checkpoints", lines)
    args, url = proxy_args(upstream, tmp_path, s3)
    with process(*args, env=s3.env):
        wait_for_http(url + "/healthz")
        httpx.post(s3.endpoint + "/_test/deny")  # S3 refuses uploads: the batch waits, finalizing
        batch_id = httpx.post(url + "/v1/batches", json={"input_file_id": file_id, "endpoint": CHAT}).json()["id"]
        deadline = time.monotonic() + 30
        while (batch := httpx.get(f"{url}/v1/batches/{batch_id}").json())["status"] != "finalizing":
            assert time.monotonic() < deadline, batch
            time.sleep(0.05)
        time.sleep(1.5)  # a retry or two, refused
        assert httpx.get(f"{url}/v1/batches/{batch_id}").json()["status"] == "finalizing"
        assert not [k for k in s3.objects() if k.startswith("run/batches/")]
        httpx.post(s3.endpoint + "/_test/allow")
        deadline = time.monotonic() + 30
        while (batch := httpx.get(f"{url}/v1/batches/{batch_id}").json())["status"] != "completed":
            assert time.monotonic() < deadline, batch
            time.sleep(0.1)
    objects = s3.objects()
    output = objects[f"run/batches/{batch_id}_output.jsonl"]
    errors = objects[f"run/batches/{batch_id}_error.jsonl"]
    assert output == (tmp_path / "checkpoints" / "files" / batch["output_file_id"]).read_bytes()
    assert errors == (tmp_path / "checkpoints" / "files" / batch["error_file_id"]).read_bytes()
    assert len(output.splitlines()) == 20
    assert len(errors.splitlines()) == 1
    assert len(s3.puts(f"run/batches/{batch_id}_output.jsonl")) >= 1
    assert not [r for r in s3.requests() if "uploads" in r["query"]], "a multipart upload was started"
