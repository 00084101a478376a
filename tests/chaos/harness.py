"""The chaos suite's moving parts: `inferproxy serve` as a process killed and restarted at will
(`ProxyProcess`), job-like clients of one rank each that record everything they are told in a `Ledger`
(`RankJob`), and the steps every scenario shares: what to check when the proxy dies, and how a run ends.

For a run on several proxies (a rank handed from one to another), the jobs talk to a `Forwarder`: one
address whose new connections go to the proxy of the moment (`Run.hand_over`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson

from app.http.client import HTTPClient, HTTPClientError
from app.job.client import ProxyJob, ProxyJobError, Resume
from tests.chaos.invariants import (
    GENERATED,
    REPLAYED,
    Answer,
    Ledger,
    assert_invariants,
    check_at_rest,
    read_last_chunk,
)
from tests.e2e.conftest import start_proxy
from tests.servers import free_port

REPO = Path(__file__).parents[2]
#: Readiness only (never an assertion on speed): how long a restarted process may take to answer.
READY_S = 60.0


@contextlib.asynccontextmanager
async def http_client(**options: float) -> AsyncIterator[HTTPClient]:
    client = HTTPClient(**options)
    try:
        yield client
    finally:
        await client.close()


class Process:
    """A real process on one port for its whole life, killed and restarted at will, its stderr appended
    to a log file (a pipe nobody reads would fill up and stop it)."""

    def __init__(self, log: Path, port: int, health: str) -> None:
        self.log = log
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.health = health
        self.proc: subprocess.Popen[bytes] | None = None
        self.lives = 0
        #: Set in its environment besides this process's own.
        self.env: dict[str, str] = {}

    def command(self) -> list[str]:
        """What `python -m` runs."""
        raise NotImplementedError

    def start(self) -> None:
        with open(self.log, "ab") as log:
            log.write(f"--- life {self.lives}: {' '.join(self.command())}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", *self.command()],
                cwd=REPO,
                stdout=subprocess.DEVNULL,
                stderr=log,
                env={**os.environ, **self.env},
            )
        self.lives += 1

    async def ready(self) -> None:
        """Wait until it answers; fail, with its log, if it exits instead."""
        deadline = time.monotonic() + READY_S
        async with http_client(connect_timeout=2, read_timeout=5) as client:
            while True:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    raise AssertionError(f"{self.command()[0]} exited with {self.proc.returncode}:\n{self.log_tail()}")
                try:
                    async with client.request("GET", self.url + self.health) as answer:
                        await answer.read()
                        if answer.status == 200:
                            return
                except HTTPClientError:
                    pass
                assert time.monotonic() < deadline, f"{self.url} did not answer in {READY_S} s:\n{self.log_tail()}"
                await asyncio.sleep(0.02)

    def kill(self) -> float:
        """SIGKILL; returns when it was sent."""
        assert self.proc is not None
        at = time.monotonic()
        self.proc.kill()
        self.proc.wait(timeout=30)
        return at

    def stop(self) -> int:
        """SIGTERM; returns the exit status."""
        self.terminate()
        assert self.proc is not None
        return self.proc.wait(timeout=60)

    def terminate(self) -> None:
        """SIGTERM, without waiting for it to exit (see `exited`)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)

    async def exited(self) -> int:
        """Its exit status, once it has exited (the event loop runs meanwhile)."""
        assert self.proc is not None
        deadline = time.monotonic() + READY_S
        while self.proc.poll() is None:
            assert time.monotonic() < deadline, f"{self.url} did not exit in {READY_S} s:\n{self.log_tail()}"
            await asyncio.sleep(0.02)
        return self.proc.returncode

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def log_tail(self, lines: int = 25) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:]) if self.log.exists() else ""


class UpstreamProcess(Process):
    """`inferproxy fake-upstream`."""

    def __init__(self, data: Path, name: str = "upstream", latency_ms: float = 0.0) -> None:
        super().__init__(data / f"{name}.log", free_port(), "/v1/models")
        self.latency_ms = latency_ms

    def command(self) -> list[str]:
        return ["app.cli", "fake-upstream", f"--port={self.port}", f"--latency-ms={self.latency_ms:g}"]

    async def stats(self) -> dict[str, Any]:
        async with http_client() as client, client.request("GET", self.url + "/_fake/stats") as answer:
            return dict(orjson.loads(await answer.read()))


