"""The demo's parts that need no process: its kill moments, its report, and its output check, which
reads what the publisher writes whatever characters the model produced."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest

from app.checkpoints.documents import Document
from app.checkpoints.manager import CheckpointManager
from app.checkpoints.publish import ChunkPublisher
from app.tools.demo import (
    DemoOptions,
    DemoReport,
    RunReport,
    banner,
    demo_documents,
    describe_generations,
    kill_moments,
    verify_output,
)


async def test_the_output_check_reads_documents_whose_text_holds_unicode_line_separators(tmp_path: Path) -> None:
    # str.splitlines() also splits at U+2028 and U+0085, which JSON (and the publisher) leave unescaped.
    odd = "one\u2028two\u0085three"
    options = DemoOptions(workdir=tmp_path, documents=2, rollouts=2)
    cm = CheckpointManager(str(tmp_path / "ckpt"), 2)
    with ChunkPublisher(str(tmp_path / "output"), str(tmp_path / "ckpt")) as publisher:
        for doc in demo_documents(2):
            results = [{"text": odd, "finish_reason": "stop"}] * 2
            await cm.write_document(
                Document(text=odd, id=doc.id, metadata={"rollout_results": results}), 0, 0, publisher
            )
    assert odd.encode() in (tmp_path / "output" / "00000_chunk_0.jsonl").read_bytes()  # raw, as a model wrote it
    assert verify_output(options) == (2, 1)


@pytest.mark.parametrize(("documents", "kills", "concurrency"), [(2000, 2, 64), (60, 7, 8), (130, 3, 64), (2, 1, 64)])
def test_kill_moments_leave_room_for_what_each_killed_job_left_in_flight(
    documents: int, kills: int, concurrency: int
) -> None:
    # A killed job may leave concurrency - 1 documents done beyond the moment it stopped: the next
    # moment lies beyond them, and the last one before the final document, so that every kill happens.
    options = DemoOptions(documents=documents, kills=kills, concurrency=concurrency)
    for seed in range(300):
        moments = kill_moments(options, random.Random(seed))
        assert len(moments) == kills
        assert moments[0] >= 1
        assert moments[-1] <= documents - 1
        assert all(later - earlier >= concurrency for earlier, later in itertools.pairwise(moments))
        assert moments == kill_moments(options, random.Random(seed))  # --seed fixes them


def test_too_few_documents_for_the_kills_are_refused_naming_how_many_would_do() -> None:
    options = DemoOptions(documents=129, kills=3, concurrency=64)
    with pytest.raises(SystemExit, match=r"give at least --documents 130,"):
        kill_moments(options, random.Random(0))
    assert kill_moments(DemoOptions(documents=1, kills=0), random.Random(0)) == []


def test_generations_of_an_upstream_that_does_not_count_them_are_a_lower_bound_never_a_loss() -> None:
    options = DemoOptions(documents=100, rollouts=2)
    # The killed run's fresh answers undercount: what it had in flight came back as the next run's HITs.
    runs = [RunReport(generated=40, replayed=0, killed="job"), RunReport(generated=150, replayed=10)]
    assert describe_generations(options, DemoReport(runs=runs)).startswith("at least 200 by the upstream for 200 ")
    runs[1].generated = 170  # the proxy died too: some were computed twice, and the job saw it
    assert describe_generations(options, DemoReport(runs=runs)).startswith("at least 210 by the upstream for 200 ")
    counted = DemoReport(runs=runs, upstream_generations=212)
    assert describe_generations(options, counted) == "212 by the upstream for 200 needed (12 lost at kills)"


def test_the_banner_says_once_for_one_kill_and_never_for_none() -> None:
    # `--kills 1` printed "the job is killed 1 times".
    assert banner(DemoOptions(kills=1)).endswith(
        "; the job is killed once with SIGKILL (the proxy too, every second time) and restarted"
    )
    assert "; the job is killed 2 times with SIGKILL (" in banner(DemoOptions(kills=2))
    assert banner(DemoOptions(kills=0, documents=5)).endswith("chunks of 100; the job runs once, never killed")
    with pytest.raises(SystemExit, match=r"too few to kill the job once at --concurrency 64"):
        kill_moments(DemoOptions(documents=1, kills=1, concurrency=64), random.Random(0))
