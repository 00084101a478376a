"""Jobs through a real proxy, for what watches them (the page, `inferproxy status`)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx

from app.client import JobReport, run_job
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
    after generating them), its total declared on `/resume`."""
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
        # An iterator, not a list: run_job must not take its length as the declared total.
        return await run_job(
            iter(docs), rollout, base_url=proxy, rank=rank, api_key=api_key, concurrency=concurrency, progress=False
        )