class ProxyProcess(Process):
    """`inferproxy serve`, started through `tests.chaos.faulty_serve` so that a fault can be injected."""

    def __init__(
        self,
        data: Path,
        upstreams: Sequence[str],
        *extra: str,
        checkpoints: Path | None = None,
        output: Path | str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        """`output` a local folder, or an `s3://bucket/prefix` URL (then `env` says where the store is and
        the keys: `AWS_ENDPOINT_URL_S3`, `AWS_ACCESS_KEY_ID`, ...)."""
        self.checkpoints = checkpoints or data / "checkpoints"
        self.output: Path | str = output or data / "output"
        self.data = data
        self.snapshots = 0
        args, port = start_proxy(upstreams[0], data, *(f"--upstream={url}" for url in upstreams[1:]), *extra)
        self.args = [
            *(arg for arg in args if not arg.startswith(("--checkpoints-dir=", "--output="))),
            f"--checkpoints-dir={self.checkpoints}",
            f"--output={self.output}",
        ]
        super().__init__(data / "proxy.log", port, "/healthz")
        self.env = dict(env or {})
        self.fault = "none"
        self.fault_log = data / "faults.jsonl"
        self.io_switch = Path(f"{self.fault_log}.io")
        self.synced_sizes = Path(f"{self.fault_log}.synced")

    def command(self) -> list[str]:
        return ["tests.chaos.faulty_serve", self.fault, str(self.fault_log), *self.args]

    def start(self, fault: str = "none") -> None:
        """Start it, to die of `fault` (see `faulty_serve`), or of nothing."""
        self.fault = fault
        FSYNC_FAILED.discard(self.url)
        super().start()

    def cut_power(self) -> float:
        """SIGKILL, and what a power cut would take besides (`lose_unsynced`). Returns when the power went."""
        at = self.kill()
        self.lose_unsynced()
        return at

    def lose_unsynced(self) -> None:
        """What a power cut takes from a dead proxy: every chunk file, and every batch's `results.jsonl`, cut
        back to the size it had when its last fsync began (see `faulty_serve`)."""
        assert not self.running(), "a power cut takes what is unsynced from a dead proxy"
        synced = json.loads(self.synced_sizes.read_text()) if self.synced_sizes.exists() else {}
        for path in [*self.checkpoints.glob("*/chunk_*.jsonl"), *self.checkpoints.glob("batches/*/results.jsonl")]:
            size = synced.get(os.path.realpath(path), 0)
            if path.stat().st_size > size:
                os.truncate(path, size)

    def died_of_fault(self) -> dict[str, Any] | None:
        """The fault it died of (see `faulty_serve`), once it is dead of it."""
        if self.proc is None or self.proc.poll() is None or not self.fault_log.exists():
            return None
        return dict(json.loads(self.fault_log.read_text().splitlines()[-1]))

    def fail_io(self, code: str, calls: str, where: Path) -> None:
        """From now on `os.write`/`os.fsync` (`calls`: "write,fsync") on files under `where` fail with `code`."""
        self.io_switch.write_text(f"{code} {calls} {where}")
        if "fsync" in calls and where == self.checkpoints:
            FSYNC_FAILED.add(self.url)  # its ranks refuse every request until it restarts

    def heal_io(self) -> None:
        self.io_switch.unlink(missing_ok=True)

    def slow_io(self, seconds: float, where: Path) -> None:
        """From now on every `os.open` under `where` first sleeps `seconds` (see `faulty_serve`)."""
        Path(f"{self.fault_log}.slowed").unlink(missing_ok=True)
        Path(f"{self.fault_log}.slept").unlink(missing_ok=True)
        Path(f"{self.fault_log}.slow").write_text(f"{seconds} {where}")

    def fast_io(self) -> None:
        """`slow_io` no more (an `os.open` sleeping now sleeps on)."""
        Path(f"{self.fault_log}.slow").unlink(missing_ok=True)

    def output_at_rest(self) -> Path:
        """The output as a local folder, for the at-rest checks: the folder itself, or for an object store
        a snapshot of every object under the prefix (a fresh folder each time, named by the key past it)."""
        if isinstance(self.output, Path):
            return self.output
        self.snapshots += 1
        into = self.data / f"output-snapshot-{self.snapshots}"
        snapshot_s3(self.output, self.env, into)
        return into

    def slowed(self) -> bool:
        """Whether an `os.open` under `slow_io`'s folder has begun (and is sleeping, or has slept)."""
        return Path(f"{self.fault_log}.slowed").exists()

    def slept(self) -> bool:
        """Whether such an `os.open` has come out of its sleep."""
        return Path(f"{self.fault_log}.slept").exists()


def snapshot_s3(url: str, env: dict[str, str], into: Path) -> None:
    """Download every object under `url` (`s3://bucket/prefix`) into `into`, by its key past the prefix."""
    import boto3  # only the object-store scenarios need it

    parts = urlsplit(url)
    bucket, prefix = parts.netloc, parts.path.strip("/")
    client = boto3.client(
        "s3",
        endpoint_url=env["AWS_ENDPOINT_URL_S3"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env.get("AWS_DEFAULT_REGION", "us-east-1"),
    )
    try:
        into.mkdir(parents=True)
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/"):
            for listed in page.get("Contents", []):
                path = into / listed["Key"].removeprefix(f"{prefix}/")
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(client.get_object(Bucket=bucket, Key=listed["Key"])["Body"].read())
    finally:
        client.close()


class Forwarder:
    """A stable front address (`url`) for the jobs: each new connection is piped to the backend port of
    the moment, which `switch` changes; connections already open go on to the one they were made to
    (until it closes them, as a stopping proxy does after its answers).

    Every connection it accepts or makes is closed, and its close awaited, however its pipe ends (the
    backend closes or breaks it, or `close` cancels the pipe, even one that never ran): a socket left to
    the garbage collector is a `ResourceWarning`, which the suite turns into an error of whichever test
    happens to collect it (under pytest-xdist, often another one).
    """

    def __init__(self, backend_port: int) -> None:
        self.backend_port = backend_port
        self.connections: Counter[int] = Counter()  # per backend port, for the scenario's report
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task[None]] = set()
        #: Every connection, either side, until its socket is closed.
        self._open: set[asyncio.StreamWriter] = set()
        self.port = 0
        self.url = ""

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accepted, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def switch(self, backend_port: int) -> None:
        self.backend_port = backend_port

    def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """`start_server`'s callback, not a coroutine: the pipe's task is then ours, known with its
        connection from the start (for `close`), and its cancellation is not logged as an error (asyncio
        3.11 asks a callback's cancelled task for its exception, which raises)."""
        self._open.add(writer)
        task = asyncio.get_running_loop().create_task(self._forward(reader, writer))
        self._pipes.add(task)
        task.add_done_callback(self._pipes.discard)

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        port = self.backend_port
        sides = [writer]
        cut = True  # closed at once, unless the backend's side ended with end of file
        try:
            try:
                backend_reader, backend_writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:  # the backend is down: the client sees its connection closed, as it would
                return
            self._open.add(backend_writer)
            sides.append(backend_writer)
            self.connections[port] += 1
            to_backend = asyncio.create_task(self._pipe(reader, backend_writer))
            try:
                # The backend is done with this connection (closed, or killed): so is the client's.
                cut = await self._pipe(backend_reader, writer)
            finally:
                to_backend.cancel()
                await asyncio.gather(to_backend, return_exceptions=True)
        finally:
            for side in sides:  # a pipe cancelled in here leaves the rest to `close`
                await self._shut(side, cut)

    @staticmethod
    async def _pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> bool:
        """Copy until end of file (then half-close the sink); True if a side broke instead."""
        try:
            while data := await source.read(1 << 16):
                sink.write(data)
                await sink.drain()
            if sink.can_write_eof():
                sink.write_eof()
            return False
        except OSError:
            return True

    async def _shut(self, writer: asyncio.StreamWriter, cut: bool) -> None:
        """Close a connection (at once, dropping anything unsent, if `cut`) and wait until its socket is."""
        if cut:
            writer.transport.abort()
        else:
            writer.close()
        # Shielded: a pipe cancelled in `wait_closed` would cancel the connection's one close future with
        # it, and `close`, waiting for that socket again, would get a CancelledError of its own.
        await asyncio.shield(closed(writer))
        self._open.discard(writer)

    async def close(self) -> None:
        """Stop accepting, end every pipe, and return once every socket is closed."""
        if self._server is not None:
            self._server.close()
        pipes = list(self._pipes)
        for task in pipes:
            task.cancel()
        await asyncio.gather(*pipes, return_exceptions=True)
        for writer in list(self._open):  # of a pipe cancelled before it ran, or while it closed them
            await self._shut(writer, cut=True)
        if self._server is not None:
            await self._server.wait_closed()


async def closed(writer: asyncio.StreamWriter) -> None:
    """Once the connection's socket is closed."""
    with contextlib.suppress(OSError):  # the close of a connection that broke says how it broke
        await writer.wait_closed()


class ProxyDied(Exception):
    """The connection to the proxy broke: it was killed under the job."""


#: How long a rollout waits for a rank another proxy still owns, or for a proxy answering 503 (as
#: `ProxyJob`'s `owned_wait_s` does for the checkpoint calls): readiness only, never a check of speed.
REFUSED_WAIT_S = 180.0


def retry_after_refusal(answer: Answer) -> float | None:
    """How long to wait before sending a rollout again that was refused for now, or None if it was not:
    409 `rank_owned_error` (another live proxy still owns the rank: it gives it up when it stops), or
    503 (after its `Retry-After`). Nothing else is retried: every other answer is the scenario's to check."""
    if answer.status == 503:
        retry_after = dict(answer.headers).get(b"retry-after", b"")
        return min(float(retry_after), 5.0) if retry_after.isdigit() else 0.5
    if answer.status == 409 and answer.data is not None:
        with contextlib.suppress(orjson.JSONDecodeError, AttributeError, TypeError):
            if orjson.loads(answer.data)["error"]["type"] == "rank_owned_error":
                return 0.1
    return None


#: Per rank: documents in flight, rollouts per document (odd ones streamed), and the delay between
#: streamed chunks (so that a kill often lands mid-stream).
CONCURRENCY = 4
ROLLOUTS = 2
CHUNK_DELAY_MS = 5


def rollout_request(doc_id: str, rollout_idx: int, position: int) -> tuple[str, dict[str, Any]]:
    """The path and body of one rollout: chat or completions by position, odd rollouts streamed."""
    body: dict[str, Any] = {"model": "fake-model", "max_tokens": 6, "stream": rollout_idx % 2 == 1}
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}
        body["fake_upstream"] = {"chunk_delay_ms": CHUNK_DELAY_MS}
    if position % 3 == 2:
        return "/v1/completions", {**body, "prompt": f"{doc_id} rollout {rollout_idx}"}
    return "/v1/chat/completions", {
        **body,
        "messages": [{"role": "user", "content": f"{doc_id} rollout {rollout_idx}"}],
    }


