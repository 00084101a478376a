"""`inferproxy fake-upstream`: a vLLM-shaped OpenAI-compatible server for demos, tests and benchmarks.

Routes: `GET /v1/models`, `POST /v1/chat/completions`, `POST /v1/completions`
(both with SSE streaming and `stream_options.include_usage`), `POST /v1/embeddings`,
and vLLM's routes outside `/v1`: `GET /health`, `GET|POST /ping`, `GET /version`, `POST /tokenize` (one token
per word), `POST /detokenize`; errors in vLLM's envelope. Every generation draws new words,
so two generations of one payload differ, as with sampling at temperature > 0.

Faults are asked for per request, in the body, under the key `fake_upstream`
(vLLM ignores unknown fields; the key is part of the payload hash):

    {"status": 500}                  answer this error instead
    {"status": 503, "fail_times": 2, "retry_after": 1}
                                     the first 2 identical requests fail, then it answers
    {"latency_ms": 200}              before the first byte (also `--latency-ms`)
    {"chunk_delay_ms": 50}           between streamed chunks (a slow stream)
    {"disconnect_after_chunks": 3}   drop the connection mid-stream
    {"error_event_after_chunks": 3}  end the stream with an error event, then `data: [DONE]`, as vLLM does
                                     when its engine fails mid-generation
    {"error_with_status": 200}       answer the error envelope with this (2xx) status, as a broken server may

`GET /_fake/stats` counts requests and generations and shows the last
request's headers, the proxy's health probes (`PROBE_USER_AGENT`) left out;
`POST /_fake/reset` zeroes them.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections import Counter
from http import HTTPStatus
from typing import Any

import orjson

from app.service.asgi import JSON_HEADERS as JSON
from app.service.asgi import Receive, Scope, Send, lifespan_noop, read_body, send_bytes
from app.service.upstream import PROBE_USER_AGENT
from app.store.hashing import payload_hash

MAX_MODEL_LEN = 8192
MAX_BODY_BYTES = 1 << 30  # a simulator: any body a test sends
WORDS = [
    "the",
    "a",
    "model",
    "token",
    "answer",
    "data",
    "batch",
    "chunk",
    "rollout",
    "sample",
    "proxy",
    "cache",
    "replay",
    "resume",
    "gpu",
    "fast",
    "because",
    "therefore",
    "however",
    "question",
    "result",
    "document",
    "output",
    "writes",
    "reads",
    "every",
    "each",
]
SSE = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


class FakeUpstream:
    """The ASGI app. `latency_ms` delays every answer; `model` is the one model served."""

    def __init__(self, *, latency_ms: float = 0.0, model: str = "fake-model") -> None:
        self.latency = latency_ms / 1000.0
        self.model = model
        self.requests = 0
        self.generations = 0
        self.by_path: Counter[str] = Counter()
        self.last_headers: dict[str, str] = {}
        self._attempts: Counter[str] = Counter()
        self._ids = itertools.count()
        self._rng = random.Random()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan_noop(receive, send)
            return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if not path.startswith("/_fake/") and (b"user-agent", PROBE_USER_AGENT) not in scope["headers"]:
            self.requests += 1
            target = (scope.get("raw_path") or path.encode()).decode("latin-1")
            if scope.get("query_string"):
                target += "?" + scope["query_string"].decode("latin-1")
            self.by_path[f"{method} {target}"] += 1
            self.last_headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        if method == "GET" and path == "/v1/models":
            await send_bytes(send, 200, JSON, self.models())
        elif (method == "GET" and path == "/health") or (method in ("GET", "POST") and path == "/ping"):
            await send_bytes(send, 200, JSON, b"")
        elif method == "GET" and path == "/version":
            await send_bytes(send, 200, JSON, b'{"version":"fake"}')
        elif method == "POST" and path in ("/tokenize", "/detokenize"):
            await self.tokens(path, await read_body(scope, receive, MAX_BODY_BYTES), send)
        elif method == "GET" and path == "/_fake/stats":
            stats = {
                "requests": self.requests,
                "generations": self.generations,
                "by_path": dict(self.by_path),
                "last_headers": self.last_headers,
            }
            await send_bytes(send, 200, JSON, orjson.dumps(stats))
        elif method == "POST" and path == "/_fake/reset":
            self.requests = self.generations = 0
            self.by_path.clear()
            self._attempts.clear()
            await send_bytes(send, 200, JSON, b"{}")
        elif method == "POST" and path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings"):
            await self.generate(path, await read_body(scope, receive, MAX_BODY_BYTES), send)
        else:
            await send_bytes(send, 404, JSON, vllm_error(f"Not Found: {method} {path}", "NotFoundError", 404))

    async def tokens(self, path: str, raw: bytes, send: Send) -> None:
        """vLLM's `/tokenize` and `/detokenize`, one token per word (its id: the word's place in `WORDS`, or 0)."""
        body = await json_object(raw, send)
        if body is None:
            return
        if path == "/detokenize":
            words = [WORDS[t] if isinstance(t, int) and 0 <= t < len(WORDS) else "?" for t in body.get("tokens", [])]
            await send_bytes(send, 200, JSON, orjson.dumps({"prompt": " ".join(words)}))
            return
        text = body.get("prompt") or " ".join(str(m.get("content", "")) for m in body.get("messages", []))
        tokens = [WORDS.index(w) if w in WORDS else 0 for w in str(text).split()]
        answer = {"count": len(tokens), "max_model_len": MAX_MODEL_LEN, "tokens": tokens, "token_strs": None}
        await send_bytes(send, 200, JSON, orjson.dumps(answer))

    def models(self) -> bytes:
        card = {
            "id": self.model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "vllm",
            "root": self.model,
            "parent": None,
            "max_model_len": MAX_MODEL_LEN,
        }
        return orjson.dumps({"object": "list", "data": [card]})

    async def generate(self, path: str, raw: bytes, send: Send) -> None:
        body = await json_object(raw, send)
        if body is None:
            return
        fault = body.get("fake_upstream")
        if fault is None:  # only null or absent is "no fault": `[]`, `0`, `""` are mistakes, refused below
            fault = {}
        problem = fault_problem(fault, streamed=bool(body.get("stream")))
        if problem is not None:  # a test asking for a fault that never happens would pass for nothing
            await send_bytes(send, 400, JSON, vllm_error(problem, "BadRequestError", 400))
            return
        await asyncio.sleep(float(fault.get("latency_ms", self.latency * 1000)) / 1000.0)
        status = int(fault.get("status", 200))
        if status != 200 and self._attempts[payload_hash(body)] < int(fault.get("fail_times", 1 << 30)):
            self._attempts[payload_hash(body)] += 1
            headers = list(JSON)
            if "retry_after" in fault:
                headers.append((b"retry-after", str(fault["retry_after"]).encode()))
            await send_bytes(
                send, status, headers, vllm_error(f"injected failure {status}", error_type(status), status)
            )
            return
        error = self.validate(path, body)
        if error is not None:
            await send_bytes(send, error[0], JSON, error[1])
            return
        self.generations += 1
        if "error_with_status" in fault:
            message = vllm_error("injected error in a 2xx", "InternalServerError", 500)
            await send_bytes(send, int(fault["error_with_status"]), JSON, message)
        elif path == "/v1/embeddings":
            await send_bytes(send, 200, JSON, self.embeddings(body))
        elif body.get("stream"):
            await self.stream(path, body, fault, send)
        else:
            await send_bytes(send, 200, JSON, self.completion(path, body))

    def validate(self, path: str, body: dict[str, Any]) -> tuple[int, bytes] | None:
        model = body.get("model", self.model)
        if model != self.model:
            return 404, vllm_error(f"The model `{model}` does not exist.", "NotFoundError", 404)
        if path == "/v1/chat/completions" and not isinstance(body.get("messages"), list):
            return 400, vllm_error("messages: Field required", "BadRequestError", 400)
        if path == "/v1/completions" and "prompt" not in body:
            return 400, vllm_error("prompt: Field required", "BadRequestError", 400)
        max_tokens = body.get("max_tokens", body.get("max_completion_tokens", 16))
        if not isinstance(max_tokens, int) or max_tokens < 1:
            return 400, vllm_error("max_tokens must be at least 1", "BadRequestError", 400)
        if max_tokens + self.prompt_tokens(body) > MAX_MODEL_LEN:
            requested = max_tokens + self.prompt_tokens(body)
            message = (
                f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you requested "
                f"{requested} tokens. Please reduce the length of the messages or completion."
            )
            return 400, vllm_error(message, "BadRequestError", 400)
        return None

    @staticmethod
    def prompt_tokens(body: dict[str, Any]) -> int:
        prompt = body.get("messages", body.get("prompt", body.get("input", "")))
        return max(1, len(orjson.dumps(prompt)) // 4)

    def words(self, body: dict[str, Any]) -> list[str]:
        count = min(int(body.get("max_tokens", body.get("max_completion_tokens", 16))), 4096)
        return [self._rng.choice(WORDS) for _ in range(count)]

    def usage(self, body: dict[str, Any], completion: int) -> dict[str, Any]:
        prompt = self.prompt_tokens(body)
        return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion}

    def completion(self, path: str, body: dict[str, Any]) -> bytes:
        n = int(body.get("n", 1))
        chat = path == "/v1/chat/completions"
        choices, produced = [], 0
        for index in range(n):
            words = self.words(body)
            produced += len(words)
            text = " ".join(words)
            finish = "length"
            if chat:
                message: dict[str, Any] = {
                    "role": "assistant",
                    "content": text,
                    "tool_calls": [],
                    "reasoning_content": None,
                }
                choices.append({"index": index, "message": message, "logprobs": None, "finish_reason": finish})
            else:
                choices.append({"index": index, "text": text, "logprobs": None, "finish_reason": finish})
        answer = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{next(self._ids):x}{self._rng.getrandbits(48):012x}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": choices,
            "usage": self.usage(body, produced),
        }
        return orjson.dumps(answer)

    async def stream(self, path: str, body: dict[str, Any], fault: dict[str, Any], send: Send) -> None:
        chat = path == "/v1/chat/completions"
        answer_id = f"{'chatcmpl' if chat else 'cmpl'}-{next(self._ids):x}{self._rng.getrandbits(48):012x}"
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        delay = float(fault.get("chunk_delay_ms", 0)) / 1000.0
        cut_after = fault.get("disconnect_after_chunks")
        error_after = fault.get("error_event_after_chunks")
        words = self.words(body)

        def event(choice: dict[str, Any], **extra: Any) -> bytes:
            chunk = {"id": answer_id, "object": obj, "created": created, "model": self.model, "choices": [choice]}
            return b"data: " + orjson.dumps({**chunk, **extra}) + b"\n\n"

        await send({"type": "http.response.start", "status": 200, "headers": SSE})
        events = []
        if chat:
            events.append(event({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}))
        for i, word in enumerate(words):
            piece = word if i == 0 else " " + word
            last = "length" if i == len(words) - 1 else None
            choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
            events.append(event({**choice, "logprobs": None, "finish_reason": last}))
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"id": answer_id, "object": obj, "created": created, "model": self.model, "choices": []}
            events.append(b"data: " + orjson.dumps({**usage, "usage": self.usage(body, len(words))}) + b"\n\n")
        events.append(b"data: [DONE]\n\n")
        if error_after is not None:
            error = vllm_error("injected engine failure mid-stream", "InternalServerError", 500)
            events[int(error_after) :] = [b"data: " + error + b"\n\n", b"data: [DONE]\n\n"]
        for sent, data in enumerate(events):
            if cut_after is not None and sent >= int(cut_after):
                raise ConnectionAbortedError("injected mid-stream disconnect")  # the server drops the connection
            if delay and sent:
                await asyncio.sleep(delay)
            await send({"type": "http.response.body", "body": data, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def embeddings(self, body: dict[str, Any]) -> bytes:
        inputs = body.get("input", "")
        items = inputs if isinstance(inputs, list) else [inputs]
        data = [
            {"index": i, "object": "embedding", "embedding": [round(self._rng.uniform(-1, 1), 6) for _ in range(8)]}
            for i in range(len(items))
        ]
        answer = {
            "id": f"embd-{next(self._ids):x}",
            "object": "list",
            "created": int(time.time()),
            "model": self.model,
            "data": data,
            "usage": {**self.usage(body, 0), "completion_tokens": 0},
        }
        return orjson.dumps(answer)


#: the faults a request may ask for under `fake_upstream`: name -> (integers only, least, most)
FAULTS: dict[str, tuple[bool, int, int]] = {
    "latency_ms": (False, 0, 3_600_000),
    "status": (True, 200, 599),
    "fail_times": (True, 0, 1 << 30),
    "retry_after": (False, 0, 86_400),
    "error_with_status": (True, 200, 599),
    "chunk_delay_ms": (False, 0, 3_600_000),
    "disconnect_after_chunks": (True, 0, 1 << 30),
    "error_event_after_chunks": (True, 0, 1 << 30),
}


#: the faults that act between the chunks of a streamed answer: on any other they would never happen
STREAM_FAULTS = ("chunk_delay_ms", "disconnect_after_chunks", "error_event_after_chunks")


def fault_problem(fault: Any, streamed: bool = True) -> str | None:
    """What is wrong with a request's `fake_upstream` object, if anything (`streamed`: the request asks
    for a stream)."""
    if not isinstance(fault, dict):
        return f"fake_upstream must be an object of faults ({', '.join(FAULTS)})"
    unknown = sorted(set(fault) - set(FAULTS))
    if unknown:
        return f"fake_upstream: unknown fault {', '.join(map(repr, unknown))}; the faults are {', '.join(FAULTS)}"
    for name, value in fault.items():
        integer, least, most = FAULTS[name]
        kind = int if integer else int | float
        if isinstance(value, bool) or not isinstance(value, kind) or not least <= value <= most:
            wanted = "an integer" if integer else "a number"
            return f"fake_upstream: {name} must be {wanted} from {least:,} to {most:,}, not {value!r}"
    if fault.get("error_with_status") in (204, 304):  # sent without a body: the error would never be seen
        return f"fake_upstream: error_with_status {fault['error_with_status']} cannot carry the error it injects"
    stream_only = [name for name in STREAM_FAULTS if name in fault]
    if stream_only and not streamed:
        return (
            f"fake_upstream: {', '.join(stream_only)} act(s) on streamed answers only: this request has no stream: true"
        )
    return None


async def json_object(raw: bytes, send: Send) -> dict[str, Any] | None:
    """The request body as a JSON object, or None once vLLM's 400 for it is sent."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        await send_bytes(send, 400, JSON, vllm_error(f"Invalid JSON body: {exc}", "BadRequestError", 400))
        return None
    if not isinstance(body, dict):
        await send_bytes(send, 400, JSON, vllm_error("The body must be a JSON object", "BadRequestError", 400))
        return None
    return body


def error_type(status: int) -> str:
    """The `type` vLLM gives an error of this status: its exception's name."""
    if status >= 500:
        return "InternalServerError"
    return {400: "BadRequestError", 404: "NotFoundError"}.get(status) or HTTPStatus(status).phrase.replace(
        " ", ""
    ) + "Error"


def vllm_error(message: str, type_: str, code: int) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}})
