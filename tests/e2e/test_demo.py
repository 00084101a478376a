"""The README's main command, run as a user runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import running_upstream

pytestmark = pytest.mark.e2e


def inferproxy(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_demo_kills_restarts_and_reports_exactly_once_output_with_replays(tmp_path: Path) -> None:
    done = inferproxy("demo", "--documents=400", "--records-per-chunk=20", "--kills=3", "--seed=5", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.count("killed (job) with SIGKILL") == 2
    assert out.count("killed (job and proxy) with SIGKILL") == 1
    assert "run 4: resumed" in out
    assert "documents published:   400, each exactly once with its 2 rollouts (checked)" in out
    assert "chunks published:      20 output files" in out
    assert len(list((tmp_path / "inferproxy-data/demo/output").glob("*.jsonl"))) == 20
    assert not (tmp_path / "inferproxy-data/demo/checkpoints/00000").exists()  # cleaned up once finished
    replayed = int(out.split("generations replayed:")[1].split()[0])
    assert replayed > 0  # what the killed job had in flight came back from the cache


def test_every_kill_asked_for_happens_even_on_a_small_input_with_no_seed(tmp_path: Path) -> None:
    # Seven kills of a 60-document job, up to 8 documents in flight: each killed run may leave 7 more done
    # than it acknowledged, and still the next kill lands before the restarted job can finish.
    args = ["--documents=60", "--concurrency=8", "--records-per-chunk=5", "--kills=7", "--latency-ms=5"]
    done = inferproxy("demo", *args, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("with SIGKILL\n") == 7
    assert "run 8: resumed" in done.stdout
    assert "documents published:   60, each exactly once with its 2 rollouts (checked)" in done.stdout


def test_too_few_documents_for_the_kills_asked_for_are_refused_before_anything_starts(tmp_path: Path) -> None:
    done = inferproxy("demo", "--documents=20", "--kills=3", cwd=tmp_path)
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr == (
        "inferproxy demo: 20 documents are too few to kill the job 3 times at --concurrency 64 (a killed job may "
        "leave up to that many documents done with it): give at least --documents 130, or fewer --kills, or a "
        "lower --concurrency\n"
    )
    assert not (tmp_path / "inferproxy-data").exists()


def test_with_an_upstream_that_does_not_count_its_generations_the_report_gives_a_true_lower_bound(
    tmp_path: Path,
) -> None:
    # The job's fresh answers undercount what the upstream computed: what it had in flight at a kill is
    # generated all the same and comes back from the cache later (once reported as "-83 lost at kills").
    with running_upstream(latency_ms=20) as upstream:
        done = inferproxy(
            "demo", f"--upstream={upstream.url}", "--documents=300", "--kills=2", "--kill-proxy=never", cwd=tmp_path
        )
        generated = upstream.stats()["generations"]
    assert done.returncode == 0, done.stderr
    line = done.stdout.split("generations computed:")[1].splitlines()[0]
    assert line.strip().startswith("at least ")
    assert "by the upstream for 600 needed (it does not count them for the demo" in line
    assert 600 <= int(line.split()[2]) <= generated
    assert "-" not in line


def test_demo_refuses_to_clear_a_directory_it_did_not_create(tmp_path: Path) -> None:
    (tmp_path / "mine.txt").write_text("precious")
    done = inferproxy("demo", f"--workdir={tmp_path}", cwd=tmp_path)
    assert done.returncode == 1
    assert done.stdout == ""  # the refusal alone, not the demo's opening line before it
    assert done.stderr.startswith(f"inferproxy demo: {tmp_path} is not empty and was not created by `inferproxy demo`")
    assert (tmp_path / "mine.txt").read_text() == "precious"


def test_a_bad_flag_value_says_what_to_fix(tmp_path: Path) -> None:
    done = inferproxy("demo", "--documents=0", cwd=tmp_path)
    assert done.returncode == 2
    assert "--documents: must be an integer > 0, got '0'" in done.stderr
    assert not (tmp_path / "inferproxy-data").exists()


def test_job_and_proxy_killed_at_four_random_moments_end_with_exactly_once_output(tmp_path: Path) -> None:
    done = inferproxy(
        "demo",
        "--documents=500",
        "--rollouts=2",
        "--records-per-chunk=50",
        "--kills=4",
        "--kill-proxy=always",
        "--concurrency=32",
        "--seed=11",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.count("killed (job and proxy) with SIGKILL") == 4
    assert "documents published:   500, each exactly once with its 2 rollouts (checked)" in out
    computed = int(out.split("generations computed:")[1].split()[0])
    # each kill can cost at most what was in flight: 32 documents x 2 rollouts
    assert 1000 <= computed <= 1000 + 4 * 32 * 2
