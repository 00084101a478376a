"""`inferproxy run-batch` as a real process against `inferproxy fake-upstream`: vLLM's file format in and out,
killed (SIGKILL, SIGTERM) part-way and run again, bad inputs refused before anything is sent, S3 both ways."""

from __future__ import annotations

import fcntl
import gzip
import io
import json
import os
import shutil
import signal
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import orjson
import pytest

from app.cli import main as cli_main
from app.service.settings import Settings
from app.store.batches import BatchDir, Result, new_batch_id
from app.store.files import FileStore
from app.tools import run_batch as run_batch_module
from app.tools.run_batch import report as report_module
from app.tools.run_batch import state as state_module
from tests.e2e.conftest import Upstream, running_upstream
from tests.e2e.test_s3_output import S3, s3, s3_server  # noqa: F401 - the fixtures
from tests.job.test_progress import logging_to, screen
from tests.servers import free_port, process, run_cli

pytestmark = pytest.mark.e2e

CHAT = "/v1/chat/completions"
INFLIGHT = 8
#: a kill's cost: lines sent, or answered and not yet on disk (twice `max_inflight_per_upstream`, contract §12)
UNWRITTEN = 2 * INFLIGHT
#: What a line answered 500 every time says in its `error.message`.
REASON_500 = (
    'the upstream answered 500: {"error":{"message":"injected failure 500","type":"InternalServerError","param":null,'
    '"code":500}} (the line tried 2 times)'
)


def chat_line(custom_id: str, text: str, url: str = CHAT, **body: Any) -> dict[str, Any]:
    request = {"model": "fake-model", "messages": [{"role": "user", "content": text}], "max_tokens": 4, **body}
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": request}


def write_input(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))
    return path


