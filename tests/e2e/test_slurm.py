"""datatrove's SlurmPipelineExecutor through ProxyInferenceRunner on a real (single-node) Slurm: the
README's example, examples/datatrove_slurm.py, whose job scripts start the node's `inferproxy serve`
(examples/slurm_node_proxy.sh); a task cancelled with scancel part-way, then the same command again."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.apt import CannotInstall
from tests.e2e.conftest import running_upstream
from tests.e2e.slurm import Slurm, slurm_cluster, slurm_commands
from tests.e2e.test_datatrove_pipeline import DOCUMENTS, ROLLOUTS, assert_exactly_once, make_input, published
from tests.servers import free_port

pytestmark = pytest.mark.e2e

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "datatrove_slurm.py"
JOB_NAME = "inferproxy-datatrove"
TASKS, CONCURRENCY, RECORDS_PER_CHUNK = 4, 4, 20


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Slurm]:
    try:
        slurm_commands()
    except CannotInstall as exc:
        pytest.skip(f"Slurm cannot be installed here: {exc}")
    with slurm_cluster(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


def submit(slurm: Slurm, tmp_path: Path, upstream: str, port: int) -> None:
    """The README's command: it submits the job array (and datatrove's stats job) and returns."""
    command = [
        sys.executable,
        str(EXAMPLE),
        "--partition=debug",
        f"--upstream={upstream}",
        f"--input={tmp_path / 'input'}",
        f"--output={tmp_path / 'output'}",
        f"--checkpoints={tmp_path / 'checkpoints'}",
        f"--logs={tmp_path / 'logs'}",
        f"--port={port}",
        f"--tasks={TASKS}",
        f"--records-per-chunk={RECORDS_PER_CHUNK}",
        f"--concurrency={CONCURRENCY}",
        "--time=00:15:00",
    ]
    done = subprocess.run(command, cwd=tmp_path, env=slurm.env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"submitting failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


def running_rank(proxy: str) -> dict[str, Any] | None:
    """The proxy's row of a rank part-way: some documents checkpointed, not finished."""
    try:
        stats = httpx.get(proxy + "/stats", timeout=2).json()
    except httpx.HTTPError:
        return None  # no job runs now, so no proxy either
    rows = [r for r in stats["ranks"] if r["documents"] >= RECORDS_PER_CHUNK + 5 and not r["finished"]]
    return rows[0] if rows else None


def job_logs(tmp_path: Path) -> str:
    return "\n".join(
        f"--- {p.name}\n{p.read_text(errors='replace')[-2500:]}" for p in sorted((tmp_path / "logs").rglob("*.out"))
    )


def test_a_task_cancelled_on_slurm_resumes_on_rerun_with_every_document_published_once(
    slurm: Slurm, tmp_path: Path
) -> None:
    make_input(tmp_path / "input")
    port = free_port()
    proxy = f"http://127.0.0.1:{port}"
    with running_upstream(latency_ms=150) as upstream:
        submit(slurm, tmp_path, upstream.url, port)
        # one job per node (--exclusive), so one proxy: catch a rank part-way, past its first chunk
        deadline = time.monotonic() + 180
        while (row := running_rank(proxy)) is None:
            assert time.monotonic() < deadline, f"no rank was seen part-way\n{slurm.jobs()}\n{job_logs(tmp_path)}"
            time.sleep(0.1)
        running = [job for job, state, name in slurm.jobs() if name == JOB_NAME and state == "RUNNING"]
        assert len(running) == 1, slurm.jobs()
        slurm.run("scancel", running[0])  # SIGTERM to the job's processes, its task and its proxy alike
        cancelled_rank = row["rank"]

        # the other tasks run on; datatrove's stats job waits on the whole array and never runs now
        array = running[0].split("_")[0]
        deadline = time.monotonic() + 240
        while any(job.split("_")[0] == array for job, _, _ in slurm.jobs()):
            assert time.monotonic() < deadline, f"the array did not end\n{slurm.jobs()}\n{job_logs(tmp_path)}"
            time.sleep(0.2)
        slurm.run("scancel", f"--name={JOB_NAME}")  # the stats job, its dependency never satisfied
        slurm.wait_until_no_job(JOB_NAME)
        ids = {d["id"] for d in published(tmp_path / "output")}
        assert len(ids) < DOCUMENTS, "the cancelled task's documents were all published"
        generated_before = upstream.stats()["generations"]

        submit(slurm, tmp_path, upstream.url, port)  # the same command again
        slurm.wait_until_no_job(JOB_NAME, timeout=240)
        assert_exactly_once(tmp_path / "output")
        # Only what the cancelled task had in flight was generated again: its checkpointed documents
        # and its cached generations came back from the shared checkpoints dir.
        generations = upstream.stats()["generations"]
        assert DOCUMENTS * ROLLOUTS <= generations <= DOCUMENTS * ROLLOUTS + CONCURRENCY, (generations, cancelled_rank)
        assert generations > generated_before, "the rerun generated nothing: the cancelled rank was not rerun"
    completions = sorted(p.name for p in (tmp_path / "logs" / "completions").iterdir())
    assert completions == [f"{rank:05d}" for rank in range(TASKS)], job_logs(tmp_path)
