"""The proxy in front of a real vLLM: what vLLM answers is what the client gets, generated once and
replayed byte for byte; vLLM's own routes pass through unchanged."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai
import orjson
import pytest
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionChunk

from tests.vllm.helpers import (
    IGNORE_EOS,
    Proxy,
    async_openai_client,
    chat_body,
    events,
    expect_generations,
    keyed,
    openai_client,
    stream_bytes,
)
from tests.vllm.server import MODEL, VLLM
from tests.vllm.tiny_model import MAX_MODEL_LEN

pytestmark = pytest.mark.e2e


def test_chat_completion_is_generated_once_then_replayed_byte_identical(proxy: Proxy, vllm: VLLM) -> None:
    client = openai_client(proxy.url)
    before = vllm.generations()

    def ask() -> Any:
        return client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=[{"role": "user", "content": "the cache proxy"}],
            max_tokens=12,
            extra_headers=keyed("chat"),
            extra_body=IGNORE_EOS,
        )

    first, second = ask(), ask()
    assert (first.headers["X-Cache"], second.headers["X-Cache"]) == ("MISS", "HIT")
    assert second.content == first.content
    answer = second.parse()
    assert answer.model == MODEL
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage is not None
    assert answer.usage.completion_tokens == 12
    expect_generations(vllm, before + 1)


def test_completion_is_generated_once_then_replayed_byte_identical(proxy: Proxy, vllm: VLLM) -> None:
    client = openai_client(proxy.url)
    before = vllm.generations()

    def ask() -> Any:
        return client.completions.with_raw_response.create(
            model=MODEL, prompt="the job", max_tokens=8, extra_headers=keyed("completion"), extra_body=IGNORE_EOS
        )

    first, second = ask(), ask()
    assert (first.headers["X-Cache"], second.headers["X-Cache"]) == ("MISS", "HIT")
    assert second.content == first.content
    answer = second.parse()
    assert answer.object == "text_completion"
    assert answer.choices[0].text
    expect_generations(vllm, before + 1)


@pytest.mark.parametrize("include_usage", [False, True])
def test_a_stream_is_replayed_byte_identical_with_or_without_its_usage_chunk(
    proxy: Proxy, vllm: VLLM, include_usage: bool
) -> None:
    options = chat_body("the stream", max_tokens=10, stream=True)
    if include_usage:
        options["stream_options"] = {"include_usage": True}
    body = {**options, **IGNORE_EOS}
    doc = f"stream-usage-{include_usage}"
    first = stream_bytes(proxy.url, "/v1/chat/completions", body, keyed(doc))
    second = stream_bytes(proxy.url, "/v1/chat/completions", body, keyed(doc))
    assert (first[0], second[0]) == ("MISS", "HIT")
    assert second[1] == first[1]

    *chunks, done = events(first[1])
    assert done == "[DONE]"
    parsed = [ChatCompletionChunk.model_validate(chunk) for chunk in chunks]
    if include_usage:  # vLLM's usage chunk: the last before [DONE], with no choices
        *parsed, usage_chunk = parsed
        assert usage_chunk.choices == []
        assert usage_chunk.usage is not None
        assert usage_chunk.usage.completion_tokens == 10
    assert all(chunk.usage is None for chunk in parsed)
    assert parsed[-1].choices[0].finish_reason == "length"

    # the openai client reads the replayed stream as it reads vLLM's own
    replayed = openai_client(proxy.url).chat.completions.create(
        **options, extra_headers=keyed(doc), extra_body=IGNORE_EOS
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in replayed if chunk.choices)
    assert text == "".join(chunk.choices[0].delta.content or "" for chunk in parsed)


def test_n_choices_are_stored_and_replayed_together(proxy: Proxy) -> None:
    client = openai_client(proxy.url)

    def ask() -> Any:
        return client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=[{"role": "user", "content": "three answers"}],
            n=3,
            temperature=1.0,
            max_tokens=10,
            extra_headers=keyed("n"),
            extra_body=IGNORE_EOS,
        )

    first, second = ask(), ask()
    assert (first.headers["X-Cache"], second.headers["X-Cache"]) == ("MISS", "HIT")
    assert second.content == first.content
    choices = second.parse().choices
    assert [choice.index for choice in choices] == [0, 1, 2]
    assert len({choice.message.content for choice in choices}) == 3


def test_logprobs_are_replayed_with_the_answer(proxy: Proxy) -> None:
    client = openai_client(proxy.url)

    def chat() -> Any:
        return client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=[{"role": "user", "content": "the tokens"}],
            max_tokens=6,
            logprobs=True,
            top_logprobs=2,
            extra_headers=keyed("logprobs-chat"),
            extra_body=IGNORE_EOS,
        )

    def complete() -> Any:
        return client.completions.with_raw_response.create(
            model=MODEL,
            prompt="the tokens",
            max_tokens=6,
            logprobs=2,
            extra_headers=keyed("logprobs"),
            extra_body=IGNORE_EOS,
        )

    for ask in (chat, complete):
        first, second = ask(), ask()
        assert (first.headers["X-Cache"], second.headers["X-Cache"]) == ("MISS", "HIT")
        assert second.content == first.content
    logprobs = chat().parse().choices[0].logprobs
    assert logprobs is not None
    assert logprobs.content is not None
    assert len(logprobs.content) == 6
    assert all(len(token.top_logprobs) == 2 for token in logprobs.content)
    completion_logprobs = complete().parse().choices[0].logprobs
    assert completion_logprobs is not None
    assert completion_logprobs.tokens is not None
    assert len(completion_logprobs.tokens) == 6


def test_rollouts_at_temperature_1_differ_and_each_replays_byte_identical(proxy: Proxy) -> None:
    body = chat_body("one rollout", max_tokens=16, temperature=1.0, **IGNORE_EOS)

    def ask(rollout_idx: int) -> httpx.Response:
        answer = httpx.post(
            proxy.url + "/v1/chat/completions", json=body, headers=keyed("rollouts", rollout_idx), timeout=120
        )
        assert answer.status_code == 200, answer.text
        return answer

    first = [ask(rollout_idx) for rollout_idx in range(3)]
    assert [answer.headers["X-Cache"] for answer in first] == ["MISS"] * 3
    texts = [answer.json()["choices"][0]["message"]["content"] for answer in first]
    assert len(set(texts)) == 3, texts
    again = [ask(rollout_idx) for rollout_idx in range(3)]
    assert [answer.headers["X-Cache"] for answer in again] == ["HIT"] * 3
    assert [answer.content for answer in again] == [answer.content for answer in first]


def test_a_prompt_over_the_context_gets_vllms_400_stored_and_replayed(proxy: Proxy, vllm: VLLM) -> None:
    client = openai_client(proxy.url)
    prompt = "the " * (MAX_MODEL_LEN + 10)
    errors = []
    for _ in range(2):
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, extra_headers=keyed("too-long"))
        errors.append(caught.value.response)
    assert [error.headers["X-Cache"] for error in errors] == ["MISS", "HIT"]
    assert errors[1].content == errors[0].content
    error = orjson.loads(errors[0].content)["error"]
    assert (error["code"], error["type"]) == (400, "BadRequestError")
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in error["message"]


def test_an_unknown_model_gets_vllms_404_passed_on_and_never_stored(proxy: Proxy) -> None:
    client = openai_client(proxy.url)
    for _ in range(2):
        with pytest.raises(openai.NotFoundError) as caught:
            client.chat.completions.create(
                model="no-such-model", messages=[{"role": "user", "content": "the"}], extra_headers=keyed("404")
            )
        assert caught.value.response.headers["X-Cache"] == "MISS"
    error = orjson.loads(caught.value.response.content)["error"]
    assert (error["code"], error["type"]) == (404, "NotFoundError")


async def test_identical_concurrent_requests_cost_one_generation(proxy: Proxy, vllm: VLLM) -> None:
    before = vllm.generations()

    async def ask(client: AsyncOpenAI) -> Any:
        return await client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=[{"role": "user", "content": "all at once"}],
            max_tokens=1000,  # long enough for the requests to meet in flight
            extra_headers=keyed("coalesced"),
            extra_body=IGNORE_EOS,
        )

    async with async_openai_client(proxy.url) as client:
        answers = await asyncio.gather(*(ask(client) for _ in range(4)))
    outcomes = sorted(answer.headers["X-Cache"] for answer in answers)
    assert outcomes.count("MISS") == 1, outcomes
    assert "COALESCED" in outcomes, outcomes
    assert set(outcomes) <= {"MISS", "COALESCED", "HIT"}, outcomes
    assert len({answer.content for answer in answers}) == 1
    expect_generations(vllm, before + 1)


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/health", None),
        ("GET", "/ping", None),
        ("GET", "/version", None),
        ("POST", "/tokenize", {"model": MODEL, "prompt": "the cache proxy"}),
        ("POST", "/detokenize", {"model": MODEL, "tokens": [6, 12, 13]}),
    ],
)
def test_vllms_routes_outside_v1_pass_through_unchanged(
    proxy: Proxy, vllm: VLLM, method: str, path: str, body: dict[str, Any] | None
) -> None:
    direct = httpx.request(method, vllm.url + path, json=body, timeout=30)
    proxied = httpx.request(method, proxy.url + path, json=body, timeout=30)
    assert direct.status_code == 200
    assert (proxied.status_code, proxied.content) == (direct.status_code, direct.content)
    assert proxied.headers.get("content-type") == direct.headers.get("content-type")


def test_the_models_route_names_the_served_model(proxy: Proxy) -> None:
    models = openai_client(proxy.url).models.list()
    assert [model.id for model in models.data] == [MODEL]