async def ask(
    client: HTTPClient,
    ledger: Ledger,
    url: str,
    rank: int,
    doc_id: str,
    rollout_idx: int,
    path: str,
    body: bytes,
    chunk_index: int | None = None,
) -> Answer:
    """One request to `/v1/*`, recorded in the ledger however it ends (cut, cancelled, answered)."""
    headers = [
        (b"content-type", b"application/json"),
        (b"x-rank", str(rank).encode()),
        (b"x-doc-id", doc_id.encode()),
        (b"x-rollout-idx", str(rollout_idx).encode()),
    ]
    if chunk_index is not None:
        headers.append((b"x-chunk-index", str(chunk_index).encode()))
    status, state, data, got, streamed = 0, "", None, (), False
    sent = time.monotonic()
    try:
        async with client.request("POST", url + path, headers=headers, body=body) as response:
            status, state = response.status, (response.header(b"x-cache") or b"").decode()
            got = tuple(response.headers)
            streamed = (response.header(b"content-type") or b"").startswith(b"text/event-stream")
            pieces = [piece async for piece in response.iter_chunks()]
            data = b"".join(pieces)
    finally:
        received = time.monotonic()
        answer = Answer(rank, doc_id, rollout_idx, path, body, streamed, state, status, data, sent, received, got)
        ledger.answers.append(answer)
    return answer


