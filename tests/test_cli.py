from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from app.cli import build_job_parser, build_parser, flag_name, main, parse
from app.service.settings import Settings
from tests.servers import serve_once


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {**action.choices, "demo-job": build_job_parser()}


@pytest.mark.parametrize("command", ["serve", "run-batch", "fake-upstream", "demo", "demo-job", "inspect"])
def test_every_option_of_every_subcommand_has_a_help_text_and_no_none_default(command: str) -> None:
    parser = subcommands()[command]
    for action in parser._actions:
        assert action.help, f"{command} {action.option_strings} has no help text"
    assert "None" not in parser.format_help()


ROOT = Path(__file__).parent.parent
#: `inferproxy SUBCOMMAND ARGS` in prose or a shell line (a line's `\\`-continuations joined), up to what
#: ends a command in them: a backquote, a quote, a pipe, `;`, `&`, `#`, `)`.
COMMAND = re.compile(r"inferproxy ([a-z][a-z-]+)((?: +[^\s`\"'|;&#)]+)*)")


def documented_commands() -> list[tuple[str, str, str]]:
    """`(file, subcommand, its arguments)` of every `inferproxy ...` command line of the README, docs/,
    bench/ and examples/."""
    files = [
        ROOT / "README.md",
        *ROOT.glob("docs/**/*.md"),
        *ROOT.glob("bench/**/*.md"),
        *(p for p in ROOT.glob("examples/*") if p.is_file()),
    ]
    found = []
    for path in files:
        text = re.sub(r"\\{1,2}\n\s*", " ", path.read_text())
        found += [(path.name, m[1], m[2]) for m in COMMAND.finditer(text) if m[1] in subcommands()]
    return found


def test_every_flag_of_a_documented_command_line_is_one_the_command_takes() -> None:
    # examples/datatrove_slurm.py said `inferproxy status --url ...`: status takes the URL as its argument.
    commands = documented_commands()
    assert {subcommand for _, subcommand, _ in commands} >= {"serve", "status", "inspect", "run-batch", "demo"}
    wrong = [
        f"{name}: inferproxy {subcommand}{args}: no {flag}"
        for name, subcommand, args in commands
        for flag in re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", args)
        if flag.split("=")[0] not in subcommands()[subcommand]._option_string_actions
    ]
    assert wrong == []


def test_the_help_lists_the_users_commands_and_not_the_demos_internal_job() -> None:
    listed = build_parser().format_help()
    for command in ("serve", "run-batch", "fake-upstream", "demo", "inspect", "status"):
        assert f"\n    {command} " in listed, command
    assert "demo-job" not in listed
    assert "the job `demo` runs" in subcommands()["demo-job"].format_help()  # still there for `demo`


