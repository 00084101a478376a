"""Jobs through a real proxy, for what watches them (the page, `inferproxy status`)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

from app.client import JobReport, ProxyJob, run_job
from app.documents import Document, DocumentLike
from app.settings import Settings
from tests.factories import chat_request


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