@dataclass
class RankJob:
    """One rank of a batch job: for each document of its input not yet done (as `/resume` says), its
    rollouts through `/v1/*`, then the document to `/documents` (through `app.job.client.ProxyJob`, batching
    as `run_job` does). Its last chunk is left open (`Run.finish` completes it).

    When the proxy dies under it, a job that `restarts` starts over from `/resume` (as a job killed with
    its proxy is restarted); the others ride through, each call retried (as the job client retries).

    It starts a document only while `going` is set (`Run.jobs_held`).
    """

    url: str
    ledger: Ledger
    rank: int
    restarts: bool
    refusals: Counter[int] = field(default_factory=Counter)
    going: asyncio.Event = field(default_factory=lambda: set_event(asyncio.Event()))

    async def run(self) -> None:
        while True:
            try:
                await self._pass()
                return
            except* ProxyDied:
                pass  # started over from /resume once the proxy answers again

    async def _pass(self) -> None:
        retries = 0 if self.restarts else 12
        async with http_client(read_timeout=60) as client:
            job = ProxyJob(self.url, self.rank, retries=retries, client=client)
            try:
                resume = await self._call(lambda: resume_of(job, self.ledger, self.rank))
                inputs = self.ledger.inputs[self.rank]
                slots = asyncio.Semaphore(CONCURRENCY)
                async with asyncio.TaskGroup() as tasks:
                    for position, doc_id in enumerate(inputs):
                        if position >= resume.docs_to_skip and doc_id not in resume.processed_ids:
                            await self.going.wait()
                            await slots.acquire()
                            tasks.create_task(self._document(client, job, position, doc_id, slots))
            finally:
                await job.close()

    async def _document(
        self, client: HTTPClient, job: ProxyJob, position: int, doc_id: str, slots: asyncio.Semaphore
    ) -> None:
        try:
            chunk = position // self.ledger.records_per_chunk
            texts = await asyncio.gather(*(self._rollout(client, doc_id, r, position) for r in range(ROLLOUTS)))
            document = {"id": doc_id, "text": f"text of {doc_id}", "metadata": {"rollouts": list(texts)}}
            retried = False
            while True:
                try:
                    await self._call(lambda: job.write_document(document, chunk))
                    break
                except ProxyJobError as refused:
                    if await self._stored_all_the_same(job, refused, doc_id, retried):
                        break
                    retried = True
                    await asyncio.sleep(0.1)  # the disk may be full, or failing
            self.ledger.acknowledge(self.rank, doc_id)
        finally:
            slots.release()

    async def _stored_all_the_same(self, job: ProxyJob, refused: ProxyJobError, doc_id: str, retried: bool) -> bool:
        """Whether a refused document is stored all the same (else it is sent again): the proxy says so (a
        chunk it completed could not be published), or, for a 409 to a document sent before, `/resume`
        says its chunk is done (as `ProxyJob` takes a 409 to a retry). Where the proxy says nothing of it
        was written, `/resume` must agree."""
        if refused.status == 409 and retried:
            return await self._done(job, doc_id)
        if refused.status not in (500, 507):
            raise refused
        self.refusals[refused.status] += 1
        if "the documents are stored" in refused.message:
            return True
        if "nothing of this request was written" in refused.message and await self._done(job, doc_id):
            self.ledger.violations.append(
                f"rank {self.rank}: {doc_id!r} was refused with {refused.status} ({refused.message}) "
                f"but /resume counts it done"
            )
        return False

    async def _done(self, job: ProxyJob, doc_id: str) -> bool:
        try:
            resume = await self._call(lambda: resume_of(job, self.ledger, self.rank))
        except ProxyJobError as refused:
            if broken_until_restart(self.url, refused):
                return False  # not known until the restart: sent again, as the job client would
            raise
        return self.ledger.positions[self.rank][doc_id] < resume.docs_to_skip or doc_id in resume.processed_ids

    async def _rollout(self, client: HTTPClient, doc_id: str, rollout_idx: int, position: int) -> str:
        path, body = rollout_request(doc_id, rollout_idx, position)
        chunk = position // self.ledger.records_per_chunk
        raw = orjson.dumps(body)
        deadline = time.monotonic() + REFUSED_WAIT_S
        while True:
            answer = await self._call(
                lambda: ask(client, self.ledger, self.url, self.rank, doc_id, rollout_idx, path, raw, chunk)
            )
            pause = retry_after_refusal(answer)
            if pause is None or time.monotonic() + pause > deadline:
                break
            self.refusals[answer.status] += 1  # sent again, as a job would once the rank is free
            await asyncio.sleep(pause)
        assert answer.status == 200, f"{doc_id} rollout {rollout_idx}: {answer}"
        assert answer.data is not None
        return answer.data[-40:].decode("utf-8", "replace")

    async def _call(self, call: Callable[[], Any]) -> Any:
        """`call()`; when the connection breaks, `ProxyDied` for a job that restarts, else retried (a proxy
        restarts in well under the job client's retry budget)."""
        delay = 0.05
        deadline = time.monotonic() + READY_S
        while True:
            try:
                return await call()
            except HTTPClientError as exc:
                if self.restarts:
                    raise ProxyDied(str(exc)) from exc
                if time.monotonic() > deadline:
                    raise AssertionError(f"rank {self.rank}: the proxy did not come back: {exc}") from exc
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)


