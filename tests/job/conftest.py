"""The job tests' proxy: a real one on a loopback port (in this event loop), before a fake upstream."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest

from app.checkpoints.documents import DocumentLike
from app.service.app import create_app
from app.service.settings import Settings
from app.tools.fake_upstream import FakeUpstream
from tests.servers import fake_upstream, serve_in_loop


class Env:
    def __init__(self, proxy: str, upstream: FakeUpstream, tmp_path: Path, heads: list[tuple[str, Any]]) -> None:
        self.proxy = proxy
        self.upstream = upstream
        self.out = tmp_path / "out"
        self.states: list[str] = []
        self.heads = heads  # each request the proxy got: "METHOD /path" and its headers

    def sent(self, route: str, header: bytes) -> list[bytes | None]:
        """The values of `header` in the requests `route` ("GET /resume") got, None where it was absent."""
        return [dict(headers).get(header) for head, headers in self.heads if head == route]

    async def rollout(self, document: DocumentLike, rollout_idx: int, headers: dict[str, str]) -> str:
        async with openai.AsyncOpenAI(base_url=self.proxy + "/v1", api_key="unused", max_retries=0) as client:
            raw = await client.chat.completions.with_raw_response.create(
                model="fake-model",
                messages=[{"role": "user", "content": document.text}],
                max_tokens=4,
                extra_headers=headers,
            )
        self.states.append(raw.headers["x-cache"])
        return raw.parse().choices[0].message.content or ""

    def published(self) -> list[dict[str, Any]]:
        return [json.loads(line) for f in sorted(self.out.glob("*.jsonl")) for line in f.read_text().splitlines()]


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    async with fake_upstream() as (url, upstream):
        settings = Settings(
            upstream=[url], checkpoints_dir=tmp_path / "ckpt", output=str(tmp_path / "out"), records_per_chunk=4
        )
        app = create_app(settings)
        heads: list[tuple[str, Any]] = []

        async def recording(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] == "http":
                heads.append((f"{scope['method']} {scope['path']}", scope["headers"]))
            await app(scope, receive, send)

        async with serve_in_loop(recording) as proxy:
            yield Env(proxy, upstream, tmp_path, heads)
