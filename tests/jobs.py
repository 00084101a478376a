"""Jobs through a real proxy, for what watches them (the page, `inferproxy status`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

from app.checkpoints.documents import Document, DocumentLike
from app.job.client import ProxyJob
from app.job.run import JobReport, run_job
from app.service.settings import Settings
from tests.factories import chat_request
from tests.servers import fake_upstream, serve_proxy


def settings(tmp_path: Path, upstream: str, **overrides: Any) -> Settings:
    return Settings(
        upstream=[upstream],
        checkpoints_dir=tmp_path / "ckpt",
        output=str(tmp_path / "out"),
        **{"records_per_chunk": 4, **overrides},
    )


async def run_rank(
    proxy: str,
    rank: int,
    documents: int,
    *,
    total: int | None = None,
    cached: int = 0,
    api_key: str | None = None,
    concurrency: int = 32,
) -> JobReport:
    """A job of `documents` on `rank`, its first `cached` answers already in the proxy's cache (a run killed
    after generating them), its total declared on `/resume`. With fewer documents than that total, the job is
    one still running (or killed part way): its documents are written, its last chunk is not completed."""
    auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=proxy, headers=auth, timeout=30) as client:
        if total is not None:
            declared = await client.get("/resume", headers={"X-Rank": str(rank), "X-Total-Documents": str(total)})
            declared.raise_for_status()

        async def rollout(document: DocumentLike, rollout_idx: int, headers: dict[str, str]) -> str:
            body = chat_request(messages=[{"role": "user", "content": document.text}])
            answer = await client.post("/v1/chat/completions", json=body, headers=headers)
            answer.raise_for_status()
            return str(answer.json()["choices"][0]["message"]["content"])

        docs = [Document(id=f"r{rank}-{i}", text=f"question {i} of rank {rank}") for i in range(documents)]
        await asyncio.gather(
            *(rollout(d, 0, {"X-Doc-Id": d.id, "X-Rollout-Idx": "0", "X-Rank": str(rank)}) for d in docs[:cached])
        )
        if total is not None and documents < total:
            return await run_part_way(proxy, rank, docs, rollout, api_key)
        # An iterator, not a list: run_job must not take its length as the declared total.
        return await run_job(
            iter(docs), rollout, base_url=proxy, rank=rank, api_key=api_key, concurrency=concurrency, progress=False
        )


async def run_part_way(
    proxy: str,
    rank: int,
    docs: list[Document],
    rollout: Callable[[DocumentLike, int, dict[str, str]], Awaitable[str]],
    api_key: str | None,
) -> JobReport:
    """`docs` generated and written as `run_job` does, but the last chunk left open: the rank is not finished."""
    job = ProxyJob(proxy, rank, api_key)
    try:
        per_chunk = (await job.resume()).records_per_chunk

        async def one(position: int, document: Document) -> None:
            chunk = position // per_chunk
            document.metadata["rollout_results"] = [await rollout(document, 0, job.headers(document.id, 0, chunk))]
            await job.write_document(document, chunk)

        await asyncio.gather(*(one(position, document) for position, document in enumerate(docs)))
        await job.resume()  # answered once its complete chunks are published: what follows sees them
    finally:
        await job.close()
    return JobReport(documents=len(docs), written=len(docs), last_chunk_index=(len(docs) - 1) // per_chunk)


async def write_chunks(proxy: str, rank: int, chunks: range, per_chunk: int = 4) -> None:
    """Complete chunks of `rank` written through the proxy (`records_per_chunk` documents each)."""
    async with httpx.AsyncClient(base_url=proxy, timeout=30) as client:
        for chunk in chunks:
            docs = [{"id": f"r{rank}-{chunk}-{i}", "text": "t"} for i in range(per_chunk)]
            headers = {"X-Rank": str(rank), "X-Chunk-Index": str(chunk)}
            (await client.post("/documents", json=docs, headers=headers)).raise_for_status()


async def publish_chunks(proxy: str, rank: int, chunks: range) -> None:
    """`write_chunks`, then `GET /resume`, which answers once they are all published."""
    await write_chunks(proxy, rank, chunks)
    async with httpx.AsyncClient(base_url=proxy, timeout=30) as client:
        resumed = await client.get("/resume", headers={"X-Rank": str(rank)})
        assert resumed.json()["last_chunk_index"] == chunks[-1]  # once all of them are published


@contextlib.asynccontextmanager
async def proxy_finding_chunks_lost(tmp_path: Path, rank: int, lost: tuple[int, ...]) -> AsyncIterator[str]:
    """The output loses `lost` of `rank`'s published chunks while no proxy runs; the next proxy (on the same
    dirs, `settings`) finds out when the rank comes back: its `GET /resume` is a 409 `output_lost_error`.
    Yields that proxy's URL."""
    for chunk in lost:
        (tmp_path / "out" / f"{rank:05d}_chunk_{chunk}.jsonl").unlink()
    async with fake_upstream() as (url, _), serve_proxy(settings(tmp_path, url)) as proxy:
        async with httpx.AsyncClient(base_url=proxy, timeout=30) as client:
            refused = await client.get("/resume", headers={"X-Rank": str(rank)})
            assert (refused.status_code, refused.json()["error"]["type"]) == (409, "output_lost_error")
        yield proxy
