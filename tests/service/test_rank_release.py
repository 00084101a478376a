"""A rank given up by its proxy (its last chunk completed) is given up whole: no cache of it stays open, written
by a proxy that no longer owns it, beside the proxy that takes it next (services.CheckpointRegistry.complete)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from app.service.app import create_app
from app.service.settings import Settings
from app.store import cache as cache_module
from tests.factories import chat_request
from tests.servers import fake_upstream, serve_proxy
from tests.waiting import eventually

RANK = {"X-Rank": "3"}


def settings(tmp_path: Path, upstream: str) -> Settings:
    return Settings(
        upstream=[upstream],
        retry_backoff_s=0.001,
        checkpoints_dir=tmp_path / "ckpt",
        output=str(tmp_path / "out"),
        records_per_chunk=100,
        http="builtin",
    )


async def test_a_request_reopening_a_completed_ranks_cache_claims_the_rank_anew(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cache was reopened (the rank seen as still owned) while `complete` closed it, then the rank let go:
    a second proxy took it and opened the same SQLite file, both answering and storing for it."""
    close = cache_module.RequestCache._close

    async def slow_close(self: Any, delete_file: bool) -> None:  # a flush on a slow shared file system
        await asyncio.sleep(0.3)
        await close(self, delete_file)

    monkeypatch.setattr(cache_module.RequestCache, "_close", slow_close)
    async with fake_upstream() as (upstream, _):
        first = create_app(settings(tmp_path, upstream))
        async with serve_proxy(settings(tmp_path, upstream), first) as url, httpx.AsyncClient(base_url=url) as a:
            document = orjson.dumps({"id": "d0", "text": "t"})
            assert (await a.post("/documents", content=document, headers={**RANK, "X-Chunk-Index": "0"})).is_success
            await a.post("/v1/chat/completions", json=chat_request(), headers={**RANK, "X-Doc-Id": "x"})
            services = first.services
            assert services is not None
            completing = asyncio.create_task(a.post("/chunks/0/complete", headers=RANK))
            await eventually(lambda: services.caches.opened(3) is None, "complete never closed the rank's cache")
            reopening = await a.post("/v1/chat/completions", json=chat_request(), headers={**RANK, "X-Doc-Id": "y"})
            assert ((await completing).json()["last_chunk_index"], reopening.status_code) == (0, 200)
            assert (services.caches.opened(3) is not None) == services.caches.ownership.owns(3)
            second = create_app(settings(tmp_path, upstream))
            async with (
                serve_proxy(settings(tmp_path, upstream), second) as url_b,
                httpx.AsyncClient(base_url=url_b) as b,
            ):
                answers = [
                    await proxy.post("/v1/chat/completions", json=chat_request(), headers={**RANK, "X-Doc-Id": doc})
                    for proxy, doc in ((b, "b"), (a, "a"))
                ]
                assert sorted(answer.status_code for answer in answers) == [200, 409]  # one owner, the other refuses