def run_batch(
    upstream: Upstream, *args: str, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return run_cli("run-batch", f"--upstream={upstream.url}", *fast(), *args, timeout=timeout, env=env)


def run_batch_here(
    capsys: pytest.CaptureFixture[str], upstream: Upstream, *args: str
) -> subprocess.CompletedProcess[str]:
    """`run_batch` in this process, for a run that is refused before it sends anything: what a refusal says
    does not need a process of its own (each costs a second of imports)."""
    capsys.readouterr()
    code = cli_main(["run-batch", f"--upstream={upstream.url}", *fast(), *args])
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(["run-batch", *args], code, captured.out, captured.err)


def fast() -> list[str]:
    return [f"--max-inflight-per-upstream={INFLIGHT}", "--retry-backoff-s=0.01", "--batch-retries=1"]


def output_of(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def said_by(proc: subprocess.Popen[bytes]) -> list[str]:
    """The lines a run-batch started with `read_stderr` wrote to stderr, once it has ended."""
    assert proc.stderr is not None
    return proc.stderr.read().decode().strip().splitlines()


def a_run(
    upstream: Upstream, tmp_path: Path, count: int = 300
) -> tuple[list[dict[str, Any]], Path, Path, tuple[str, ...]]:
    """`count` lines in `in.jsonl`, and the arguments of the run-batch that answers them into `out.jsonl`: the
    lines, OUTPUT, its state folder, the arguments."""
    lines = [chat_line(f"line-{i}", f"question {i}") for i in range(count)]
    source = write_input(tmp_path / "in.jsonl", lines)
    output, state = tmp_path / "out.jsonl", tmp_path / "out.jsonl.inferproxy"
    return (
        lines,
        output,
        state,
        ("run-batch", f"--upstream={upstream.url}", *fast(), "-i", str(source), "-o", str(output)),
    )


def last_line(result: subprocess.CompletedProcess[str]) -> str:
    return result.stderr.strip().splitlines()[-1]


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    with running_upstream() as started:
        yield started


@pytest.fixture
def slow_upstream() -> Iterator[Upstream]:
    with running_upstream(latency_ms=40) as started:
        yield started


def test_every_line_is_answered_in_input_order_in_vllms_format(upstream: Upstream, tmp_path: Path) -> None:
    lines = [chat_line(f"line-{i}", f"question {i}") for i in range(30)]
    lines[7] = chat_line("too-long", "question", max_tokens=10**6)  # the upstream's 400: an answer too
    source = write_input(tmp_path / "in.jsonl", lines)
    result = run_batch(upstream, "-i", str(source), "-o", str(tmp_path / "out.jsonl"))
    assert result.returncode == 0, result.stderr
    assert last_line(result) == (
        f"inferproxy run-batch: 30 lines answered (1 answered with an error), written to {tmp_path / 'out.jsonl'}"
    )
    raw = (tmp_path / "out.jsonl").read_bytes()
    output = output_of(tmp_path / "out.jsonl")
    assert [o["custom_id"] for o in output] == [line["custom_id"] for line in lines]
    for line, out in zip(raw.splitlines(), output, strict=True):
        # vLLM's BatchRequestOutput.model_dump_json(): these fields in this order, compact JSON
        assert list(out) == ["id", "custom_id", "response", "error"]
        assert line == orjson.dumps(out)
        assert list(out["response"]) == ["status_code", "request_id", "body"]
    assert output[0]["response"]["status_code"] == 200
    assert output[0]["response"]["body"]["object"] == "chat.completion"
    assert output[0]["error"] is None
    assert output[7]["response"]["status_code"] == 400
    assert "maximum context length" in output[7]["response"]["body"]["error"]["message"]
    assert upstream.stats()["generations"] == 29
    assert (tmp_path / "out.jsonl.inferproxy" / "run-batch.json").exists()  # the state, beside the output

    # run again: nothing is sent, the output is the same answers; no upstream is needed for that
    (tmp_path / "out.jsonl").unlink()
    again = run_cli(
        "run-batch", f"--upstream=http://127.0.0.1:{free_port()}", "-i", str(source), "-o", str(tmp_path / "out.jsonl")
    )
    assert again.returncode == 0, again.stderr
    assert again.stderr.startswith(
        f"inferproxy run-batch: already complete: nothing sent, {tmp_path / 'out.jsonl'} written again from the state\n"
    )
    assert upstream.stats()["generations"] == 29
    bodies = [o["response"]["body"] for o in output]
    assert [o["response"]["body"] for o in output_of(tmp_path / "out.jsonl")] == bodies


def test_embeddings_and_completions_are_endpoints_too(upstream: Upstream, tmp_path: Path) -> None:
    for url, body in (
        ("/v1/embeddings", {"input": "hello"}),
        ("/v1/completions", {"prompt": "hello", "max_tokens": 3}),
    ):
        lines = [{"custom_id": "c", "method": "POST", "url": url, "body": {"model": "fake-model", **body}}]
        name = url.rsplit("/", 1)[1]
        source = write_input(tmp_path / f"{name}.jsonl", lines)
        result = run_batch(upstream, "-i", str(source), "-o", str(tmp_path / f"{name}.out.jsonl"))
        assert result.returncode == 0, result.stderr
        [out] = output_of(tmp_path / f"{name}.out.jsonl")
        assert out["response"]["status_code"] == 200, out
        assert out["response"]["body"]["object"] == ("list" if name == "embeddings" else "text_completion")


def results_so_far(state: Path) -> int:
    try:
        batch_id = orjson.loads((state / "run-batch.json").read_bytes())["batch_id"]
        return (state / "batches" / batch_id / "results.jsonl").read_bytes().count(b"\n")
    except (FileNotFoundError, KeyError, orjson.JSONDecodeError):
        return 0


def wait_for_results(state: Path, at_least: int, proc: subprocess.Popen[bytes]) -> int:
    deadline = time.monotonic() + 60
    while (done := results_so_far(state)) < at_least:
        assert proc.poll() is None, "run-batch ended before it was to be killed"
        assert time.monotonic() < deadline, f"{done} results after 60 s"
        time.sleep(0.02)
    return done


def test_killed_with_sigkill_again_and_again_it_carries_on_and_writes_each_line_once(
    slow_upstream: Upstream, tmp_path: Path
) -> None:
    lines = [chat_line(f"line-{i}", f"question {i}") for i in range(400)]
    source = write_input(tmp_path / "in.jsonl", lines)
    output, state = tmp_path / "out.jsonl", tmp_path / "out.jsonl.inferproxy"
    args = ("run-batch", f"--upstream={slow_upstream.url}", *fast(), "-i", str(source), "-o", str(output))
    kills = 0
    for at_least in (40, 150, 260):
        with process(*args) as proc:
            wait_for_results(state, at_least, proc)
            proc.kill()
            proc.wait(timeout=10)
            kills += 1
        assert not output.exists()  # whole or not at all
    batch_id = orjson.loads((state / "run-batch.json").read_bytes())["batch_id"]
    results = (state / "batches" / batch_id / "results.jsonl").read_bytes().split(b"\n")[:-1]  # whole lines
    done = len({orjson.loads(result)["line"] for result in results})  # durable: batch.json may count fewer
    result = run_cli(*args, timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"inferproxy run-batch: resuming: {done} of 400 lines already done\n" in result.stderr
    custom_ids = [o["custom_id"] for o in output_of(output)]
    assert custom_ids == [line["custom_id"] for line in lines]
    # only what was in flight at each kill was generated twice
    generations = slow_upstream.stats()["generations"]
    assert len(lines) <= generations <= len(lines) + kills * UNWRITTEN, generations


def test_sigterm_stops_it_cleanly_and_a_rerun_carries_on(slow_upstream: Upstream, tmp_path: Path) -> None:
    lines, output, state, args = a_run(slow_upstream, tmp_path)
    with process(*args, read_stderr=True) as proc:
        wait_for_results(state, 50, proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        said = said_by(proc)[-1]
    assert said.startswith("inferproxy run-batch: stopped by SIGTERM with "), said
    assert said.endswith("lines done; rerun the same command to carry on"), said
    assert not output.exists()
    stopped_at = results_so_far(state)
    result = run_cli(*args, timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"inferproxy run-batch: resuming: {stopped_at} of 300 lines already done\n" in result.stderr
    assert [o["custom_id"] for o in output_of(output)] == [line["custom_id"] for line in lines]
    generations = slow_upstream.stats()["generations"]
    assert generations <= len(lines) + INFLIGHT, generations
    assert 50 <= stopped_at < len(lines)


def test_lines_the_upstream_never_answers_exit_1_and_a_rerun_retries_only_those(
    upstream: Upstream, tmp_path: Path
) -> None:
    lines = [chat_line(f"line-{i}", f"question {i}") for i in range(20)]
    lines[3] = chat_line("broken", "question", fake_upstream={"status": 500})
    source = write_input(tmp_path / "in.jsonl", lines)
    output = tmp_path / "out.jsonl"
    result = run_batch(upstream, "-i", str(source), "-o", str(output))
    assert result.returncode == 1, result.stderr
    assert last_line(result) == (
        f"inferproxy run-batch: 1 of 20 lines got no answer from the upstream after every retry (the last: "
        f"{REASON_500}; error.code upstream_error in {output}); rerun the same command to retry only those"
    )
    out = output_of(output)
    assert [o["custom_id"] for o in out] == [line["custom_id"] for line in lines]
    assert out[3]["response"] is None
    assert out[3]["error"]["code"] == "upstream_error"
    before = upstream.stats()
    assert before["generations"] == 19

    again = run_batch(upstream, "-i", str(source), "-o", str(output))
    assert again.returncode == 1, again.stderr
    assert again.stderr.startswith(
        "inferproxy run-batch: 1 of 20 lines got no answer last time: sending those again (the others are answered "
        "from the state)\n"
    )
    after = upstream.stats()
    assert after["generations"] == 19  # the answered lines were not paid again
    assert after["requests"] - before["requests"] == 2  # the broken line, tried twice (--batch-retries=1)


def test_an_upstream_that_never_answers_fails_the_run_at_once_in_one_line_and_sends_nothing(tmp_path: Path) -> None:
    source = write_input(tmp_path / "in.jsonl", [chat_line(f"line-{i}", "question") for i in range(3)])
    nobody = f"http://127.0.0.1:{free_port()}"  # a mistyped port: nothing listens there
    check = "check --upstream, --upstream-api-key and that the server is up"
    for wait_s, said in (
        ("0", [f"no upstream answers GET /v1/models at {nobody} ("]),
        (
            "1",
            [
                f"no upstream answers GET /v1/models at {nobody} yet (",
                f"no upstream answers GET /v1/models at {nobody} (",
            ],
        ),
    ):
        output = tmp_path / f"out-{wait_s}.jsonl"
        result = run_cli(
            "run-batch", f"--upstream={nobody}", f"--upstream-wait-s={wait_s}", "-i", str(source), "-o", str(output)
        )
        assert result.returncode == 2, result.stderr
        lines = result.stderr.splitlines()
        assert len(lines) == len(said), result.stderr
        shown = [
            line.removeprefix("inferproxy run-batch: ")[: len(start)] for line, start in zip(lines, said, strict=True)
        ]
        assert shown == said
        assert "refused" in lines[-1].lower(), lines[-1]  # the reason: connection refused
        if wait_s == "1":
            assert lines[0].endswith(f"): waiting up to 1 s for one (--upstream-wait-s); {check}"), lines[0]
            assert lines[-1].endswith(f") after 1 s: {check}; nothing was sent"), lines[-1]
        else:
            assert lines[-1].endswith(f"): {check}; nothing was sent"), lines[-1]
        assert not output.exists()
        assert not Path(f"{output}.inferproxy").exists()  # a fresh run leaves no state


def test_an_upstream_that_is_starting_is_waited_for(tmp_path: Path) -> None:
    source = write_input(tmp_path / "in.jsonl", [chat_line(f"line-{i}", "question") for i in range(3)])
    output, port = tmp_path / "out.jsonl", free_port()
    args = ("run-batch", f"--upstream=http://127.0.0.1:{port}", *fast(), "-i", str(source), "-o", str(output))
    with process(*args, read_stderr=True) as proc:
        assert proc.stderr is not None
        first = proc.stderr.readline().decode()  # said before it waits: the upstream is started after it
        assert first.startswith(
            f"inferproxy run-batch: no upstream answers GET /v1/models at http://127.0.0.1:{port} yet"
        )
        assert "waiting up to 60 s" in first, first
        with process("fake-upstream", f"--port={port}"):
            assert proc.wait(timeout=60) == 0
        said = proc.stderr.read().decode()
    assert f"inferproxy run-batch: the upstream answers at http://127.0.0.1:{port}: starting\n" in said
    assert said.endswith(f"inferproxy run-batch: 3 lines answered, written to {output}\n"), said
    assert len(output_of(output)) == 3


def test_lines_the_upstream_stops_answering_name_the_last_error_in_the_final_line(
    slow_upstream: Upstream, tmp_path: Path
) -> None:
    lines = [chat_line(f"line-{i}", f"question {i}") for i in range(200)]
    source = write_input(tmp_path / "in.jsonl", lines)
    output, state = tmp_path / "out.jsonl", tmp_path / "out.jsonl.inferproxy"
    args = ("run-batch", f"--upstream={slow_upstream.url}", *fast(), "--upstream-retries=0", "-i", str(source))
    with process(*args, "-o", str(output), read_stderr=True) as proc:
        wait_for_results(state, 20, proc)
        slow_upstream.proc.kill()  # gone mid-run: the lines left get no answer
        assert proc.wait(timeout=60) == 1
        said = said_by(proc)[-1]
    assert " lines got no answer from the upstream after every retry (the last: " in said, said
    assert "refused" in said.lower(), said


def test_a_bad_input_is_refused_naming_its_first_bad_lines_and_nothing_is_sent_or_written(
    upstream: Upstream, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = orjson.dumps(chat_line("a", "question")).decode()
    cases = {
        "missing": (None, "-i {path}: no such file"),
        "not-jsonl": ("this is not JSON\n" + good + "\n{oops\n", "has 2 bad lines, nothing was sent: line 1: "),
        "duplicates": (good + "\n" + good + "\n", "has 1 bad line, nothing was sent: line 2: `custom_id` 'a'"),
        "mixed": (
            good + "\n" + orjson.dumps(chat_line("b", "question", url="/v1/embeddings")).decode() + "\n",
            "mixes endpoints: line 1 asks for /v1/chat/completions, line 2 for '/v1/embeddings'; one endpoint per file",
        ),
        "unknown-endpoint": (
            orjson.dumps(chat_line("a", "question", url="/v1/responses")).decode() + "\n",
            "line 1 asks for url '/v1/responses': run-batch sends /v1/chat/completions, /v1/completions, "
            "/v1/embeddings",
        ),
        "empty": ("\n\n", "holds no request"),
        "gzip": (
            gzip.compress((good + "\n").encode()),
            "-i {path} is gzip-compressed: gunzip it (run-batch reads plain JSON Lines)",
        ),
        "binary": (bytes(range(1, 256)) * 8, "-i {path} is not UTF-8 text (its first KB is not): give the batch file"),
        "nul": (b"\0" * 2000, "-i {path} is not text: its first KB holds NUL bytes"),
        "bom": (
            b"\xef\xbb\xbf" + orjson.dumps(chat_line("a", "q")) + b"\n",
            "-i {path} begins with a byte-order mark (EF BB BF): save it as UTF-8 without one",
        ),
        "pretty-array": (
            json.dumps([chat_line("a", "q"), chat_line("b", "q")], indent=2),
            "-i {path} looks like one JSON array, not one request per line: write one JSON object per line "
            "(jq -c '.[]' does)",
        ),
        "one-line-array": (json.dumps([chat_line("a", "q")]), "-i {path} looks like one JSON array"),
        "latin-1-line": (
            # a byte that is not UTF-8 past the first KB: the line is bad, not the file
            "".join(orjson.dumps(chat_line(f"{i}", "question")).decode() + "\n" for i in range(20))
            + json.dumps(chat_line("b", "caf\u00e9"), ensure_ascii=False).replace("\u00e9", "\udce9")
            + "\n",
            "-i {path} has 1 bad line, nothing was sent: line 21: the line is not UTF-8 text",
        ),
    }
    for name, (text, expected) in cases.items():
        path = tmp_path / f"{name}.jsonl"
        if isinstance(text, bytes):
            path.write_bytes(text)
        elif text is not None:
            path.write_bytes(text.encode("utf-8", "surrogateescape"))
        output = tmp_path / f"{name}.out.jsonl"
        result = run_batch_here(capsys, upstream, "-i", str(path), "-o", str(output))
        assert result.returncode == 2, (name, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1, (name, result.stderr)
        assert expected.format(path=path) in result.stderr, (name, result.stderr)
        assert not output.exists(), name
        assert not (tmp_path / f"{name}.out.jsonl.inferproxy").exists(), name  # no state left either
    piped = run_batch_here(capsys, upstream, "-i", "-", "-o", str(tmp_path / "piped.out.jsonl"))
    assert piped.returncode == 2
    assert (
        last_line(piped)
        == "inferproxy run-batch: -i -: run-batch reads a file, not standard input: write it to a file first"
    )
    assert list(upstream.stats()["by_path"]) == ["GET /v1/models"]  # the fixture's readiness wait, nothing else


@pytest.mark.parametrize("kind", ["fifo", "device", "link"])
def test_an_output_that_is_no_regular_file_is_refused_and_left_as_it_is(
    upstream: Upstream, tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    """Renamed over, `-o /dev/null` became a file (a root's run replaced the system's /dev/null), a FIFO too,
    and a link a file in its place."""
    source = write_input(tmp_path / "in.jsonl", [chat_line("a", "question")])
    target = tmp_path / "out"
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "device":
        os.mknod(target, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # a null device of its own
    else:
        (tmp_path / "real.jsonl").write_text("")
        target.symlink_to(tmp_path / "real.jsonl")
    before = os.lstat(target)
    result = run_batch_here(capsys, upstream, "-i", str(source), "-o", str(target))
    assert result.returncode == 2
    said = {"fifo": "is a FIFO, not a file", "device": "is a device, not a file", "link": "is a symbolic link (to "}
    assert last_line(result).startswith(f"inferproxy run-batch: -o {target} {said[kind]}"), result.stderr
    assert (os.lstat(target).st_mode, os.lstat(target).st_ino) == (before.st_mode, before.st_ino)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["in.jsonl", "out", *(["real.jsonl"] * (kind == "link"))]
    )
    assert upstream.stats()["generations"] == 0


@pytest.mark.parametrize("spelling", ["sub/../in.jsonl", "here/in.jsonl"])
def test_the_input_spelled_another_way_as_output_is_refused_and_left_as_it_is(
    upstream: Upstream,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    spelling: str,
) -> None:
    """Compared as written, `-o sub/../in.jsonl` (or through a link to its folder) was renamed over the input."""
    monkeypatch.chdir(tmp_path)
    source = write_input(tmp_path / "in.jsonl", [chat_line("a", "question")])
    (tmp_path / "sub").mkdir()
    (tmp_path / "here").symlink_to(tmp_path)
    before = source.read_bytes()
    result = run_batch_here(capsys, upstream, "-i", "in.jsonl", "-o", spelling)
    assert result.returncode == 2
    assert last_line(result) == f"inferproxy run-batch: -o {spelling} is the input: give another path for the output"
    assert source.read_bytes() == before
    assert upstream.stats()["generations"] == 0


def test_a_state_removed_while_the_run_works_ends_it_in_one_line(slow_upstream: Upstream, tmp_path: Path) -> None:
    _, _, state, args = a_run(slow_upstream, tmp_path)
    with process(*args, read_stderr=True) as proc:
        wait_for_results(state, 20, proc)
        shutil.rmtree(state)
        assert proc.wait(timeout=60) == 1
        said = said_by(proc)
    assert "Traceback" not in "\n".join(said)
    assert said[-1] == (
        f"inferproxy run-batch: the run's state in {state} was removed while it ran, and what it had done with it: "
        f"rerun the same command to start over"
    )


def test_an_input_fifo_nobody_writes_to_does_not_keep_sigterm_from_stopping_it(
    upstream: Upstream, tmp_path: Path
) -> None:
    source = tmp_path / "in.fifo"
    os.mkfifo(source)
    args = ("run-batch", f"--upstream={upstream.url}", *fast(), "-i", str(source), "-o", str(tmp_path / "out.jsonl"))
    with process(*args, read_stderr=True) as proc:
        deadline = time.monotonic() + 30
        while not (tmp_path / "out.jsonl.inferproxy" / "run-batch.json").exists():  # its open of the FIFO blocks
            assert time.monotonic() < deadline
            assert proc.poll() is None
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        said = said_by(proc)[-1]
    assert (
        said == "inferproxy run-batch: stopped by SIGTERM before the batch started; rerun the same command to carry on"
    )


def test_another_input_on_the_same_state_is_refused(upstream: Upstream, tmp_path: Path) -> None:
    first = write_input(tmp_path / "first.jsonl", [chat_line("a", "question")])
    second = write_input(tmp_path / "second.jsonl", [chat_line("b", "another question")])
    output = tmp_path / "out.jsonl"
    assert run_batch(upstream, "-i", str(first), "-o", str(output)).returncode == 0
    result = run_batch(upstream, "-i", str(second), "-o", str(output))
    assert result.returncode == 2
    assert last_line(result) == (
        f"inferproxy run-batch: {output}.inferproxy holds the run of another input ({first}, {first.stat().st_size} "
        f"bytes), not of -i {second}: give another -o or --checkpoints-dir, or delete {output}.inferproxy to start over"
    )
    assert output_of(output)[0]["custom_id"] == "a"


def test_an_input_edited_in_place_is_refused_saying_it_changed(upstream: Upstream, tmp_path: Path) -> None:
    source = write_input(tmp_path / "edit.jsonl", [chat_line("a", "question 1")])
    output, state = tmp_path / "out.jsonl", tmp_path / "out.jsonl.inferproxy"
    assert run_batch(upstream, "-i", str(source), "-o", str(output)).returncode == 0
    to_start_over = f"give another -o or --checkpoints-dir, or delete {state} to start over"
    for edited, then in (
        ([chat_line("a", "question 2")], "same path and size, other content"),
        ([chat_line("a", "question 22")], f"{source.stat().st_size} bytes then, {source.stat().st_size + 1} now"),
    ):
        write_input(source, edited)
        result = run_batch(upstream, "-i", str(source), "-o", str(output))
        assert result.returncode == 2, result.stderr
        assert last_line(result) == f"inferproxy run-batch: -i {source} has changed since this run began ({then}): " + (
            to_start_over
        )
    assert output_of(output)[0]["response"]["status_code"] == 200  # the first run's output, untouched
    assert upstream.stats()["generations"] == 1


def test_an_object_store_output_needs_a_checkpoints_dir(tmp_path: Path) -> None:
    source = write_input(tmp_path / "in.jsonl", [chat_line("a", "question")])
    result = run_cli("run-batch", "-i", str(source), "-o", "s3://bucket/out.jsonl")
    assert result.returncode == 2
    assert last_line(result).startswith(
        "inferproxy run-batch: -o s3://bucket/out.jsonl is an object store: give --checkpoints-dir"
    )


def test_input_and_output_on_s3(upstream: Upstream, tmp_path: Path, s3: S3) -> None:  # noqa: F811
    lines = [chat_line(f"line-{i}", f"question {i}") for i in range(25)]
    s3.client.put_object(Bucket=s3.bucket, Key="in/batch.jsonl", Body=b"".join(orjson.dumps(x) + b"\n" for x in lines))
    result = run_batch(
        upstream,
        "-i",
        f"s3://{s3.bucket}/in/batch.jsonl",
        "-o",
        f"s3://{s3.bucket}/out/answers.jsonl",
        f"--checkpoints-dir={tmp_path / 'state'}",
        env={**os.environ, **s3.env},
    )
    assert result.returncode == 0, result.stderr
    written = s3.objects()["out/answers.jsonl"]
    assert [orjson.loads(x)["custom_id"] for x in written.splitlines()] == [x["custom_id"] for x in lines]
    assert len(s3.puts("out/answers.jsonl")) == 1  # uploaded once, whole


def test_results_in_order_gives_each_lines_first_result_by_line_number(tmp_path: Path) -> None:
    folder = BatchDir(tmp_path / "batch")
    folder.root.mkdir()

    def result(line: int, ok: bool, n: str) -> Result:
        return Result(line, ok, (0, 0), orjson.dumps({"n": n}))

    folder.append([result(3, True, "3"), result(1, False, "1"), result(3, True, "3 again")], fsync=False)
    folder.append([result(20, True, "20")], fsync=False)
    folder.close_results()
    with (folder.root / "results.jsonl").open("ab") as f:
        f.write(b'{"line": 2, "ok": tr')  # a torn tail: no result
    assert [orjson.loads(r.out)["n"] for r in folder.results_in_order()] == ["1", "3", "20"]


class Terminal(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_progress_is_a_bar_redrawn_in_place_on_a_terminal_and_a_line_every_30_s_elsewhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = [100.0]
    monkeypatch.setattr(report_module.time, "monotonic", lambda: clock[0])
    for tty in (True, False):
        stream = Terminal(tty)
        progress = run_batch_module.Progress(stream)
        progress.update(0, 0, 0)  # still being checked (no total yet): nothing shown
        progress.update(100, 0, 1000)
        clock[0] += 10
        progress.update(200, 3, 1000)  # 10 s later: redrawn on a terminal, not yet in a log
        clock[0] += 30
        progress.update(500, 5, 1000)
        progress.update(1000, 5, 1000, final=True)
        text = stream.getvalue()
        if tty:
            assert text.startswith("\rrun-batch [##--------------------")
            assert text.endswith("\n")
            assert (
                "\rrun-batch [#####-------------------] 200/1,000 lines 20%, 3 failed, 10.0 lines/s ETA 1m20s" in text
            )
        else:
            assert text.splitlines() == [
                "run-batch 100/1,000 lines 10%, 0 failed",
                "run-batch 500/1,000 lines 50%, 5 failed, 10.0 lines/s ETA 50s",
                "run-batch 1,000/1,000 lines 100%, 5 failed, 22.5 lines/s",
            ]


def test_an_s3_input_that_cannot_be_reached_is_refused_in_one_line_naming_why(
    upstream: Upstream,
    tmp_path: Path,
    s3: S3,  # noqa: F811
) -> None:
    s3.client.put_object(Bucket=s3.bucket, Key="in.jsonl", Body=orjson.dumps(chat_line("a", "question")) + b"\n")
    url = f"s3://{s3.bucket}/in.jsonl"
    no_credentials = {k: v for k, v in s3.env.items() if not k.startswith("AWS_ACCESS") and "SECRET" not in k}
    # nothing listens there; botocore tries once (its retries took most of this test's 19 s)
    unreachable = {**s3.env, "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{free_port()}", "AWS_MAX_ATTEMPTS": "1"}
    cases = {
        "no-credentials": (no_credentials, f"-i {url} cannot be reached (NoCredentialsError: "),
        "unreachable": (unreachable, f"-i {url} cannot be reached (EndpointConnectionError: "),
        "missing": (s3.env, f"-i s3://{s3.bucket}/missing.jsonl: no such object"),
    }
    for name, (env, expected) in cases.items():
        output = tmp_path / f"{name}.jsonl"
        source = url if name != "missing" else f"s3://{s3.bucket}/missing.jsonl"
        environ = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")} | env
        result = run_cli(
            "run-batch", f"--upstream={upstream.url}", "-i", source, "-o", str(output), timeout=60, env=environ
        )
        assert result.returncode == 2, (name, result.stderr)
        assert result.stderr.count("\n") == 1, (name, result.stderr)  # one line, no traceback
        assert result.stderr.startswith(f"inferproxy run-batch: {expected}"), (name, result.stderr)
        if name != "missing":
            assert result.stderr.endswith(": check the URL, the endpoint and the credentials\n"), result.stderr
        assert not output.exists(), name
        assert not (tmp_path / f"{name}.jsonl.inferproxy").exists(), name  # no state left either
    assert list(upstream.stats()["by_path"]) == ["GET /v1/models"]  # the fixture's readiness wait, nothing else


def test_a_state_another_run_batch_works_on_is_refused_with_exit_2(upstream: Upstream, tmp_path: Path) -> None:
    source = write_input(tmp_path / "in.jsonl", [chat_line("a", "question")])
    output, state = tmp_path / "out.jsonl", tmp_path / "out.jsonl.inferproxy"
    state.mkdir()
    with (state / "run-batch.lock").open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a run-batch at work on it holds it
        result = run_batch(upstream, "-i", str(source), "-o", str(output))
    assert result.returncode == 2, result.stderr
    assert last_line(result) == (
        f"inferproxy run-batch: another inferproxy run-batch works on {state} (it holds run-batch.lock): wait for "
        f"it, or stop it"
    )
    assert not output.exists()
    assert upstream.stats()["generations"] == 0


def test_a_run_batch_that_loses_the_race_for_a_new_state_leaves_the_winners_state_alone(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Two run-batch started at once on a state that does not exist yet: both see no folder, one takes the lock.
    # The other is made to lose, deterministically: the winner's folder, lock and state appear just before it
    # creates the folder itself (it used to remove them, as a fresh run that failed).
    source = write_input(tmp_path / "in.jsonl", [chat_line("a", "question")])
    output, state = tmp_path / "out.jsonl", tmp_path / "out.jsonl.inferproxy"
    winners = b'{"input": "the winner\'s"}'
    held: list[IO[str]] = []
    make_dirs_durable = state_module.make_dirs_durable

    def winner_first(path: str) -> None:
        if not held:
            state.mkdir()
            held.append((state / "run-batch.lock").open("w"))
            fcntl.flock(held[0], fcntl.LOCK_EX | fcntl.LOCK_NB)
            (state / "run-batch.json").write_bytes(winners)
        make_dirs_durable(path)

    monkeypatch.setattr(state_module, "make_dirs_durable", winner_first)
    settings = Settings(upstream=[f"http://127.0.0.1:{free_port()}"])
    said = io.StringIO()
    try:
        code = run_batch_module.main(run_batch_module.Options(str(source), str(output), settings, state), said)
        assert held, "the run never created the state's folder"
        assert code == 2, said.getvalue()
        assert said.getvalue() == (
            f"inferproxy run-batch: another inferproxy run-batch works on {state} (it holds run-batch.lock): wait "
            f"for it, or stop it\n"
        )
        assert sorted(os.listdir(state)) == ["run-batch.json", "run-batch.lock"]
        assert (state / "run-batch.json").read_bytes() == winners
        assert not output.exists()
    finally:
        for lock in held:
            lock.close()


def test_a_lock_file_removed_before_it_was_locked_is_opened_again_in_the_new_folder(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A run that created the state and failed removes it, lock file and all, before unlocking: a run that opened
    # that lock file meanwhile would lock an inode no later run opens, and two would share the state.
    state = tmp_path / "state"
    flock = fcntl.flock
    removed: list[bool] = []

    def removed_first(fd: int, operation: int) -> None:
        if not removed:
            removed.append(True)
            shutil.rmtree(state)  # as the previous holder does, just before it unlocks
        flock(fd, operation)

    monkeypatch.setattr(state_module.fcntl, "flock", removed_first)
    taken = run_batch_module.State(state)
    taken.lock()
    monkeypatch.undo()
    try:
        assert removed
        with (state / "run-batch.lock").open("w") as other, pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the folder's lock file is the one held
        assert taken.created  # made again by this run, and empty: its own
    finally:
        taken.unlock()


def test_copies_of_the_input_a_kill_cut_short_are_swept_by_the_next_run(upstream: Upstream, tmp_path: Path) -> None:
    lines = [chat_line(f"line-{i}", f"question {i}") for i in range(5)]
    source = write_input(tmp_path / "in.jsonl", lines)
    output, state = tmp_path / "out.jsonl", tmp_path / "out.jsonl.inferproxy"
    # killed (SIGKILL) twice while copying the input into the state: each time its ids reserved in run-batch.json,
    # its copy a `.part` as large as what was read, just now (not an hour ago, as a shared store's sweep waits for)
    files = FileStore(state / "files", fsync=False)
    files.open()
    parts = []
    for _ in range(2):
        cut = files.start("in.jsonl", "batch")
        cut.write(source.read_bytes()[:100])
        cut.finish(fsync=False)  # its descriptor closed, as the killed process's are
        parts.append(cut.part)
        reserved = {"input": str(source), "input_file_id": cut.id, "batch_id": new_batch_id(time.time())}
        (state / "run-batch.json").write_bytes(orjson.dumps(reserved))
    assert all(part.stat().st_size == 100 for part in parts)
    result = run_batch(upstream, "-i", str(source), "-o", str(output))
    assert result.returncode == 0, result.stderr
    assert [o["custom_id"] for o in output_of(output)] == [line["custom_id"] for line in lines]
    assert not [part.name for part in parts if part.exists()]
    assert not [name for name in os.listdir(state / "files") if name.endswith(".part")]


def test_a_log_record_written_while_the_bar_is_shown_gets_a_line_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(report_module.time, "monotonic", lambda: clock[0])
    terminal = Terminal(True)
    with logging_to(terminal) as logger:
        with run_batch_module.Progress(terminal) as progress:
            progress.update(1, 0, 3)
            logger.warning("batch batch_x: completed")  # as the engine logs while the bar is shown
            clock[0] += 1
            progress.update(3, 0, 3, final=True)
        logger.warning("after the run")
    rows = screen(terminal.getvalue())
    assert rows == [
        "WARNING batch batch_x: completed",
        "run-batch [########################] 3/3 lines 100%, 0 failed, 2.0 lines/s",
        "WARNING after the run",
        "",
    ], rows