def set_event(event: asyncio.Event) -> asyncio.Event:
    event.set()
    return event


async def resume_of(job: ProxyJob, ledger: Ledger, rank: int) -> Resume:
    """`GET /resume`, checked against what was acknowledged before it was asked."""
    sent = time.monotonic()
    resume = await job.resume()
    ledger.check_resume(rank, resume, sent, time.monotonic())
    return resume


async def watch_resume(url: str, ledger: Ledger, rank: int, stop: asyncio.Event) -> None:
    """Ask `/resume` again and again (each after the last was answered), for the ledger's checks."""
    async with http_client(read_timeout=30) as client:
        job = ProxyJob(url, rank, retries=0, client=client)
        while not stop.is_set():
            try:
                await resume_of(job, ledger, rank)
            except HTTPClientError:  # the proxy is being restarted
                pass
            except ProxyJobError as refused:
                if not broken_until_restart(url, refused):
                    raise
            await asyncio.sleep(0.05)


#: The proxies (by URL) whose checkpoint fsyncs were made to fail since they last started.
FSYNC_FAILED: set[str] = set()


def broken_until_restart(url: str, refused: ProxyJobError) -> bool:
    """Whether a refusal is the 500 of a rank whose checkpoint fsync failed, from a proxy a scenario made fail
    one since its start: every request of the rank gets it until the proxy restarts (contract §6)."""
    return url in FSYNC_FAILED and refused.status == 500 and "could not be made durable earlier" in refused.message


