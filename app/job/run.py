"""`run_job`: datatrove's inference loop against the checkpoint service, on `ProxyJob`.

Ask where to resume, skip what is done, run each document's rollouts
concurrently through any OpenAI client (with the headers `ProxyJob.headers`
gives, so every answer is cached), send each finished document, complete the
last chunk::

    async def rollout(document, rollout_idx, headers):
        answer = await openai_client.chat.completions.create(
            model=..., messages=[...], extra_headers=headers)
        return answer.choices[0].message.content

    report = await run_job(documents, rollout, base_url="http://127.0.0.1:8080",
                           rank=0, rollouts_per_document=4, concurrency=64)

Kill it anywhere and run it again: it carries on where the proxy says.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Sized
from dataclasses import dataclass, field
from typing import Any

from app.checkpoints.documents import Document, DocumentLike
from app.job.client import ProxyJob
from app.job.progress import Progress

logger = logging.getLogger(__name__)

RolloutFn = Callable[[DocumentLike, int, dict[str, str]], Awaitable[Any]]
#: Said with "all N documents were already done": a rerun and a new job that ends within the old one's last
#: chunk look alike, by position.
NEW_JOB_ADVICE = (
    "if this is a new job, not a rerun, give it a checkpoints dir of its own (inferproxy serve --checkpoints-dir): "
    "its documents were taken for the old job's"
)


@dataclass
class JobReport:
    documents: int = 0
    skipped: int = 0
    written: int = 0
    chunks: int = 0
    seconds: float = 0.0
    last_chunk_index: int = -1
    errors: list[str] = field(default_factory=list)


async def run_job(
    documents: Iterable[DocumentLike | dict[str, Any]],
    rollout_fn: RolloutFn,
    *,
    base_url: str,
    rank: int = 0,
    rollouts_per_document: int = 1,
    concurrency: int = 32,
    records_per_chunk: int | None = None,
    api_key: str | None = None,
    on_written: Callable[[str], None] | None = None,
    progress: bool | None = None,
    total_documents: int | None = None,
    total_ranks: int | None = None,
    unreachable_wait_s: float = 30.0,
) -> JobReport:
    """datatrove's inference loop against the checkpoint service; see the module docstring.

    A rollout that returns None is dropped; a document left with no rollout
    results is checkpointed with `__no_rollouts_remove` (counted, not published).
    `progress`: a line on stderr redrawn with documents done, rate and ETA
    (default: when stderr is a terminal; otherwise a log line at INFO now and
    then). `total_documents` is the input's length if it has one; the proxy is
    told it, for its own progress and ETA, and told the input's length at the
    end in any case, with the last chunk. `total_ranks`: how many ranks the
    job has, so that the proxy can say when all of them are finished. `unreachable_wait_s`: how long a proxy
    the job has reached, then cannot, is waited for (it restarts) before the job fails.
    """
    start = time.monotonic()
    if total_documents is None and isinstance(documents, Sized):
        total_documents = len(documents)
    job = ProxyJob(
        base_url,
        rank,
        api_key,
        total_documents=total_documents,
        total_ranks=total_ranks,
        unreachable_wait_s=unreachable_wait_s,
    )
    report = JobReport()
    shown = Progress(
        f"rank {rank}", total_documents, sys.stderr, interactive=sys.stderr.isatty() if progress is None else progress
    )
    try:
        state = await job.resume()
        if records_per_chunk is not None and records_per_chunk != state.records_per_chunk:
            raise ValueError(
                f"the proxy groups rank {rank} into chunks of {state.records_per_chunk} documents, this job "
                f"asked for {records_per_chunk}: run the job with records_per_chunk={state.records_per_chunk} "
                f"to resume it, or start the proxy with --records-per-chunk {records_per_chunk} and a fresh "
                f"--checkpoints-dir for a new job"
            )
        rpc = state.records_per_chunk
        # datatrove's skip: by position, then by id, each id consumed by its first later occurrence
        processed = set(state.processed_ids)
        if state.docs_to_skip or processed:
            logger.info(
                "rank %d: resuming: skipping the documents of the chunks published (the first %d positions: chunks of "
                "%d) and %d more checkpointed since",
                rank,
                state.docs_to_skip,
                rpc,
                len(processed),
            )
        slots = asyncio.Semaphore(concurrency)

        async def process(document: Document, chunk_index: int) -> None:
            try:
                results = await asyncio.gather(
                    *(
                        rollout_fn(document, r, job.headers(document.id, r, chunk_index))
                        for r in range(rollouts_per_document)
                    )
                )
                kept = [result for result in results if result is not None]
                document.metadata["rollout_results"] = kept
                if not kept:
                    document.metadata["__no_rollouts_remove"] = True
                await job.write_document(document, chunk_index)
            finally:
                slots.release()
            report.written += 1
            if on_written is not None:
                on_written(document.id)
            shown.update(report.skipped + report.written, report.written)

        try:
            # A TaskGroup: the input is read as it goes (at most `concurrency` documents in flight),
            # and the first failure cancels the rest instead of leaving them writing behind us.
            async with asyncio.TaskGroup() as tasks:
                for position, item in enumerate(documents):
                    report.documents += 1
                    report.last_chunk_index = position // rpc
                    document = _as_document(item)
                    if position < state.docs_to_skip:
                        report.skipped += 1
                    elif document.id in processed:
                        processed.discard(document.id)
                        report.skipped += 1
                    else:
                        await slots.acquire()
                        tasks.create_task(process(document, position // rpc))
                    shown.update(report.skipped + report.written, report.written)
        except* Exception as failures:
            raise failures.exceptions[0] from None
        if state.last_chunk_index > report.last_chunk_index:
            logger.warning(
                "rank %d: the proxy's checkpoints say the first %d documents are done, more than this input has "
                "(%d): nothing was processed. If this is a new job, give it its own --checkpoints-dir",
                rank,
                state.docs_to_skip,
                report.documents,
            )
        elif report.documents and report.skipped == report.documents:
            logger.info(
                "rank %d: all %d documents were already done: nothing to do (%s)",
                rank,
                report.documents,
                NEW_JOB_ADVICE,
            )
        if report.documents:
            done = await job.complete_chunk(report.last_chunk_index, total_documents=report.documents)
            report.chunks = done["last_chunk_index"] + 1
    finally:
        shown.close()
        await job.close()
    report.seconds = time.monotonic() - start
    return report


def _as_document(item: DocumentLike | dict[str, Any]) -> Document:
    if isinstance(item, Document):
        return item
    if isinstance(item, dict):
        return Document.from_dict(item)
    return Document(text=item.text, id=item.id, media=list(item.media), metadata=dict(item.metadata))
