"""datatrove's executors drive ProxyInferenceRunner, as real processes: `inferproxy fake-upstream`,
`inferproxy serve`, and the pipeline (examples/datatrove_pipeline.py, or its Ray shape) in a
process group of its own, killed with SIGKILL part-way and run again."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.browser import ROWS, browser, text_of, wait_text
from tests.e2e.conftest import Proxy, Upstream, running_upstream, start_proxy
from tests.servers import process, wait_for_http

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).parent.parent.parent
EXAMPLE = ROOT / "examples" / "datatrove_pipeline.py"
RAY_JOB = Path(__file__).with_name("datatrove_ray_job.py")
DOCUMENTS, ROLLOUTS, RECORDS_PER_CHUNK = 300, 2, 20
#: what JsonlWriter(output_filename="${rank}_chunk_${chunk_index}.jsonl") writes: gzip by default
OUTPUT_FILENAME = "${rank}_chunk_${chunk_index}.jsonl.gz"


@pytest.fixture
def slow_upstream() -> Iterator[Upstream]:
    """A fake upstream that takes a while per answer, so that a job can be caught part-way."""
    with running_upstream(latency_ms=40) as started:
        yield started


@pytest.fixture
def datatrove_proxy(slow_upstream: Upstream, tmp_path: Path) -> Iterator[Proxy]:
    args, port = start_proxy(
        slow_upstream.url,
        tmp_path,
        f"--records-per-chunk={RECORDS_PER_CHUNK}",
        f"--output-filename={OUTPUT_FILENAME}",
    )
    with process(*args) as proc:
        url = f"http://127.0.0.1:{port}"
        wait_for_http(url + "/healthz")
        yield Proxy(url, args, proc)


def make_input(folder: Path) -> None:
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        from datatrove_pipeline import make_input as write
    finally:
        sys.path.remove(str(EXAMPLE.parent))
    write(str(folder), DOCUMENTS)


def start_job(
    command: list[str], tmp_path: Path, run: int, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """The job in a new session: its own process group, with every worker datatrove forks."""
    log = (tmp_path / f"job-{run}.log").open("wb")
    try:
        return subprocess.Popen(
            command,
            cwd=tmp_path,
            env={**os.environ, **(env or {})},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    finally:
        log.close()


def example_command(proxy: Proxy, tmp_path: Path) -> list[str]:
    return [
        sys.executable,
        str(EXAMPLE),
        f"--proxy={proxy.url}",
        f"--input={tmp_path / 'input'}",
        f"--output={tmp_path / 'output'}",
        f"--logs={tmp_path / 'logs'}",
        "--concurrency=4",
    ]


def finish(job: subprocess.Popen[bytes], tmp_path: Path, run: int, timeout: float = 90) -> None:
    try:
        returncode = job.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(job)
        raise
    log = (tmp_path / f"job-{run}.log").read_text(errors="replace")
    assert returncode == 0, f"the job failed:\n{log[-4000:]}"


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def kill_tree(job: subprocess.Popen[bytes]) -> set[int]:
    """SIGKILL the job's process group and every descendant (datatrove's workers outlive their parent);
    return the descendants, once all of them are gone."""
    tree = descendants(job.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(job.pid, signal.SIGKILL)
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    job.wait(timeout=10)
    deadline = time.monotonic() + 10
    while any(alive(p) for p in tree):
        assert time.monotonic() < deadline, f"still alive after SIGKILL: {[p for p in tree if alive(p)]}"
        time.sleep(0.01)
    return tree


def published(output: Path) -> list[dict[str, Any]]:
    return [
        json.loads(line)
        for f in sorted(output.glob("*.jsonl.gz"))
        for line in gzip.decompress(f.read_bytes()).decode().splitlines()
    ]


def assert_exactly_once(output: Path) -> None:
    documents = published(output)
    ids = [d["id"] for d in documents]
    assert len(ids) == len(set(ids)), "a document was published twice"
    assert sorted(ids) == sorted(f"doc-{i}" for i in range(DOCUMENTS))
    assert all(len(d["metadata"]["rollout_results"]) == ROLLOUTS for d in documents)
    assert all(isinstance(r, str) and r for d in documents for r in d["metadata"]["rollout_results"])


async def the_page_says_finished(chromium: str, url: str, workdir: Path) -> None:
    """The live page, as the person watching the job sees it once it ended: every rank and the job finished."""
    async with browser(chromium, workdir) as chrome:
        page = await chrome.open(url + "/")
        await wait_text(page, "job", "finished")
        assert await page.evaluate(text_of("job-sub")) == "job finished: 4 of 4 ranks"
        share = DOCUMENTS // 4
        rows = await page.evaluate(ROWS)
        assert [(r["rank"], r["done"], r["eta"]) for r in rows] == [
            (rank, f"{share} / {share} · 100.0%", "finished") for rank in range(4)
        ]
        assert await page.evaluate(text_of("documents-done")) == f"{DOCUMENTS} / {DOCUMENTS}"
        assert page.errors == []


def test_local_executor_killed_part_way_and_rerun_publishes_every_document_once_paying_nothing_twice(
    datatrove_proxy: Proxy, slow_upstream: Upstream, tmp_path: Path, chromium: str
) -> None:
    make_input(tmp_path / "input")
    output = tmp_path / "output"
    job = start_job(example_command(datatrove_proxy, tmp_path), tmp_path, run=1)
    try:
        # part-way: once a first chunk is out, long before the last generation
        deadline = time.monotonic() + 60
        while not list(output.glob("*.jsonl.gz")):
            assert job.poll() is None, (tmp_path / "job-1.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "no chunk was published in time"
            time.sleep(0.02)
    finally:
        killed = kill_tree(job)
    assert len(killed) >= 4, "datatrove's 4 workers were not running"
    assert len(published(output)) < DOCUMENTS, "the job was not killed part-way"
    before = slow_upstream.stats()["generations"]
    assert 0 < before < DOCUMENTS * ROLLOUTS

    finish(start_job(example_command(datatrove_proxy, tmp_path), tmp_path, run=2), tmp_path, run=2)
    assert_exactly_once(output)
    # The proxy stayed up: what the killed job had in flight finished there and was cached (or was
    # joined by the rerun's identical request), so each generation was paid for exactly once.
    assert slow_upstream.stats()["generations"] == DOCUMENTS * ROLLOUTS
    assert sorted({name.name.split("_")[0] for name in output.iterdir()}) == ["00000", "00001", "00002", "00003"]
    # Every task declared datatrove's world_size and completed its last chunk: the proxy says the job is done.
    stats = httpx.get(datatrove_proxy.url + "/stats").json()
    assert stats["job"] == {"ranks_declared": 4, "ranks_finished": 4, "finished": True}
    assert [(r["rank"], r["finished"], r["total_documents"]) for r in stats["ranks"]] == [
        (rank, True, DOCUMENTS // 4) for rank in range(4)
    ]
    asyncio.run(the_page_says_finished(chromium, datatrove_proxy.url, tmp_path / "chrome"))


def test_ray_executor_on_a_local_cluster_publishes_every_document_once(
    datatrove_proxy: Proxy, slow_upstream: Upstream, tmp_path: Path
) -> None:
    make_input(tmp_path / "input")
    command = [
        sys.executable,
        str(RAY_JOB),
        datatrove_proxy.url,
        str(tmp_path / "input"),
        str(tmp_path / "output"),
        str(tmp_path / "logs"),
    ]
    # Ray's workers import the rollout function from the example by name.
    paths = os.pathsep.join(filter(None, [str(EXAMPLE.parent), os.environ.get("PYTHONPATH")]))
    job = start_job(command, tmp_path, run=1, env={"PYTHONPATH": paths})
    try:
        finish(job, tmp_path, run=1, timeout=120)
    finally:
        if job.poll() is None or descendants(job.pid):
            kill_tree(job)
    assert_exactly_once(tmp_path / "output")
    assert slow_upstream.stats()["generations"] == DOCUMENTS * ROLLOUTS
    resume = httpx.get(datatrove_proxy.url + "/resume", headers={"X-Rank": "3"}).json()
    assert resume["output"] == str(tmp_path / "output")


def test_datatroves_own_runner_on_inferproxys_checkpointing_runs_a_pipeline_to_exactly_once_output(
    upstream: Upstream, tmp_path: Path
) -> None:
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.inference.run_inference import InferenceConfig, InferenceRunner
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.writers import JsonlWriter

    from app.integrations.datatrove import with_inferproxy_checkpointing

    make_input(tmp_path / "input")
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        from datatrove_pipeline import rollout
    finally:
        sys.path.remove(str(EXAMPLE.parent))
    checkpoints, output = tmp_path / "checkpoints", tmp_path / "output"
    runner = with_inferproxy_checkpointing(
        InferenceRunner(
            rollout_fn=rollout,
            config=InferenceConfig(
                server_type="endpoint",
                endpoint_url=upstream.url,
                model_name_or_path="fake-model",
                rollouts_per_document=ROLLOUTS,
                metric_interval=3600,
            ),
            output_writer=JsonlWriter(str(output), output_filename="${rank}_chunk_${chunk_index}.jsonl"),
            checkpoints_local_dir=str(checkpoints),
            records_per_chunk=RECORDS_PER_CHUNK,
        )
    )
    # workers=1: the tasks run one after the other in this process (a pool's forkserver would start
    # pytest again as its __main__); test_integrations_datatrove checks the runner survives pickling.
    LocalPipelineExecutor(
        pipeline=[JsonlReader(str(tmp_path / "input")), runner], tasks=4, workers=1, logging_dir=str(tmp_path / "logs")
    ).run()
    assert_exactly_once(output)
    assert upstream.stats()["generations"] == DOCUMENTS * ROLLOUTS
    # inferproxy's CheckpointManager did the checkpointing: its meta file, and every rank's work done
    assert json.loads((checkpoints / "checkpoint_meta.json").read_text())["records_per_chunk"] == RECORDS_PER_CHUNK
    assert sorted(p.read_text() for p in (checkpoints / "last_chunk").iterdir()) == ["3"] * 4
    assert not [p for p in checkpoints.iterdir() if p.name.isdigit()]


#: Documents whose rollout waits for the test (a rank's last one): the rank runs until the test lets it end.
HELD: dict[str, threading.Event] = {}


async def held_rollout(document: Any, generate: Any) -> str:
    result = await generate({"messages": [{"role": "user", "content": document.text}], "max_tokens": 8})
    gate = HELD.get(document.id)
    if gate is not None:
        await asyncio.to_thread(gate.wait)
    return str(result.text)


def jsonl(prefix: str, numbers: range) -> str:
    return "".join(json.dumps({"id": f"{prefix}-{i}", "text": f"Question {i}"}) + "\n" for i in numbers)


def run_pipeline(proxy: Proxy, tmp_path: Path, steps: list[Any], tasks: int) -> None:
    """`steps` then ProxyInferenceRunner, on LocalPipelineExecutor in this process (one task after the other)."""
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.inference.run_inference import InferenceConfig
    from datatrove.pipeline.writers import JsonlWriter

    from app.integrations.datatrove import ProxyInferenceRunner

    runner = ProxyInferenceRunner(
        rollout_fn=held_rollout,
        config=InferenceConfig(
            server_type="endpoint",
            endpoint_url=proxy.url,
            model_name_or_path="fake-model",
            rollouts_per_document=1,
            max_concurrent_generations=8,
            metric_interval=3600,
        ),
        output_writer=JsonlWriter(str(tmp_path / "output"), output_filename="${rank}_chunk_${chunk_index}.jsonl"),
    )
    LocalPipelineExecutor(pipeline=[*steps, runner], tasks=tasks, workers=1, logging_dir=str(tmp_path / "logs")).run()


def rank_seen(proxy: Proxy, rank: int) -> dict[str, Any] | None:
    views: list[dict[str, Any]] = httpx.get(proxy.url + "/stats").json()["ranks"]
    return next((view for view in views if view["rank"] == rank), None)


def watch_and_release(
    proxy: Proxy, waits: list[tuple[int, str, Callable[[dict[str, Any]], bool]]]
) -> Callable[[], list[dict[str, Any]]]:
    """A thread that, for each (rank, held document, condition) in turn, waits until the proxy's view of the
    rank meets the condition, keeps that view, then lets the held document finish. Returns what to call once
    the job ended: the views it kept (the error that stopped it, raised: every document is then let go)."""
    seen: list[dict[str, Any]] = []
    failed: list[BaseException] = []
    for _, doc_id, _ in waits:
        HELD[doc_id] = threading.Event()

    def watch() -> None:
        try:
            for rank, doc_id, condition in waits:
                deadline = time.monotonic() + 60
                while not condition(view := rank_seen(proxy, rank) or {}):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"rank {rank} as the proxy sees it never got there: {view}")
                    time.sleep(0.02)
                seen.append(view)
                HELD[doc_id].set()
        except BaseException as exc:
            failed.append(exc)
        finally:
            for gate in HELD.values():
                gate.set()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()

    def result() -> list[dict[str, Any]]:
        watcher.join()
        if failed:
            raise failed[0]
        return seen

    return result


def test_a_jsonlreaders_ranks_declare_their_totals_counted_from_their_files_while_they_run(
    datatrove_proxy: Proxy, tmp_path: Path
) -> None:
    from datatrove.pipeline.readers import JsonlReader

    folder = tmp_path / "input"
    folder.mkdir()
    # rank 0: a compressed file whose blank line and empty text the reader drops (30 documents);
    # rank 1: 40 lines, of which the reader's limit takes 35.
    dropped = "\n" + json.dumps({"id": "empty", "text": ""}) + "\n"
    (folder / "a.jsonl.gz").write_bytes(
        gzip.compress((jsonl("a", range(15)) + dropped + jsonl("a", range(15, 30))).encode())
    )
    (folder / "b.jsonl").write_text(jsonl("b", range(40)))
    HELD.clear()
    watched = watch_and_release(
        datatrove_proxy,
        [
            (0, "a-29", lambda view: view.get("total_documents") is not None),
            (1, "b-34", lambda view: view.get("total_documents") is not None),
        ],
    )
    run_pipeline(datatrove_proxy, tmp_path, [JsonlReader(str(folder), limit=35)], tasks=2)
    # Each rank, still running (its last document held), had its exact total declared.
    assert [(view["rank"], view["total_documents"], view["finished"]) for view in watched()] == [
        (0, 30, False),
        (1, 35, False),
    ]
    stats = httpx.get(datatrove_proxy.url + "/stats").json()
    assert [(r["rank"], r["finished"], r["done_documents"], r["total_documents"]) for r in stats["ranks"]] == [
        (0, True, 30, 30),
        (1, True, 35, 35),
    ]
    assert len(published(tmp_path / "output")) == 65


def test_a_filter_between_the_reader_and_the_runner_leaves_the_total_to_the_ranks_end(
    datatrove_proxy: Proxy, tmp_path: Path
) -> None:
    from datatrove.pipeline.filters import LambdaFilter
    from datatrove.pipeline.readers import JsonlReader

    folder = tmp_path / "input"
    folder.mkdir()
    (folder / "b.jsonl").write_text(jsonl("b", range(40)))
    HELD.clear()
    # Every document but the held one is done at the proxy: a total counted from the file would be there.
    watched = watch_and_release(datatrove_proxy, [(0, "b-39", lambda view: view.get("done_documents") == 39)])
    run_pipeline(datatrove_proxy, tmp_path, [JsonlReader(str(folder)), LambdaFilter(lambda doc: True)], tasks=1)
    assert [(view["total_documents"], view["finished"]) for view in watched()] == [(None, False)]
    [view] = httpx.get(datatrove_proxy.url + "/stats").json()["ranks"]
    assert (view["finished"], view["done_documents"], view["total_documents"]) == (True, 40, 40)
