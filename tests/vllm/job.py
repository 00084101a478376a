"""A batch job on `app.job.run.run_job` whose rollouts are vLLM chat completions through the proxy,
run as a real process (and killed) by test_faults.py.

usage: python job.py PROXY_URL N_DOCS ROLLOUTS CONCURRENCY

Prints `ACK <id>` once the proxy has a document durably, then `DONE`, each line flushed at once.
"""

from __future__ import annotations

import asyncio
import sys

from openai import AsyncOpenAI

from app.checkpoints.documents import DocumentLike
from app.job.run import run_job
from tests.vllm.server import MODEL


async def main(url: str, n_docs: int, rollouts: int, concurrency: int) -> None:
    async with AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:

        async def rollout(document: DocumentLike, rollout_idx: int, headers: dict[str, str]) -> str | None:
            answer = await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": document.text}],
                max_tokens=8,
                temperature=1.0,
                extra_headers=headers,
            )
            return answer.choices[0].message.content

        documents = [{"id": f"doc-{i}", "text": f"the document {i}"} for i in range(n_docs)]
        await run_job(
            documents,
            rollout,
            base_url=url,
            rollouts_per_document=rollouts,
            concurrency=concurrency,
            on_written=lambda doc_id: print("ACK", doc_id, flush=True),
            progress=False,
        )
    print("DONE", flush=True)


if __name__ == "__main__":
    proxy_url, n, r, c = sys.argv[1:5]
    asyncio.run(main(proxy_url, int(n), int(r), int(c)))