def test_an_unknown_command_is_refused_without_naming_the_demos_internal_job(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse(["foo"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'foo'" in err
    assert "demo-job" not in err
    assert parse(["demo-job", "--proxy=http://a"]).command == "demo-job"


@pytest.mark.parametrize("command", ["serve", "inspect", "status", "demo"])
def test_an_unknown_flag_is_refused_with_the_commands_own_usage(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [command, *(["ckpt"] if command == "inspect" else []), "--bogus"]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: inferproxy {command} ")
    assert err.endswith(f"inferproxy {command}: error: unrecognized arguments: --bogus\n")


def test_serve_help_shows_each_settings_real_default() -> None:
    serve = subcommands()["serve"]
    helps = {action.dest: action.help or "" for action in serve._actions}
    assert "(default: 8080)" in helps["port"]
    assert "(default: http://127.0.0.1:8000)" in helps["upstream"]
    assert "(default: 400)" in helps["cache_error_statuses"]
    assert "(default: info)" in helps["log_level"]
    assert "(default: not set)" in helps["api_key"]
    for name in Settings.model_fields:
        assert "default:" in helps[name], f"{flag_name(name)} does not show its default"


def test_run_batch_takes_vllms_i_and_o_and_every_setting_of_serve_it_has_a_use_for() -> None:
    from app.cli import RUN_BATCH_SKIPS

    run_batch = subcommands()["run-batch"]
    flags = {o for action in run_batch._actions for o in action.option_strings}
    assert {"-i", "--input-file", "-o", "--output-file"} <= flags
    for name in Settings.model_fields:
        assert (flag_name(name) in flags) == (name not in RUN_BATCH_SKIPS), name
    args = parse(["run-batch", "-i", "in.jsonl", "-o", "out.jsonl", "--upstream=http://a:8000", "--batch-retries=3"])
    assert (args.input_file, args.output_file, args.upstream, args.batch_retries) == (
        "in.jsonl",
        "out.jsonl",
        ["http://a:8000"],
        "3",
    )


def test_run_batch_with_a_bad_setting_names_it_in_one_line_and_exits_2(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "app.cli", "run-batch", "-i", "x", "-o", str(tmp_path / "o"), "--batch-retries=-1"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("inferproxy run-batch: invalid settings:\n  --batch-retries: ")
    assert not (tmp_path / "o.inferproxy").exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["fake-upstream", "--port", "abc"], "argument --port: must be an integer >= 0, got 'abc'"),
        (["fake-upstream", "--latency-ms", "x"], "argument --latency-ms: must be a number of milliseconds from 0 to"),
        # an endless generation made a process that SIGTERM did not stop; a port past 65535 a traceback
        (["fake-upstream", "--latency-ms", "inf"], "argument --latency-ms: must be a number of milliseconds from 0 to"),
        (["demo", "--latency-ms", "1e300"], "argument --latency-ms: must be a number of milliseconds from 0 to"),
        (["fake-upstream", "--port", "70000"], "argument --port: must be a port from 0 to 65535, got '70000'"),
        (["inspect", "x", "--rank", "100000"], "argument --rank: must be a rank from 0 to 99999, got '100000'"),
        (["demo", "--documents", "0"], "argument --documents: must be an integer > 0, got '0'"),
        (["demo", "--kills", "two"], "argument --kills: must be an integer >= 0, got 'two'"),
        (["demo", "--seed", "x"], "argument --seed: must be an integer, got 'x'"),
        (
            ["demo-job", "--proxy=http://a", "--rollouts", "1.5"],
            "argument --rollouts: must be an integer > 0, got '1.5'",
        ),
    ],
)
def test_a_bad_option_value_names_the_flag_and_what_it_takes(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert "invalid" not in err  # argparse's "invalid _non_negative value" names a function


def test_the_log_level_is_taken_in_any_case_from_flag_environment_and_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = build_parser().parse_args(["serve", "--log-level", "DEBUG"])
    assert Settings.load(None, log_level=args.log_level).log_level == "debug"
    monkeypatch.setenv("INFERPROXY_LOG_LEVEL", "Warning")
    assert Settings.load().log_level == "warning"
    monkeypatch.delenv("INFERPROXY_LOG_LEVEL")
    config = tmp_path / "c.toml"
    config.write_text('log_level = "ERROR"\n')
    assert Settings.load(config).log_level == "error"


def test_fake_upstream_on_a_busy_port_fails_in_one_line_without_its_banner(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import socket

    from app.cli import main

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert main(["fake-upstream", f"--port={port}"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"inferproxy fake-upstream: cannot listen on 127.0.0.1:{port}: ")
    assert err.count("\n") == 1
    assert "simulator" not in err


def test_fake_upstream_prints_its_banner_once_listening_with_the_port_it_took() -> None:
    import re
    import urllib.request

    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "fake-upstream", "--port=0"], stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stderr is not None
        banner = proc.stderr.readline()
        match = re.search(r"on (http://127\.0\.0\.1:(\d+))/v1 ", banner)
        assert match, banner
        assert match[2] != "0"
        # The banner comes once the port is bound: a client may connect at once.
        with urllib.request.urlopen(match[1] + "/v1/models", timeout=10) as answer:
            assert answer.status == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        if proc.stderr is not None:
            proc.stderr.close()


def test_demo_against_an_upstream_that_does_not_answer_says_so_in_one_line(tmp_path: Path) -> None:
    import socket

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    upstream = f"http://127.0.0.1:{port}"
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", "demo", f"--upstream={upstream}", f"--workdir={tmp_path / 'demo'}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert f"the upstream {upstream} does not answer" in lines[0]
    assert "leave --upstream out" in lines[0]


@pytest.mark.parametrize("output", ["ckpt", "ckpt/out", "ckpt/./out/.."])
def test_serve_with_its_output_in_its_checkpoints_dir_refuses_in_one_line_creating_nothing(
    tmp_path: Path, output: str
) -> None:
    # With --output-filename '${rank}/chunk_${chunk_index}.jsonl' a rank's chunk file was its own
    # publication, deleted as published: the documents were gone from both.
    done = serve_once(tmp_path / "ckpt", tmp_path / output)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.startswith(f"inferproxy serve: --output {tmp_path / output} is inside the checkpoints dir ")
    assert done.stderr.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("template", "refused"),
    [
        ("ckpt/${rank}/chunk_0000${chunk_index}.jsonl", True),  # rank 0's chunk 0 onto its own chunk file
        ("./ckpt/x/${rank}_${chunk_index}.jsonl", True),
        ("${rank}/chunk_${chunk_index}.jsonl", False),
        ("other/${rank}_chunk_${chunk_index}.jsonl", False),
        ("${rank}_chunk_${chunk_index}.jsonl", False),
    ],
)
def test_an_output_holding_the_checkpoints_dir_is_refused_where_its_filename_leads_into_them(
    tmp_path: Path, template: str, refused: bool
) -> None:
    # A review: the output the checkpoints dir's parent, the template walking into it, published rank 0's
    # chunk 0 onto its own checkpoint file, as the output inside the checkpoints dir did.
    from app.cli import check_output_apart

    data = tmp_path / "data"
    settings = Settings(checkpoints_dir=data / "ckpt", output=str(data), output_filename=template)
    if refused:
        with pytest.raises(ValueError, match="which holds the checkpoints dir"):
            check_output_apart(settings)
    else:
        check_output_apart(settings)


def test_serve_on_a_checkpoints_dir_whose_meta_file_is_a_link_refuses_in_one_line(tmp_path: Path) -> None:
    checkpoints = tmp_path / "ckpt"
    checkpoints.mkdir()
    (tmp_path / "elsewhere.json").write_text('{"records_per_chunk": 6000}')
    (checkpoints / "checkpoint_meta.json").symlink_to(tmp_path / "elsewhere.json")
    done = serve_once(checkpoints, tmp_path / "out")
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.startswith(
        f"inferproxy serve: {checkpoints / 'checkpoint_meta.json'} is a symbolic link, not a regular file: "
    )
    assert done.stderr.count("\n") == 1


@pytest.mark.parametrize("command", [["inspect", "{root}"], ["inspect", "{root}", "--json"]])
def test_a_reader_that_stops_reading_ends_the_command_quietly(tmp_path: Path, command: list[str]) -> None:
    # `inferproxy status --once | head -1`, `inferproxy inspect DIR --json | head`: the reader has gone
    # before the command writes (its end of the pipe closed before the command starts).
    import os

    (tmp_path / "checkpoint_meta.json").write_text('{"records_per_chunk": 3}')
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "app.cli", *(arg.format(root=tmp_path) for arg in command)],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        os.close(write)
    assert done.stderr == ""
    assert done.returncode == 1


def test_demo_on_a_workdir_that_is_a_file_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit) as exit_:
        main(["demo", f"--workdir={tmp_path / 'file'}"])
    assert exit_.value.code == (
        f"inferproxy demo: --workdir {tmp_path / 'file'}: {tmp_path / 'file'} is a file, not a folder: "
        "choose another folder"
    )
    assert (tmp_path / "file").read_text() == "x"
