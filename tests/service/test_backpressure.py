"""Backpressure toward the upstream: `max_inflight_per_upstream` slots, `max_queued_requests` waiting, then 429."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import openai
import pytest

from app.service.errors import UpstreamBusy
from app.service.settings import Settings
from app.service.upstream import Slots
from tests.factories import chat_request, doc_headers
from tests.servers import fake_upstream, serve_proxy


async def test_slots_are_handed_over_in_order_and_refused_past_the_queue() -> None:
    slots = Slots(capacity=2, queue=2)
    await slots.acquire()
    await slots.acquire()
    order: list[str] = []

    async def wait(name: str) -> None:
        await slots.acquire()
        order.append(name)

    first, second = asyncio.create_task(wait("first")), asyncio.create_task(wait("second"))
    await asyncio.sleep(0)
    with pytest.raises(UpstreamBusy) as refused:
        await slots.acquire()
    assert refused.value.status == 429
    assert (b"retry-after", b"1") in refused.value.headers
    slots.release()
    slots.release()
    await asyncio.gather(first, second)
    assert order == ["first", "second"]
    assert slots.held == 2


async def test_a_cancelled_waiter_leaves_the_queue_and_loses_no_slot() -> None:
    slots = Slots(capacity=1, queue=4)
    await slots.acquire()
    gone = asyncio.create_task(slots.acquire())
    await asyncio.sleep(0)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert not slots.waiters
    slots.release()
    assert slots.held == 0
    await slots.acquire()  # the slot is free again
    # Handed over and cancelled in the same turn: the slot passes on instead of leaking.
    handed = asyncio.create_task(slots.acquire())
    await asyncio.sleep(0)
    slots.release()
    handed.cancel()
    with pytest.raises(asyncio.CancelledError):
        await handed
    assert slots.held == 0


async def test_waiters_cancelled_together_leave_no_error_and_no_slot_behind() -> None:
    """The tester's case: clients queued for a slot leave at once, while the holder releases."""
    slots = Slots(capacity=1, queue=4)
    await slots.acquire()
    waiters = [asyncio.create_task(slots.acquire()) for _ in range(3)]
    await asyncio.sleep(0)
    for waiter in waiters:
        waiter.cancel()
    slots.release()  # drops the cancelled waiters from the queue before their tasks run
    outcomes = await asyncio.gather(*waiters, return_exceptions=True)
    assert all(isinstance(outcome, asyncio.CancelledError) for outcome in outcomes), outcomes
    assert slots.held == 0
    assert not slots.waiters


async def test_no_limit_means_no_waiting_and_no_refusal() -> None:
    slots = Slots(capacity=0, queue=0)
    for _ in range(1000):
        await slots.acquire()
    assert slots.held == 0
    assert not slots.waiters


@pytest.mark.usefixtures("http_server")
async def test_past_the_slots_and_the_queue_a_request_gets_429_with_retry_after(tmp_path: Path) -> None:
    async with fake_upstream(latency_ms=400) as (url, upstream):
        settings = Settings(
            upstream=[url], checkpoints_dir=tmp_path / "ckpt", max_inflight_per_upstream=1, max_queued_requests=1
        )
        async with serve_proxy(settings) as proxy, httpx.AsyncClient(base_url=proxy, timeout=30) as client:
            answers = await asyncio.gather(
                *(
                    client.post("/v1/chat/completions", json=chat_request(), headers=doc_headers(f"d{i}"))
                    for i in range(4)
                )
            )
            stats = (await client.get("/stats")).json()
    statuses = sorted(a.status_code for a in answers)
    assert statuses == [200, 200, 429, 429]
    busy = next(a for a in answers if a.status_code == 429)
    assert busy.headers["retry-after"] == "1"
    assert busy.json()["error"]["type"] == "rate_limit_error"
    assert "max_inflight_per_upstream" in busy.json()["error"]["message"]
    assert upstream.generations == 2
    assert stats["queued"] == 0
    assert stats["totals"]["misses"] == 2  # a request refused with 429 was not generated: no miss


async def test_the_openai_client_honours_the_429_and_every_request_gets_its_answer(tmp_path: Path) -> None:
    async with fake_upstream(latency_ms=100) as (url, upstream):
        settings = Settings(
            upstream=[url], checkpoints_dir=tmp_path / "ckpt", max_inflight_per_upstream=1, max_queued_requests=0
        )
        async with (
            serve_proxy(settings) as proxy,
            openai.AsyncOpenAI(base_url=proxy + "/v1", api_key="x", max_retries=8) as client,
        ):
            answers = await asyncio.gather(
                *(
                    client.chat.completions.create(
                        model="fake-model",
                        messages=[{"role": "user", "content": "q"}],
                        extra_headers=doc_headers(f"d{i}"),
                    )
                    for i in range(3)
                )
            )
    assert len({a.id for a in answers}) == 3
    assert upstream.generations == 3
