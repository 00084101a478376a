"""CPU per cache hit inside one process, without sockets: where the proxy's own microseconds go.

    python bench/profile_hit.py [--requests 200000] [--profile]

The real app (`create_app`) and the built-in server's connection, fed pipelined hits through a
transport that only counts bytes; the cache holds `--documents` answers of rank 0. It measures the
proxy's Python and SQLite work per hit (no kernel, no client), to compare changes to the hit path
quickly; `bench_proxy.py` measures the whole thing with wrk. `--profile` prints cProfile's top.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import tempfile
import time
from pathlib import Path
from typing import Any

from app.http.connection import HTTPConnection
from app.service.app import create_server
from app.service.settings import Settings
from app.store.cache import StoredResponse
from app.store.hashing import payload_hash

BODY = b'{"model":"fake-model","messages":[{"role":"user","content":"Tell me about caching."}],"max_tokens":16}'
ANSWER = b'{"id":"x","object":"chat.completion","choices":[{"message":{"content":"' + b"word " * 16 + b'"}}]}'


class CountingTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def write(self, data: Any) -> None:
        self.bytes += len(data)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 40000), "sockname": ("127.0.0.1", 8080)}.get(name, default)

    def is_closing(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        return 0

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass


def request(doc: int) -> bytes:
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8080\r\nContent-Type: application/json\r\n"
        b"X-Doc-Id: bench-%d\r\nContent-Length: %d\r\n\r\n%b" % (doc, len(BODY), BODY)
    )


async def main(requests: int, documents: int, profile: bool) -> None:
    root = Path(tempfile.mkdtemp(prefix="profile-hit-"))
    settings = Settings(checkpoints_dir=root, upstream=["http://127.0.0.1:9"], rank_idle_s=0, port=0)
    server = create_server(settings)
    await server.start()
    app = server.app
    services = app.services  # type: ignore[attr-defined]
    cache = await services.caches.get(0)
    digest = payload_hash(__import__("orjson").loads(BODY))
    for doc in range(documents):
        cache.store_response(-1, f"bench-{doc}", 0, digest, StoredResponse(200, ANSWER, "application/json"))
    await cache.flush()
    batch = 32  # requests per read, as wrk's 64 connections deliver them
    reads = [b"".join(request((i * batch + j) % documents) for j in range(batch)) for i in range(200)]
    conn = HTTPConnection(server)  # type: ignore[arg-type]
    transport = CountingTransport()
    conn.connection_made(transport)
    for data in reads[:20]:  # warm up
        conn.data_received(data)
        await asyncio.sleep(0)
    hits_before = services.metrics.rank(0).hits
    profiler = cProfile.Profile() if profile else None
    start = time.process_time()
    if profiler:
        profiler.enable()
    done = 0
    while done < requests:
        conn.data_received(reads[(done // batch) % len(reads)])
        await asyncio.sleep(0)  # the end of the loop's turn: the answers go out
        done += batch
    if profiler:
        profiler.disable()
    elapsed = time.process_time() - start
    hits = services.metrics.rank(0).hits - hits_before
    assert hits == done, f"{hits} hits of {done} requests: not all were answered on the fast path"
    print(f"{elapsed / done * 1e6:.2f} µs CPU per hit ({done} hits, {transport.bytes / done:.0f} bytes each)")
    await server.shutdown()
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200_000)
    parser.add_argument("--documents", type=int, default=20_000)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    import uvloop

    uvloop.run(main(args.requests, args.documents, args.profile))
