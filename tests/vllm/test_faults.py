"""Faults with a real vLLM behind the proxy: vLLM killed mid-stream, its engine dying mid-stream (vLLM's
error event), a client leaving mid-stream, a job killed mid-run. Nothing partial or failed is stored;
what was paid for is kept."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.vllm.helpers import (
    IGNORE_EOS,
    Proxy,
    chat_body,
    events,
    generations_at_least,
    keyed,
    stream_bytes,
)
from tests.vllm.server import VLLM

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
#: ~10 s of generation (the tiny model's engine makes a token every ~5 ms here): a kill or a cancel sent
#: when the first event arrives lands mid-generation with seconds to spare.
LONG_TOKENS = 2000
LONG_STREAM = {"max_tokens": LONG_TOKENS, "stream": True, **IGNORE_EOS}


def stream_killing_after_first_chunk(
    proxy: Proxy, body: dict[str, object], doc_id: str, kill: Callable[[], object]
) -> tuple[bytes, bool]:
    """Stream `body` through the proxy, calling `kill` once the first bytes arrived: (what came, whether
    the proxy cut the client's connection before the stream's end)."""
    with httpx.stream(
        "POST", proxy.url + "/v1/chat/completions", json=body, headers=keyed(doc_id), timeout=120
    ) as answer:
        assert (answer.status_code, answer.headers["X-Cache"]) == (200, "MISS")
        chunks = answer.iter_raw()
        received = next(chunks)
        kill()
        try:
            for chunk in chunks:
                received += chunk
        except httpx.RemoteProtocolError:
            return received, True
    return received, False


def test_vllm_killed_mid_stream_stores_nothing_and_the_restarted_vllm_generates_it(proxy: Proxy, vllm: VLLM) -> None:
    body = chat_body("cut short", **LONG_STREAM)
    received, cut = stream_killing_after_first_chunk(proxy, body, "killed", vllm.kill)
    vllm.start()
    assert cut  # the client learns that its stream is incomplete
    assert b"[DONE]" not in received

    cache, stream = stream_bytes(proxy.url, "/v1/chat/completions", body, keyed("killed"))
    assert cache == "MISS"  # the cut stream was not stored
    assert events(stream)[-1] == "[DONE]"
    assert stream_bytes(proxy.url, "/v1/chat/completions", body, keyed("killed")) == ("HIT", stream)


def test_an_engine_dying_mid_stream_is_passed_on_as_vllms_error_event_and_never_stored(
    proxy: Proxy, vllm: VLLM
) -> None:
    body = chat_body("the engine dies", **LONG_STREAM)
    kill_engine = functools.partial(os.kill, vllm.engine_pid(), signal.SIGKILL)
    received, cut = stream_killing_after_first_chunk(proxy, body, "engine", kill_engine)
    assert vllm.proc is not None
    vllm.proc.wait(timeout=120)  # vLLM's API server exits once its engine is dead
    vllm.kill()
    vllm.start()
    assert not cut
    *chunks, error, done = events(received)
    # vLLM ends the stream with an error event, then [DONE]: a well-formed stream that is no answer
    assert done == "[DONE]"
    assert (error["error"]["code"], error["error"]["type"]) == (500, "InternalServerError"), error
    assert all("choices" in chunk for chunk in chunks)

    cache, stream = stream_bytes(proxy.url, "/v1/chat/completions", body, keyed("engine"))
    assert cache == "MISS"  # the error event was not stored: the request is generated again
    assert events(stream)[-1] == "[DONE]"
    assert b'"error"' not in stream
    assert stream_bytes(proxy.url, "/v1/chat/completions", body, keyed("engine")) == ("HIT", stream)


def test_a_client_leaving_mid_stream_stops_vllms_generation_and_nothing_is_stored(proxy: Proxy, vllm: VLLM) -> None:
    body = chat_body("left behind", **LONG_STREAM)
    tokens, finished = vllm.metric("vllm:generation_tokens_total"), vllm.generations()
    with httpx.stream(
        "POST", proxy.url + "/v1/chat/completions", json=body, headers=keyed("left"), timeout=120
    ) as answer:
        assert answer.headers["X-Cache"] == "MISS"
        next(answer.iter_raw())
    deadline = time.monotonic() + 60
    while vllm.metric("vllm:num_requests_running") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert vllm.metric("vllm:num_requests_running") == 0
    # vLLM's own counts: the generation was aborted (vLLM counts it in no finished request), short of its end
    assert vllm.generations() == finished
    generated = vllm.metric("vllm:generation_tokens_total") - tokens
    assert generated < LONG_TOKENS, f"vLLM generated {generated:g} tokens of {LONG_TOKENS}"
    lookup = httpx.post(proxy.url + "/lookup", json=[{"doc_id": "left", "body": body}], headers={"X-Rank": "0"})
    assert lookup.json() == [None]


N_DOCS, ROLLOUTS, CONCURRENCY = 60, 2, 8


def test_a_job_killed_mid_run_resumes_and_publishes_every_document_exactly_once(proxy: Proxy, vllm: VLLM) -> None:
    before = vllm.generations()
    kills = 0
    finished = False
    for kill_after in (12, 20, None):  # SIGKILL after this many documents acknowledged in the run
        job = subprocess.Popen(
            [sys.executable, "-m", "tests.vllm.job", proxy.url, str(N_DOCS), str(ROLLOUTS), str(CONCURRENCY)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert job.stdout is not None
        acknowledged = 0
        for line in job.stdout:
            if line == "DONE\n":
                finished = True
            elif line.startswith("ACK "):
                acknowledged += 1
                if acknowledged == kill_after:
                    job.send_signal(signal.SIGKILL)
                    kills += 1
                    break
        job.stdout.close()
        assert job.wait(timeout=120) in (0, -signal.SIGKILL)
        if finished:
            break

    assert finished
    assert kills == 2
    published = []
    for chunk in sorted(proxy.output.glob("*.jsonl")):
        published += [json.loads(line) for line in chunk.read_text().splitlines()]
    assert sorted(document["id"] for document in published) == sorted(f"doc-{i}" for i in range(N_DOCS))
    assert all(len(document["metadata"]["rollout_results"]) == ROLLOUTS for document in published)
    # answers generated before a kill come back from the proxy's cache: only what was in flight is paid twice
    generated = generations_at_least(vllm, before + N_DOCS * ROLLOUTS) - before
    assert N_DOCS * ROLLOUTS <= generated <= N_DOCS * ROLLOUTS + kills * CONCURRENCY * ROLLOUTS
