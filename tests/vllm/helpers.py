"""What the vLLM suite's tests share: clients of the proxy, raw streams, and vLLM's generation count."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
from openai import AsyncOpenAI, OpenAI

from tests.vllm.server import MODEL, VLLM

#: vLLM's own sampling option: never stop before max_tokens, so that lengths are known and streams long.
IGNORE_EOS = {"ignore_eos": True}


@dataclass
class Proxy:
    url: str
    checkpoints: Path
    output: Path


#: The OpenAI clients a test made, closed at its end (`close_clients`): left to the garbage collector, their
#: sockets were found unclosed in whichever later test it ran in, a ResourceWarning failing that one.
_OPENED: list[OpenAI] = []


def openai_client(url: str) -> OpenAI:
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, default_headers={"X-Rank": "0"})
    _OPENED.append(client)
    return client


def close_clients() -> None:
    while _OPENED:
        _OPENED.pop().close()


def async_openai_client(url: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, default_headers={"X-Rank": "0"})


def chat_body(content: str, **options: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **options}


def keyed(doc_id: str, rollout_idx: int = 0) -> dict[str, str]:
    return {"X-Rank": "0", "X-Doc-Id": doc_id, "X-Rollout-Idx": str(rollout_idx)}


def stream_bytes(url: str, path: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[str, bytes]:
    """A streamed answer through the proxy, read to its end: (X-Cache, every byte as it came)."""
    with httpx.stream("POST", url + path, json=body, headers=headers, timeout=120) as answer:
        assert answer.status_code == 200, answer.read()
        return answer.headers["X-Cache"], answer.read()


def events(stream: bytes) -> list[Any]:
    """The `data:` payloads of an SSE stream, JSON-decoded but for the final `[DONE]`."""
    payloads = [line[5:].strip() for line in stream.split(b"\n") if line.startswith(b"data:")]
    return [payload.decode() if payload == b"[DONE]" else orjson.loads(payload) for payload in payloads]


def generations_at_least(vllm: VLLM, expected: float) -> float:
    """vLLM's count of finished requests once it reaches `expected` (it may trail the answers by a moment)."""
    deadline = time.monotonic() + 10
    while (count := vllm.generations()) < expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return count


def expect_generations(vllm: VLLM, expected: float) -> None:
    count = generations_at_least(vllm, expected)
    assert count == expected, f"vLLM finished {count:g} requests, {expected:g} expected"
