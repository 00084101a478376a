"""A job switched between datatrove's own `InferenceRunner` and `ProxyInferenceRunner` on one checkpoints dir:
the answers one runner cached are the other's, counted at the upstream generation by generation.

Each first run stops part-way as a task that dies does: four documents have their answers (stored in the
cache) but are not written, while the documents before them are (a chunk published, the next one open).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from datatrove.data import Document
from datatrove.pipeline.inference.run_inference import InferenceConfig, InferenceRunner
from datatrove.pipeline.inference.types import InferenceError
from datatrove.pipeline.writers import JsonlWriter

from app.integrations.datatrove import ProxyInferenceRunner
from app.service.settings import Settings
from app.tools.fake_upstream import FakeUpstream
from tests.servers import fake_upstream, serve_proxy

pytestmark = pytest.mark.usefixtures("http_server")

TEMPLATE = "${rank}_chunk_${chunk_index}.jsonl"
RECORDS_PER_CHUNK = 4
ROLLOUTS = 2
DOCUMENTS = 12
#: Answered in the first run but never written: their generations are what a switch must not pay again.
ANSWERED_ONLY = ("doc-6", "doc-7", "doc-8", "doc-9")
#: Never reached by the first run.
NOT_REACHED = ("doc-10", "doc-11")


def documents() -> list[Document]:
    return [Document(text=f"question {i}", id=f"doc-{i}") for i in range(DOCUMENTS)]


async def ask(document: Document, generate: Callable[[dict[str, Any]], Awaitable[Any]]) -> str:
    # The rollout's payload, without `model` or the config's default_generation_params: datatrove keys its
    # cache by this, before it merges them in.
    result = await generate({"messages": [{"role": "user", "content": document.text}]})
    return str(result.text)


def stopping_part_way() -> Callable[[Document, Callable[[dict[str, Any]], Awaitable[Any]]], Awaitable[str]]:
    """A rollout that answers every document, but holds `ANSWERED_ONLY`'s after their answers and fails the
    task once all of theirs are in: as a task that dies with documents in flight, deterministically.

    With `max_concurrent_documents=4`, doc-6..doc-9 are in flight together only once doc-0..doc-5 are
    written; doc-10 waits for a slot that never frees."""
    answered = 0
    all_answered = asyncio.Event()

    async def rollout(document: Document, generate: Callable[[dict[str, Any]], Awaitable[Any]]) -> str:
        nonlocal answered
        text = await ask(document, generate)
        if document.id not in ANSWERED_ONLY:
            return text
        answered += 1
        if answered == len(ANSWERED_ONLY) * ROLLOUTS:
            all_answered.set()
        await all_answered.wait()
        if document.id == ANSWERED_ONLY[-1]:
            raise RuntimeError("the task dies")
        await asyncio.Event().wait()  # cancelled when the task fails
        return text

    return rollout


def config(url: str) -> InferenceConfig:
    return InferenceConfig(
        server_type="endpoint",
        endpoint_url=url,
        model_name_or_path="fake-model",
        rollouts_per_document=ROLLOUTS,
        max_concurrent_documents=len(ANSWERED_ONLY),
        default_generation_params={"max_tokens": 8, "temperature": 0.7},
        metric_interval=3600,
    )


@dataclass
class Job:
    """One job's folders, and the upstream both runners' generations are counted at."""

    upstream_url: str
    upstream: FakeUpstream
    tmp_path: Path

    @property
    def checkpoints(self) -> Path:
        return self.tmp_path / "checkpoints"

    @property
    def output(self) -> Path:
        return self.tmp_path / "output"

    def writer(self) -> JsonlWriter:
        return JsonlWriter(str(self.output), output_filename=TEMPLATE, compression=None)

    def datatroves(self, rollout: Callable[..., Awaitable[Any]]) -> InferenceRunner:
        """datatrove's own runner, straight to the upstream, checkpointing in the job's checkpoints dir."""
        return InferenceRunner(
            rollout,
            config(self.upstream_url),
            self.writer(),
            checkpoints_local_dir=str(self.checkpoints),
            records_per_chunk=RECORDS_PER_CHUNK,
        )

    def proxys(self, proxy_url: str, rollout: Callable[..., Awaitable[Any]]) -> ProxyInferenceRunner:
        return ProxyInferenceRunner(rollout, config(proxy_url), self.writer(), retry_backoff_s=0.01)

    def settings(self) -> Settings:
        return Settings(
            upstream=[self.upstream_url],
            checkpoints_dir=self.checkpoints,
            output=str(self.output),
            records_per_chunk=RECORDS_PER_CHUNK,
        )

    def published_ids(self) -> list[str]:
        return sorted(
            json.loads(line)["id"]
            for path in self.output.glob("*.jsonl")
            for line in path.read_text().splitlines()
            if line.strip()
        )


@pytest.fixture
async def job(tmp_path: Path) -> AsyncIterator[Job]:
    async with fake_upstream() as (url, upstream):
        yield Job(url, upstream, tmp_path)


def assert_stopped_part_way(job: Job) -> None:
    """The first run left chunk 0 published, chunk 1 open with doc-4 and doc-5, and every answer of the
    documents after them in the rank's cache."""
    assert job.upstream.generations == (DOCUMENTS - len(NOT_REACHED)) * ROLLOUTS
    assert (job.checkpoints / "last_chunk" / "00000.txt").read_text().strip() == "0"
    open_chunk = (job.checkpoints / "00000" / "chunk_00001.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["id"] for line in open_chunk) == ["doc-4", "doc-5"]
    assert (job.checkpoints / "00000" / "replay.sqlite3").exists()


async def test_a_job_switched_from_datatroves_runner_to_the_proxys_pays_only_what_datatrove_had_not_cached(
    job: Job,
) -> None:
    with pytest.raises(InferenceError, match="the task dies"):
        await job.datatroves(stopping_part_way()).run_async(documents(), rank=0)
    assert_stopped_part_way(job)
    before = job.upstream.generations

    async with serve_proxy(job.settings()) as proxy:
        runner = job.proxys(proxy, ask)
        await runner.run_async(documents(), rank=0)

    assert job.upstream.generations - before == len(NOT_REACHED) * ROLLOUTS
    assert runner.stats["proxy_cache_hits"].total == len(ANSWERED_ONLY) * ROLLOUTS
    assert job.published_ids() == sorted(d.id for d in documents())


async def test_a_job_switched_back_from_the_proxys_runner_to_datatroves_pays_only_what_the_proxy_had_not_cached(
    job: Job,
) -> None:
    async with serve_proxy(job.settings()) as proxy:
        with pytest.raises(InferenceError, match="the task dies"):
            await job.proxys(proxy, stopping_part_way()).run_async(documents(), rank=0)
    # the proxy stopped: its cache is flushed, the rank's lock released
    assert_stopped_part_way(job)
    before = job.upstream.generations

    runner = job.datatroves(ask)
    await runner.run_async(documents(), rank=0)

    assert job.upstream.generations - before == len(NOT_REACHED) * ROLLOUTS
    assert runner.stats["successful_requests"].total == len(NOT_REACHED) * ROLLOUTS  # the rest replayed
    assert job.published_ids() == sorted(d.id for d in documents())
