"""app.integrations.datatrove in-process: the runner's run_async against a real proxy on a loopback port."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from datatrove.data import Document
from datatrove.pipeline.inference.run_inference import InferenceConfig, InferenceRunner
from datatrove.pipeline.inference.types import InferenceError, ServerError
from datatrove.pipeline.readers import JsonlReader
from datatrove.pipeline.writers import JsonlWriter
from datatrove.pipeline.writers.disk_base import DiskWriter
from datatrove.utils.logging import logger

import app.integrations.datatrove.checkpoints as adapter
from app.integrations.datatrove import ProxyInferenceRunner, with_inferproxy_checkpointing
from app.service.app import create_app
from app.service.settings import Settings
from app.tools.fake_upstream import FakeUpstream
from tests.servers import fake_upstream, free_port, serve_in_loop, serve_proxy

# Under both servers: the app must behave the same under the built-in one and under uvicorn.
pytestmark = pytest.mark.usefixtures("http_server")

TEMPLATE = "${rank}_chunk_${chunk_index}.jsonl"


class TextWriter(DiskWriter):  # type: ignore[misc]
    def _write(self, document: dict[str, Any], file_handler: Any, filename: str) -> None:
        file_handler.write(document["text"] + "\n")


@dataclass
class Env:
    proxy: str
    upstream: FakeUpstream
    tmp_path: Path

    @property
    def out(self) -> Path:
        return self.tmp_path / "out"

    def runner(self, rollout: Callable[..., Awaitable[Any]] | None = None, **kwargs: Any) -> ProxyInferenceRunner:
        config = kwargs.pop("config", None) or InferenceConfig(
            server_type="endpoint",
            endpoint_url=self.proxy,
            model_name_or_path="fake-model",
            rollouts_per_document=2,
            max_concurrent_generations=8,
            metric_interval=3600,
        )
        writer = kwargs.pop("output_writer", None) or JsonlWriter(
            str(self.out), output_filename=TEMPLATE, compression=None
        )
        return ProxyInferenceRunner(
            rollout_fn=rollout or ask, config=config, output_writer=writer, retry_backoff_s=0.01, **kwargs
        )

    def published(self) -> list[dict[str, Any]]:
        return [json.loads(line) for f in sorted(self.out.glob("*.jsonl")) for line in f.read_text().splitlines()]


async def ask(document: Document, generate: Callable[[dict[str, Any]], Awaitable[Any]]) -> str:
    result = await generate({"messages": [{"role": "user", "content": f"about {document.id}"}], "max_tokens": 4})
    return str(result.text)


def documents(n: int, prefix: str = "doc") -> list[Document]:
    return [Document(text=f"text {i}", id=f"{prefix}-{i}") for i in range(n)]


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    async with fake_upstream() as (url, upstream):
        settings = Settings(
            upstream=[url], checkpoints_dir=tmp_path / "ckpt", output=str(tmp_path / "out"), records_per_chunk=4
        )
        async with serve_proxy(settings) as proxy:
            yield Env(proxy, upstream, tmp_path)


async def test_every_document_is_published_once_by_the_proxy_with_its_rollouts_and_a_rerun_costs_nothing(
    env: Env,
) -> None:
    runner = env.runner()
    await runner.run_async(documents(10), rank=3)
    published = env.published()
    assert sorted(d["id"] for d in published) == sorted(d.id for d in documents(10))
    assert all(len(d["metadata"]["rollout_results"]) == 2 for d in published)
    assert sorted(p.name for p in env.out.iterdir()) == [f"00003_chunk_{i}.jsonl" for i in range(3)]
    assert env.upstream.generations == 20
    assert runner.stats["documents_processed"].total == 10
    assert runner.stats["successful_requests"].total == 20

    await env.runner().run_async(documents(10), rank=3)
    assert env.upstream.generations == 20
    assert len(env.published()) == 10


async def test_the_runner_keeps_no_request_cache_of_its_own(env: Env) -> None:
    runner = env.runner()
    await runner.run_async(documents(3), rank=0)
    assert not runner.request_cache.enabled
    proxy_files = env.tmp_path / "ckpt"
    assert [p for p in env.tmp_path.rglob("*.sqlite3*") if proxy_files not in p.parents] == []


async def test_a_killed_run_resumes_and_in_flight_answers_come_from_the_proxys_cache(env: Env) -> None:
    started = 0

    async def dies_part_way(document: Document, generate: Callable[[dict[str, Any]], Awaitable[Any]]) -> str:
        nonlocal started
        started += 1
        text = await ask(document, generate)
        if started > 12:
            raise RuntimeError("the task dies")  # with other documents' requests in flight
        return text

    with pytest.raises(InferenceError, match="the task dies"):
        await env.runner(dies_part_way).run_async(documents(10), rank=0)
    runner = env.runner()
    await runner.run_async(documents(10), rank=0)
    assert sorted(d["id"] for d in env.published()) == sorted(d.id for d in documents(10))
    assert env.upstream.generations == 20
    assert runner.stats["proxy_cache_hits"].total >= 1


async def test_headers_carry_the_document_rollout_chunk_rank_and_api_key(tmp_path: Path) -> None:
    async with fake_upstream() as (url, upstream):
        settings = Settings(
            upstream=[url], checkpoints_dir=tmp_path / "ckpt", output=str(tmp_path / "out"), api_key="sesame"
        )
        async with serve_proxy(settings) as proxy:
            env = Env(proxy, upstream, tmp_path)
            config = InferenceConfig(
                server_type="endpoint", endpoint_url=proxy + "/v1", model_name_or_path="fake-model", api_key="sesame"
            )
            await env.runner(config=config).run_async([Document(text="t", id="the-doc")], rank=7)
            assert [d["id"] for d in env.published()] == ["the-doc"]
            wrong = InferenceConfig(
                server_type="endpoint", endpoint_url=proxy, model_name_or_path="fake-model", api_key="nope"
            )
            with pytest.raises(ServerError, match=r"api_key"):
                await env.runner(config=wrong).run_async(documents(1), rank=0)


async def test_a_ranks_total_when_given_is_declared_to_the_proxy_with_its_checkpoint_calls(tmp_path: Path) -> None:
    declared: list[bytes | None] = []  # X-Total-Documents of each GET /resume and POST /documents
    async with fake_upstream() as (url, upstream):
        app = create_app(Settings(upstream=[url], checkpoints_dir=tmp_path / "ckpt", output=str(tmp_path / "out")))

        async def recording(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] == "http" and scope["path"] in ("/resume", "/documents"):
                declared.append(dict(scope["headers"]).get(b"x-total-documents"))
            await app(scope, receive, send)

        async with serve_in_loop(recording) as proxy:
            env = Env(proxy, upstream, tmp_path)
            await env.runner(total_documents={1: 3}).run_async(documents(3), rank=1)
            assert set(declared) == {b"3"}
            declared.clear()
            # not known, nor the input's length (an iterator): not sent
            await env.runner(total_documents={1: 3}).run_async(iter(documents(2, "other")), rank=2)
            assert set(declared) == {None}
            declared.clear()
            await env.runner(total_documents=2).run_async(documents(2, "more"), rank=4)
            assert set(declared) == {b"2"}
            declared.clear()
            # given, it wins over what the runner could count in the reader's files (here 3)
            folder = tmp_path / "input"
            folder.mkdir()
            (folder / "a.jsonl").write_text(
                "".join(json.dumps({"id": d.id, "text": d.text}) + "\n" for d in documents(3, "read"))
            )
            await env.runner(total_documents=7).run_async(JsonlReader(str(folder)).run(None, 0, 1), rank=5)
            assert set(declared) == {b"7"}


async def test_a_400_is_a_bad_request_that_skip_bad_requests_skips_fresh_or_cached(env: Env) -> None:
    others_answered = asyncio.Event()
    answered: list[str] = []

    async def too_long(document: Document, generate: Callable[[dict[str, Any]], Awaitable[Any]]) -> str:
        if document.id == "doc-1":
            # Only once doc-0 and doc-2 have their answers: the 400 ends the first run, cancelling what is in
            # flight, and an answer cancelled is not cached (the second run would pay it again).
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(others_answered.wait(), 30)
            await generate({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**9})  # over the context
        answer = await ask(document, generate)
        answered.append(document.id)
        if {"doc-0", "doc-2"} <= set(answered):
            others_answered.set()
        return answer

    with pytest.raises(Exception, match="BadRequestError"):
        await env.runner(too_long).run_async(documents(3), rank=0)
    generations = env.upstream.generations
    runner = env.runner(too_long, skip_bad_requests=True)
    await runner.run_async(documents(3), rank=0)
    assert sorted(d["id"] for d in env.published()) == ["doc-0", "doc-2"]
    assert runner.stats["skipped_bad_requests"].total == 1
    assert env.upstream.generations - generations <= 2  # doc-0's and doc-2's answers were cached already


async def test_a_failed_run_ends_only_once_the_proxy_has_answered_the_documents_it_sent(tmp_path: Path) -> None:
    # The proxy holds doc-0's POST /documents until the run has failed and cancelled its documents. A run
    # that ended before the answer left the write to land later, after the next run's GET /resume: that
    # run then did doc-0 again, and missed its answers (a document written is complete to the cache).
    write_arrived, release = asyncio.Event(), asyncio.Event()
    events: list[str] = []
    async with fake_upstream() as (url, upstream):
        app = create_app(
            Settings(
                upstream=[url], checkpoints_dir=tmp_path / "ckpt", output=str(tmp_path / "out"), records_per_chunk=4
            )
        )

        async def holding_writes(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] != "http" or scope["path"] != "/documents":
                await app(scope, receive, send)
                return
            write_arrived.set()
            await release.wait()

            async def noting_the_answer(message: Any) -> None:
                if message["type"] == "http.response.body" and not message.get("more_body"):
                    events.append("documents answered")
                await send(message)

            await app(scope, receive, noting_the_answer)

        async def dies_once_doc_0_is_sent(
            document: Document, generate: Callable[[dict[str, Any]], Awaitable[Any]]
        ) -> str:
            if document.id == "doc-1":
                await write_arrived.wait()
                raise RuntimeError("the task dies")
            return await ask(document, generate)

        async with serve_in_loop(holding_writes) as proxy:
            env = Env(proxy, upstream, tmp_path)
            runner = env.runner(dies_once_doc_0_is_sent)
            cleanup = runner._cleanup

            async def cleanup_then_release(*args: Any, **kwargs: Any) -> None:
                await cleanup(*args, **kwargs)  # datatrove's: the run's documents are cancelled
                release.set()

            runner._cleanup = cleanup_then_release
            with pytest.raises(InferenceError, match="the task dies"):
                await runner.run_async(documents(2), rank=0)
            events.append("run returned")
            assert events == ["documents answered", "run returned"]
            await env.runner().run_async(documents(2), rank=0)
            assert sorted(d["id"] for d in env.published()) == ["doc-0", "doc-1"]
            assert upstream.generations == 4  # doc-0's two in the first run, skipped in the second


async def test_502_503_504_429_and_a_dropped_connection_are_retried_honouring_retry_after(tmp_path: Path) -> None:
    script: list[bytes | None] = [
        http_answer(503, {"error": {"message": "busy"}}, retry_after="0.05"),
        http_answer(502, {"error": {"message": "bad gateway"}}),
        None,  # the connection drops before an answer
        http_answer(504, {"error": {"message": "timed out"}}),
        http_answer(429, {"error": {"message": "slow down"}}, retry_after="0"),
    ]
    generations: list[str] = []

    def reply(path: str) -> bytes | None:
        if path == "/resume":
            return http_answer(200, resume_answer(tmp_path / "out"))
        if path.startswith("/chunks/"):
            return http_answer(200, {"rank": 0, "last_chunk_index": 0, "pending": []})
        if path == "/documents":
            return http_answer(200, {"written": 1})
        if path == "/lookup":
            return http_answer(404, {"error": {"message": "an inferproxy from before POST /lookup"}})
        generations.append(path)
        if script:
            return script.pop(0)
        return http_answer(200, {"choices": [{"message": {"content": "ok"}, "finish_reason": "stop"}], "usage": {}})

    async with raw_server(reply) as url:
        env = Env(url, FakeUpstream(), tmp_path)
        config = InferenceConfig(server_type="endpoint", endpoint_url=url, model_name_or_path="m")
        runner = env.runner(config=config, retries=5)
        await runner.run_async([Document(text="t", id="a")], rank=0)
    assert generations == ["/v1/chat/completions"] * 6
    assert runner.stats["successful_requests"].total == 1


async def test_a_proxy_that_keeps_failing_fails_the_task_with_a_server_error(tmp_path: Path) -> None:
    def reply(path: str) -> bytes | None:
        if path == "/resume":
            return http_answer(200, resume_answer(tmp_path / "out"))
        return http_answer(503, {"error": {"message": "no upstream"}})

    async with raw_server(reply) as url:
        env = Env(url, FakeUpstream(), tmp_path)
        config = InferenceConfig(server_type="endpoint", endpoint_url=url, model_name_or_path="m")
        with pytest.raises(ServerError, match=r"still failed after 2 retries \(status 503"):
            await env.runner(config=config, retries=2).run_async(documents(1), rank=0)


async def test_a_proxy_that_is_not_there_fails_the_task_at_start_saying_so(tmp_path: Path) -> None:
    env = Env(f"http://127.0.0.1:{free_port()}", FakeUpstream(), tmp_path)
    config = InferenceConfig(server_type="endpoint", endpoint_url=env.proxy, model_name_or_path="m")
    with pytest.raises(ServerError, match=r"did not answer GET /resume.*is `inferproxy serve` running"):
        await env.runner(config=config, retries=0).run_async(documents(1), rank=0)


async def test_a_500_is_a_server_error_as_with_datatroves_own_servers(env: Env) -> None:
    async def broken(document: Document, generate: Callable[[dict[str, Any]], Awaitable[Any]]) -> Any:
        return await generate({"prompt": "x", "fake_upstream": {"status": 500}})

    with pytest.raises(ServerError, match="InternalServerError"):
        await env.runner(broken).run_async(documents(1), rank=0)


async def test_a_document_the_proxy_refuses_is_counted_logged_and_fails_the_task_at_its_end(tmp_path: Path) -> None:
    errors: list[str] = []
    sink = logger.add(errors.append, level="ERROR", format="{message}")
    async with fake_upstream() as (url, upstream):
        settings = Settings(
            upstream=[url],
            checkpoints_dir=tmp_path / "ckpt",
            output=str(tmp_path / "out"),
            records_per_chunk=2,
            max_body_bytes=4096,
        )
        async with serve_proxy(settings) as proxy:
            env = Env(proxy, upstream, tmp_path)
            docs = documents(5)
            docs[4].text = "x" * 5000  # its rollouts are short, its checkpoint is over max_body_bytes
            runner = env.runner()
            with pytest.raises(RuntimeError, match=r"refused 1 document.*'doc-4'.*413"):
                await runner.run_async(docs, rank=0)
            assert runner.stats["failed_documents"].total == 1
            logger.remove(sink)
            assert any("refused document 'doc-4'" in e and "NOT in the output" in e for e in errors)
            # the other documents are published (once /resume answers); the last chunk, doc-4's, is left open
            await _resume(env)
            assert sorted(d["id"] for d in env.published()) == [f"doc-{i}" for i in range(4)]
            docs[4].text = "short again"
            await env.runner().run_async(docs, rank=0)
            assert sorted(d["id"] for d in env.published()) == [f"doc-{i}" for i in range(5)]


async def _resume(env: Env) -> dict[str, Any]:
    async with httpx.AsyncClient() as client:
        answer: dict[str, Any] = (await client.get(env.proxy + "/resume")).json()
    return answer


async def test_a_rerun_after_the_last_documents_were_written_but_before_the_last_chunk_completed(
    env: Env,
) -> None:
    async with httpx.AsyncClient(base_url=env.proxy) as client:
        docs = [{"id": d.id, "text": d.text} for d in documents(6)]
        for position, doc in enumerate(docs):
            await client.post("/documents", json=doc, headers={"X-Chunk-Index": str(position // 4)})
    assert (await _resume(env))["processed_ids"] == ["doc-4", "doc-5"]
    await env.runner().run_async(documents(6), rank=0)
    assert sorted(d["id"] for d in env.published()) == [d.id for d in documents(6)]
    assert env.upstream.generations == 0


async def test_a_rerun_of_a_finished_rank_says_it_had_nothing_to_do_and_a_new_job_on_old_checkpoints_warns(
    env: Env,
) -> None:
    """As run_job says it: the rank's last chunk is published (docs_to_skip, 8, is where resume points, a
    multiple of records_per_chunk, not a count of documents), so a rerun is no cause for a warning."""
    said: list[tuple[str, str]] = []
    sink = logger.add(lambda m: said.append((m.record["level"].name, m.record["message"])), level="INFO")
    try:
        await env.runner().run_async(documents(6), rank=0)
        said.clear()
        await env.runner().run_async(documents(6), rank=0)
        assert [s for s in said if "nothing" in s[1]] == [
            (
                "INFO",
                "rank 0: all 6 documents were already done: nothing to do (if this is a new job, not a rerun, give "
                "it a checkpoints dir of its own (inferproxy serve --checkpoints-dir): its documents were taken for "
                "the old job's)",
            )
        ]
        said.clear()
        await env.runner().run_async(documents(3, "new"), rank=0)  # a new job, its checkpoints dir the old one's
        [(level, message)] = [s for s in said if "nothing" in s[1]]
    finally:
        logger.remove(sink)
    assert level == "WARNING"
    assert "says its first 8 documents are done, more than this input has (3)" in message
    assert "start the proxy with a fresh --checkpoints-dir" in message
    assert env.upstream.generations == 12


async def test_records_per_chunk_given_and_not_the_proxys_is_refused_naming_both(env: Env) -> None:
    with pytest.raises(ValueError, match=r"records_per_chunk=100 was given.*chunks of 4 documents.*leave"):
        await env.runner(records_per_chunk=100).run_async(documents(1), rank=0)
    await env.runner(records_per_chunk=4).run_async(documents(1), rank=0)
    assert len(env.published()) == 1


GZIPPED = r"'\$\{rank\}_chunk_\$\{chunk_index\}\.jsonl\.gz' \(JsonlWriter's default compression='gzip' adds \.gz\)"
WRITERS: dict[str, tuple[Callable[[Path], Any], str]] = {
    "gzip by default": (
        lambda out: JsonlWriter(str(out), output_filename=TEMPLATE),
        GZIPPED + r".*--output-filename '\$\{rank\}_chunk_\$\{chunk_index\}\.jsonl\.gz'.*compression=None",
    ),
    "a name serve refuses": (
        lambda out: JsonlWriter(str(out), output_filename="${rank}.jsonl", compression=None),
        r"names its files '\$\{rank\}\.jsonl'.*each chunk as a file of its own.*use JsonlWriter\(",
    ),
    "another folder": (
        lambda out: JsonlWriter(str(out.parent / "elsewhere"), output_filename=TEMPLATE, compression=None),
        r"writes to .*elsewhere, but the proxy .* publishes to .*out.*start inferproxy serve with --output",
    ),
    "not JSON lines": (lambda out: TextWriter(str(out), output_filename=TEMPLATE), r"TextWriter.*JSON lines"),
    "expanded metadata": (
        lambda out: JsonlWriter(str(out), output_filename=TEMPLATE, compression=None, expand_metadata=True),
        r"expand_metadata=True",
    ),
}


@pytest.mark.parametrize(("writer", "message"), WRITERS.values(), ids=WRITERS.keys())
async def test_an_output_writer_that_is_not_the_proxys_output_stops_the_task_at_start(
    env: Env, writer: Callable[[Path], Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        await env.runner(output_writer=writer(env.out)).run_async(documents(2), rank=0)
    assert env.upstream.generations == 0


def test_bad_arguments_are_refused_saying_what_to_do(tmp_path: Path) -> None:
    writer = JsonlWriter(str(tmp_path), output_filename=TEMPLATE)
    vllm = InferenceConfig(server_type="vllm", model_name_or_path="m")
    with pytest.raises(ValueError, match="server_type='endpoint'"):
        ProxyInferenceRunner(ask, vllm, writer)
    endpoint = InferenceConfig(server_type="endpoint", endpoint_url="http://127.0.0.1:8080", model_name_or_path="m")
    with pytest.raises(ValueError, match=r"checkpoints at the proxy.*remove the argument"):
        ProxyInferenceRunner(ask, endpoint, writer, checkpoints_local_dir=str(tmp_path))
    with pytest.raises(ValueError, match="records_per_chunk must be positive"):
        ProxyInferenceRunner(ask, endpoint, writer, records_per_chunk=0)
    ftp = InferenceConfig(server_type="endpoint", endpoint_url="ftp://host", model_name_or_path="m")
    with pytest.raises(ValueError, match="http"):
        ProxyInferenceRunner(ask, ftp, writer)
    with pytest.raises(ValueError, match="no checkpoints_local_dir"):
        with_inferproxy_checkpointing(InferenceRunner(ask, endpoint, writer))


def test_the_drop_in_swaps_datatroves_cache_and_checkpoints_for_inferproxys(tmp_path: Path) -> None:
    from app.checkpoints.manager import CheckpointManager, RequestCache

    config = InferenceConfig(server_type="endpoint", endpoint_url="http://127.0.0.1:8080", model_name_or_path="m")
    writer = JsonlWriter(str(tmp_path / "out"), output_filename=TEMPLATE)
    runner = with_inferproxy_checkpointing(
        InferenceRunner(ask, config, writer, checkpoints_local_dir=str(tmp_path / "ck"), records_per_chunk=7)
    )
    assert isinstance(runner.request_cache, RequestCache)
    assert isinstance(runner.checkpoint_manager, CheckpointManager)
    assert runner.checkpoint_manager.request_cache is runner.request_cache
    assert (runner.checkpoint_manager.checkpoints_local_dir, runner.checkpoint_manager.records_per_chunk) == (
        str(tmp_path / "ck"),
        7,
    )


def test_both_runners_survive_the_pickling_datatroves_executors_do(tmp_path: Path) -> None:
    import dill

    config = InferenceConfig(server_type="endpoint", endpoint_url="http://127.0.0.1:8080", model_name_or_path="m")
    writer = JsonlWriter(str(tmp_path / "out"), output_filename=TEMPLATE)
    drop_in = with_inferproxy_checkpointing(
        InferenceRunner(ask, config, writer, checkpoints_local_dir=str(tmp_path / "ck"), records_per_chunk=7)
    )
    copy = dill.loads(dill.dumps(drop_in))
    assert (copy.checkpoint_manager.records_per_chunk, copy.request_cache.base_dir) == (7, str(tmp_path / "ck"))
    proxied = dill.loads(dill.dumps(ProxyInferenceRunner(ask, config, writer, records_per_chunk=7)))
    assert (proxied.proxy_url, proxied.checkpoint_manager.requested_records_per_chunk) == ("http://127.0.0.1:8080", 7)


def test_inferproxys_core_never_imports_datatrove() -> None:
    # Module names from the files (pkgutil.walk_packages would import app.integrations' packages to walk them).
    code = (
        "import importlib, pathlib, sys, app\n"
        "root = pathlib.Path(app.__path__[0])\n"
        "for f in sorted(root.rglob('*.py')):\n"
        "    parts = ('app', *f.relative_to(root).with_suffix('').parts)\n"
        "    if 'integrations' not in parts:\n"
        "        importlib.import_module('.'.join(p for p in parts if p != '__init__'))\n"
        "print(sorted(n for n in sys.modules if n.split('.')[0] in ('datatrove', 'ray')))\n"
        "print(len([n for n in sys.modules if n.startswith('app.')]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    leaked, count = done.stdout.splitlines()
    assert leaked == "[]"
    assert int(count) >= 20  # every core module was imported


def resume_answer(output: Path) -> dict[str, Any]:
    return {
        "records_per_chunk": 10,
        "last_chunk_index": -1,
        "docs_to_skip": 0,
        "processed_ids": [],
        "output": str(output),
        "output_filename": TEMPLATE,
    }


def http_answer(status: int, body: Any, *, retry_after: str | None = None) -> bytes:
    data = json.dumps(body).encode()
    extra = f"retry-after: {retry_after}\r\n" if retry_after is not None else ""
    head = f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {len(data)}\r\n{extra}\r\n"
    return head.encode() + data


@contextlib.asynccontextmanager
async def raw_server(reply: Callable[[str], bytes | None]) -> AsyncIterator[str]:
    """A keep-alive HTTP server answering each request with `reply(path)`'s bytes, or dropping the connection."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
                length = next((int(h.split(":")[1]) for h in head if h.lower().startswith("content-length:")), 0)
                await reader.readexactly(length)
                answer = reply(head[0].split(" ")[1])
                if answer is None:
                    break
                writer.write(answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    async with server:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


@pytest.mark.parametrize(
    ("value", "seconds"), [(b"1.5", 1.5), (b"-3", 0.0), (b"86400", 60.0), (b"inf", 60.0), (b"nan", None), (b"x", None)]
)
def test_a_retry_after_is_honoured_up_to_a_minute(value: bytes, seconds: float | None) -> None:
    # Retry-After: inf (or a day) from a load balancer slept the task for as long.
    from app.integrations.datatrove.runner import retry_after_s

    assert retry_after_s(value) == seconds


async def test_a_rank_owned_elsewhere_fails_the_task_at_once_rather_than_refusing_each_document(
    tmp_path: Path,
) -> None:
    from app.integrations.datatrove import ProxyCheckpointManager
    from app.job.client import RankOwnedElsewhere

    manager = ProxyCheckpointManager("http://127.0.0.1:9")

    class Owned:
        rank = 0

        async def write_document(self, document: Any, chunk_index: int) -> None:
            raise RankOwnedElsewhere(409, "rank 0 is owned by another inferproxy (pid 7 on host n1)")

    manager._job = Owned()  # type: ignore[assignment]
    with pytest.raises(ServerError, match="cannot checkpoint rank 0: rank 0 is owned by another inferproxy"):
        await manager.write_document(Document(text="t", id="a"), 0, 0, None)
    assert manager.refused == []


async def test_a_document_id_that_would_add_headers_is_a_bad_request_not_a_cache_key(env: Env) -> None:
    # "a\r\nX-Rank: 7" went into X-Doc-Id as it was: the answer landed in rank 7's cache (or, with
    # "X-Doc-Id: b", replayed document b's answer).
    hostile = Document(text="t", id="a\r\nX-Rank: 7")
    runner = env.runner(skip_bad_requests=True)
    await runner.run_async([hostile, *documents(2)], rank=0)
    assert sorted(d["id"] for d in env.published()) == ["doc-0", "doc-1"]
    assert runner.stats["skipped_bad_requests"].total == 1
    assert not (env.tmp_path / "ckpt" / "00007").exists()
    assert env.upstream.generations == 4


def test_the_runners_stats_step_keeps_datatroves_name() -> None:
    # Stats looked up by the step's name ("Model call: Inference") missed the proxy's runner.
    assert ProxyInferenceRunner.name == InferenceRunner.name


async def test_a_rank_declares_the_jobs_world_size_and_its_total_at_its_end_so_the_proxy_shows_it_finished(
    tmp_path: Path,
) -> None:
    sent: list[tuple[str, bytes | None, bytes | None]] = []  # (path, X-Total-Documents, X-Total-Ranks)
    async with fake_upstream() as (url, upstream):
        app = create_app(
            Settings(
                upstream=[url], checkpoints_dir=tmp_path / "ckpt", output=str(tmp_path / "out"), records_per_chunk=4
            )
        )

        async def recording(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] == "http" and not scope["path"].startswith(("/v1", "/lookup", "/stats")):
                headers = dict(scope["headers"])
                sent.append((scope["path"], headers.get(b"x-total-documents"), headers.get(b"x-total-ranks")))
            await app(scope, receive, send)

        async with serve_in_loop(recording) as proxy, httpx.AsyncClient(base_url=proxy) as client:
            env = Env(proxy, upstream, tmp_path)
            # As datatrove's executors call a step: run(data, rank, world_size), in a task's own thread.
            # An iterator, as a reader gives it: the rank's total is known only at its end.
            await asyncio.to_thread(env.runner().run, iter(documents(6, "one")), 1, 2)
            assert [(path, ranks) for path, _, ranks in sent if path != "/documents"] == [
                ("/resume", b"2"),
                ("/chunks/1/complete", b"2"),
            ]
            assert {total for path, total, _ in sent if path != "/chunks/1/complete"} == {None}
            assert next(total for path, total, _ in sent if path == "/chunks/1/complete") == b"6"
            stats = (await client.get("/stats")).json()
            [view] = stats["ranks"]
            assert (view["rank"], view["finished"], view["done_documents"], view["total_documents"]) == (1, True, 6, 6)
            assert stats["job"] == {"ranks_declared": 2, "ranks_finished": 1, "finished": False}

            await env.runner().run_async(documents(3, "zero"), rank=0, world_size=2)
            assert (await client.get("/stats")).json()["job"] == {
                "ranks_declared": 2,
                "ranks_finished": 2,
                "finished": True,
            }

            # A rerun of a finished rank, with nothing left to do, completes its last chunk again.
            sent.clear()
            generations = upstream.generations
            await asyncio.to_thread(env.runner().run, iter(documents(6, "one")), 1, 2)
            assert [path for path, _, _ in sent] == ["/resume", "/chunks/1/complete"]
            assert upstream.generations == generations
            assert (await client.get("/stats")).json()["job"]["finished"] is True


def scripted_proxy(tmp_path: Path, documents_answer: bytes, generated: list[str]) -> Callable[[str], bytes | None]:
    """A proxy that resumes rank 0 from nothing, has no /lookup, answers every POST /documents with
    `documents_answer` and every generation with a completion (its path noted in `generated`)."""

    def reply(path: str) -> bytes | None:
        if path == "/resume":
            return http_answer(200, resume_answer(tmp_path / "out"))
        if path == "/documents":
            return documents_answer
        if path == "/lookup":
            return http_answer(404, {"error": {"message": "no lookup"}})
        generated.append(path)
        return http_answer(200, {"choices": [{"message": {"content": "ok"}, "finish_reason": "stop"}], "usage": {}})

    return reply


@pytest.mark.parametrize(
    ("status", "kind", "message"),
    [
        (500, "server_error", "a checkpoint file could not be made durable earlier (EIO); restart inferproxy serve"),
        (503, "output_unavailable", "rank 0: 8 complete chunks wait for the output"),
    ],
)
async def test_a_refusal_of_the_whole_rank_fails_the_task_at_once_not_at_the_end_of_its_input(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, status: int, kind: str, message: str
) -> None:
    """Each was taken for one document's fault: the task generated its whole input, logged each document as not
    in the output, and failed at its end; a 503 past unavailable_wait_s was waited out again by every batch."""
    monkeypatch.setattr(adapter, "ProxyJob", functools.partial(adapter.ProxyJob, unavailable_wait_s=0.5))
    generated: list[str] = []
    answer = http_answer(status, {"error": {"message": message, "type": kind, "code": status}}, retry_after="0")
    async with raw_server(scripted_proxy(tmp_path, answer, generated)) as url:
        env = Env(url, FakeUpstream(), tmp_path)
        config = InferenceConfig(
            server_type="endpoint", endpoint_url=url, model_name_or_path="m", max_concurrent_generations=4,
            metric_interval=3600,
        )  # fmt: skip
        with pytest.raises(ServerError, match=f"cannot checkpoint rank 0: {message[:30]}"):
            await env.runner(config=config).run_async(documents(60), rank=0)
    assert len(generated) <= 8  # the documents in flight when the first was refused, not the 60