@dataclass
class Run:
    """One scenario's run: the proxy, the ledger, the ranks' jobs and what was found wrong so far.

    With `standby` proxies (on the same checkpoints and output) and a `front` the jobs talk to, the run
    can hand the ranks from `proxy` to a standby one (`hand_over`)."""

    proxy: ProxyProcess
    ledger: Ledger
    jobs: list[RankJob]
    problems: list[str] = field(default_factory=list)
    standby: list[ProxyProcess] = field(default_factory=list)
    front: Forwarder | None = None
    #: Per hand-over: whether the SIGTERM landed while a publication was slowed (under way).
    handovers: list[bool] = field(default_factory=list)
    _stop_watching: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _jobs: asyncio.Future[list[None]] | None = None
    #: Every proxy of the run, for `close`: mid-`hand_over` one may be neither `proxy` nor a standby.
    _proxies: list[ProxyProcess] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._proxies = [self.proxy, *self.standby]

    @property
    def url(self) -> str:
        """Where the jobs send their requests."""
        return self.front.url if self.front is not None else self.proxy.url

    def start_jobs(self) -> None:
        self._tasks = [
            asyncio.create_task(watch_resume(self.url, self.ledger, job.rank, self._stop_watching)) for job in self.jobs
        ]
        self._jobs = asyncio.gather(*(job.run() for job in self.jobs))

    def jobs_done(self) -> bool:
        """Whether every job is done (a job that failed raises its error here)."""
        assert self._jobs is not None
        if self._jobs.done():
            self._jobs.result()
            return True
        return False

    async def until(self, condition: Callable[[], bool], what: str) -> None:
        """Wait for `condition` while the jobs run (a readiness wait, with a generous deadline)."""
        deadline = time.monotonic() + READY_S * 2
        while not condition():
            assert not self.jobs_done(), f"the jobs ended before {what}"
            assert time.monotonic() < deadline, f"no {what} in {READY_S * 2} s:\n{self.proxy.log_tail()}"
            await asyncio.sleep(0.005)

    async def until_async(self, condition: Callable[[], Awaitable[bool]], what: str, interval: float = 0.02) -> None:
        """`until`, for a condition that must be awaited (asking a server)."""
        deadline = time.monotonic() + READY_S * 2
        while not await condition():
            assert not self.jobs_done(), f"the jobs ended before {what}"
            assert time.monotonic() < deadline, f"no {what} in {READY_S * 2} s:\n{self.proxy.log_tail()}"
            await asyncio.sleep(interval)

    @contextlib.asynccontextmanager
    async def jobs_held(self) -> AsyncIterator[None]:
        """No job starts a document meanwhile (those under way go on): the scenario's set-up for its next
        moment takes what time the machine needs, without the jobs running on towards their end."""
        for job in self.jobs:
            job.going.clear()
        try:
            yield
        finally:
            for job in self.jobs:
                job.going.set()

    async def jobs_finished(self) -> None:
        assert self._jobs is not None
        await self._jobs

    def died(self, at: float) -> None:
        """The proxy died at `at`: what is on disk must hold now, before anything is restored."""
        self.ledger.deaths.append(at)
        for rank in self.ledger.inputs:
            now = time.monotonic()
            self.ledger.observe(rank, read_last_chunk(self.proxy.checkpoints, rank), now, now, "the last_chunk file")
        self.at_rest(f"after death {len(self.ledger.deaths)}")

    def at_rest(self, when: str) -> None:
        """What must hold on disk while no proxy runs."""
        running = [proxy.url for proxy in (self.proxy, *self.standby) if proxy.running()]
        assert not running, f"{when}: the at-rest checks need every proxy stopped, {running} runs"
        found = check_at_rest(self.ledger, self.proxy.checkpoints, self.proxy.output_at_rest())
        self.problems += [f"{when}: {problem}" for problem in found]

    async def hand_over(self, slow_s: float, *, kill_the_new_one: bool = False) -> None:
        """SIGTERM the proxy in the middle of a publication and send the jobs to a standby one at once.

        The proxy's output is slowed (`slow_s` per open) until a publication is under way; then SIGTERM,
        and the front's new connections go to the standby proxy, which takes each rank over once the old
        one gives it up (409 `rank_owned_error` till then, which the jobs retry). The old one must exit 0.
        With `kill_the_new_one`, the new one is SIGKILLed as soon as the old one has exited (no proxy
        running: the at-rest checks), and restarted. The old one is then restarted as a standby.
        """
        assert self.front is not None, "a hand-over needs a front"
        assert self.standby, "a hand-over needs a standby proxy"
        old, new = self.proxy, self.standby.pop(0)
        assert isinstance(old.output, Path), "slow_io slows a local output"
        old.slow_io(slow_s, old.output)
        await self.until(old.slowed, "a publication under way on the slowed output")
        self.handovers.append(old.slowed() and not old.slept())
        old.terminate()
        self.front.switch(new.port)
        self.proxy = new
        status = await old.exited()
        old.fast_io()
        assert status == 0, f"SIGTERM mid-publication did not exit 0 but {status}:\n{old.log_tail()}"
        if kill_the_new_one:
            self.died(new.kill())
            await self.restart()
        # Restarting the old one as the next one's successor is no part of the hand-over: the jobs wait for
        # it. Left to run, they did some 200 documents per restart (a process starts slowly next to them),
        # used up their input before the last hand-overs were due, and those found no publication to
        # interrupt ("the jobs ended before a publication under way"), the sooner the more loaded the machine.
        async with self.jobs_held():
            old.start()
            await old.ready()
        self.standby.append(old)

    async def restart(self) -> None:
        self.proxy.start()
        await self.proxy.ready()

    async def kill_and_restart(self, *, power_cut: bool = False) -> None:
        self.died(self.proxy.cut_power() if power_cut else self.proxy.kill())
        await self.restart()

    async def finish(self) -> None:
        """End the run and check everything.

        The jobs are done, their last chunks open. Once every answer is older than the replay window,
        the proxy is killed a last time and restarted: each rank's `/resume` must count every document
        done, and every answer of an open chunk must replay byte for byte. Then the last chunks are
        completed, the proxy stopped (exit 0), and the output must hold every document once.
        """
        await self.jobs_finished()
        self._stop_watching.set()
        await asyncio.gather(*self._tasks)
        for standby in self.standby:  # idle: the jobs talk to `proxy` only
            standby.terminate()
            assert await standby.exited() == 0, f"SIGTERM did not exit 0:\n{standby.log_tail()}"
        await asyncio.sleep(self.ledger.replay_window_s)
        await self.kill_and_restart()
        replayed = 0
        async with http_client(read_timeout=60) as client:
            for job in self.jobs:
                proxy_job = ProxyJob(self.proxy.url, job.rank, retries=0, client=client)
                resume = await resume_of(proxy_job, self.ledger, job.rank)
                for answer in latest_stored_answers(self.ledger, job.rank):
                    if self.ledger.chunk_of(job.rank, answer.doc_id) > resume.last_chunk_index:
                        await ask(
                            client,
                            self.ledger,
                            self.proxy.url,
                            job.rank,
                            answer.doc_id,
                            answer.rollout_idx,
                            answer.path,
                            answer.body,
                        )
                        replayed += 1
                await proxy_job.complete_chunk(self.ledger.last_chunk(job.rank))
                await resume_of(proxy_job, self.ledger, job.rank)
        assert replayed, "nothing was left to replay: the last chunks should have stayed open"
        assert self.proxy.stop() == 0, f"SIGTERM did not exit 0:\n{self.proxy.log_tail()}"
        output = self.proxy.output_at_rest()
        self.problems += check_at_rest(self.ledger, self.proxy.checkpoints, output, finished=True)
        assert_invariants(self.ledger, self.problems)

    async def close(self) -> None:
        """Whatever happened: no task, no process left behind."""
        self._stop_watching.set()
        pending = [*self._tasks, *([self._jobs] if self._jobs is not None else [])]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for proxy in self._proxies:
            proxy.close()
        if self.front is not None:
            await self.front.close()


@contextlib.asynccontextmanager
async def chaos_run(
    proxy: ProxyProcess,
    ledger: Ledger,
    jobs: list[RankJob],
    fault: str = "none",
    *,
    standby: Sequence[ProxyProcess] = (),
    front: Forwarder | None = None,
) -> AsyncIterator[Run]:
    """A `Run` with the proxy started (with `fault`, see `faulty_serve`) and the jobs running; everything
    stopped at the end. `standby` proxies are started too (and `front` pointed at `proxy`), for `hand_over`."""
    run = Run(proxy, ledger, jobs, standby=list(standby), front=front)
    try:
        if front is not None:
            front.switch(proxy.port)
        for started in (proxy, *standby):
            started.start(fault if started is proxy else "none")
        await asyncio.gather(*(started.ready() for started in (proxy, *standby)))
        run.start_jobs()
        yield run
    finally:
        await run.close()


def latest_stored_answers(ledger: Ledger, rank: int) -> list[Answer]:
    """The last answer of each of the rank's keys that the proxy must have stored (or replayed)."""
    latest: dict[tuple[int, str, int, str, bytes], Answer] = {}
    for answer in sorted(ledger.answers, key=lambda a: a.received_at):
        if answer.rank == rank and answer.state in GENERATED | REPLAYED and answer.why_not_storable() is None:
            latest[answer.key] = answer
    return list(latest.values())
