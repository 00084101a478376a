from __future__ import annotations

import ast
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

import app.cli
from app.cli import build_parser, flag_name
from app.service.limits import default_max_connections
from app.service.settings import Settings
from app.store.layout import CheckpointsLayout
from app.store.ownership import RankOwnership
from tests.jobs import settings
from tests.servers import serve_proxy

ROOT = Path(__file__).resolve().parents[2]


def test_flags_beat_environment_beat_file_beat_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "c.toml"
    config.write_text('port = 1111\nupstream_retries = 7\nlog_level = "debug"\n')
    monkeypatch.setenv("INFERPROXY_PORT", "2222")
    monkeypatch.setenv("INFERPROXY_UPSTREAM_RETRIES", "5")
    settings = Settings.load(config, port=3333)
    assert settings.port == 3333  # flag
    assert settings.upstream_retries == 5  # environment over file
    assert settings.log_level == "debug"  # file over default
    assert settings.max_body_bytes == 32 * 1024 * 1024  # default


def test_lists_come_from_json_or_commas_and_upstreams_are_normalised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERPROXY_UPSTREAM", "http://a:8000/v1/, http://b:8000")
    monkeypatch.setenv("INFERPROXY_CACHE_ERROR_STATUSES", "[400, 422]")
    settings = Settings.load()
    assert settings.upstream == ["http://a:8000", "http://b:8000"]
    assert settings.cache_error_statuses == [400, 422]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("upstream", ["localhost:8000"], "an upstream is an http"),
        ("upstream", ["http://127.0.0.1:80x0"], "an upstream is an http"),
        ("upstream", ["http://:8000"], "an upstream is an http"),
        ("cache_error_statuses", [429], "cache_error_statuses may hold 4xx statuses other than"),
        ("cache_error_statuses", [500], "cache_error_statuses may hold 4xx"),
        ("port", 70000, "less than or equal to 65535"),
        ("fsync", "sometimes", "'always' or 'never'"),
        ("routing", "random", "'affinity' or 'least-inflight'"),
        ("affinity_load_bound", 0, "greater than 0"),
        ("checkpoints_dir", "s3://bucket/checkpoints", "the checkpoints dir is a local path"),
    ],
)
def test_bad_values_are_refused_saying_what_is_expected(field: str, value: object, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        Settings.load(**{field: value})


def test_an_unknown_key_in_the_file_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text("prot = 1\n")
    with pytest.raises(ValidationError, match="prot"):
        Settings.load(config)


def test_an_unknown_key_in_the_file_names_the_setting_it_is_likely_a_misspelling_of(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from app.cli import main

    config = tmp_path / "bad.toml"
    config.write_text('upstrem = "http://a"\napi-key = "k"\nzzzz = 1\n')
    assert main(["serve", f"--config={config}"]) == 2
    assert capsys.readouterr().err.splitlines()[1:] == [
        f"  {config}: unknown setting 'upstrem' (did you mean 'upstream'?)",
        f"  {config}: unknown setting 'api-key' (did you mean 'api_key'?)",
        f"  {config}: unknown setting 'zzzz': the settings are listed in the README's Configuration table "
        "(and in configs/inferproxy.toml, with their defaults)",
    ]


def test_a_misspelt_variable_is_said_not_ignored_in_silence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from app.cli import main

    monkeypatch.setenv("INFERPROXY_UPSTREAM_RETRYS", "4")
    monkeypatch.setenv("INFERPROXY_SOMETHING_ELSE", "x")
    (tmp_path / "a-file").write_text("")  # a checkpoints dir that is a file: serve stops after the warning
    assert main(["serve", "--upstream=http://127.0.0.1:9", f"--checkpoints-dir={tmp_path / 'a-file'}"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[:2] == [
        "inferproxy serve: warning: INFERPROXY_SOMETHING_ELSE is no setting, and is ignored: the settings are in "
        "the README's Configuration table",
        "inferproxy serve: warning: INFERPROXY_UPSTREAM_RETRYS is no setting, and is ignored: did you mean "
        "INFERPROXY_UPSTREAM_RETRIES?",
    ]
    assert len(lines) == 3
    assert "--checkpoints-dir" in lines[2]
    # said also when the settings themselves are refused: the misspelling may be why
    monkeypatch.setenv("INFERPROXY_PORT", "abc")
    assert main(["serve", "--upstream=http://127.0.0.1:9"]) == 2
    refused = capsys.readouterr().err.splitlines()
    assert refused[1].startswith("inferproxy serve: warning: INFERPROXY_UPSTREAM_RETRYS is no setting")
    assert "INFERPROXY_PORT" in refused[-1]


def test_an_upstream_given_twice_is_refused() -> None:
    with pytest.raises(ValidationError, match=r"the upstream http://a:8000 is given twice \(as 'http://a:8000/v1/'\)"):
        Settings.load(upstream=["http://a:8000", "http://b:8000", "http://a:8000/v1/"])
    for same in ("http://A:8000", "http://user:pw@a:8000"):
        with pytest.raises(ValidationError, match="is given twice"):
            Settings.load(upstream=["http://a:8000", same])
    with pytest.raises(ValidationError, match="the upstream http://a is given twice"):
        Settings.load(upstream=["http://a", "http://a:80"])
    assert Settings.load(upstream=["http://a:8000", "http://a:8001", "https://a:8000"]).upstream == [
        "http://a:8000",
        "http://a:8001",
        "https://a:8000",
    ]


def test_a_missing_config_file_is_named() -> None:
    with pytest.raises(FileNotFoundError, match=r"nope\.toml does not exist"):
        Settings.load(Path("nope.toml"))


@pytest.mark.parametrize("name", ["inferproxy.toml", "replicas.toml"])
def test_the_example_configs_load(name: str) -> None:
    Settings.load(ROOT / "configs" / name)


def test_the_full_example_config_spells_out_every_setting_with_its_default() -> None:
    import tomllib

    values = tomllib.loads((ROOT / "configs" / "inferproxy.toml").read_text())
    unset_by_default = {name for name, info in Settings.model_fields.items() if info.default is None}
    assert set(values) == set(Settings.model_fields) - unset_by_default  # TOML has no null: those are comments
    assert Settings.load(ROOT / "configs" / "inferproxy.toml") == Settings()


def test_every_setting_is_a_serve_flag_and_a_readme_row() -> None:
    readme = (ROOT / "README.md").read_text()
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    flags = {option for action in serve._actions for option in action.option_strings}
    for name in Settings.model_fields:
        assert flag_name(name) in flags
        assert re.search(rf"^\| `{name}` \|", readme, re.MULTILINE), f"README's settings table lacks {name}"


def test_serve_with_bad_settings_exits_2_naming_the_setting(capsys: pytest.CaptureFixture[str]) -> None:
    from app.cli import main

    assert main(["serve", "--port", "99999"]) == 2
    assert "port" in capsys.readouterr().err


def test_serve_refuses_checkpoints_written_with_another_records_per_chunk(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from app.cli import main

    (tmp_path / "checkpoint_meta.json").write_text('{"records_per_chunk": 6000}')
    assert main(["serve", f"--checkpoints-dir={tmp_path}", "--records-per-chunk=100"]) == 2
    err = capsys.readouterr().err
    assert "written with records_per_chunk=6000, this run uses records_per_chunk=100" in err
    assert "--records-per-chunk 6000" in err
    assert "--checkpoints-dir" in err
    assert not (tmp_path / "owners").exists()  # refused before anything was created


def test_serve_that_cannot_start_says_why_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket

    from app.cli import main

    (tmp_path / "a-file").write_text("")
    common = ["serve", "--upstream=http://127.0.0.1:9", f"--output={tmp_path / 'out'}"]
    assert main([*common, f"--checkpoints-dir={tmp_path / 'a-file' / 'ckpt'}"]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"inferproxy serve: --checkpoints-dir {tmp_path / 'a-file' / 'ckpt'}: {tmp_path / 'a-file'} is a file, "
        "not a folder: choose another folder\n"
    )
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        for http in ("builtin", "uvicorn"):
            assert main([*common, f"--checkpoints-dir={tmp_path / 'ckpt'}", f"--port={port}", f"--http={http}"]) == 1
            assert capsys.readouterr().err == (
                f"inferproxy serve: cannot listen on 127.0.0.1:{port}: Address already in use: stop what listens "
                "there, or choose another --port (or --host)\n"
            )
            assert not (tmp_path / "ckpt").exists()  # refused before anything was created
        # Taken between the check and the listen: the failed start releases every rank it had.
        monkeypatch.setattr(app.cli, "check_port", lambda host, port: None)
        assert main([*common, f"--checkpoints-dir={tmp_path / 'raced'}", f"--port={port}"]) == 1
        assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
        RankOwnership(CheckpointsLayout(str(tmp_path / "raced"))).claim(0)
        monkeypatch.undo()
    assert main([*common, f"--checkpoints-dir={tmp_path / 'ckpt'}", "--host=no-such-host.invalid"]) == 1
    assert "give an address of this machine as --host" in capsys.readouterr().err
    assert not (tmp_path / "ckpt").exists()


def test_the_server_limits_in_the_settings_reach_the_built_in_server(tmp_path: Path) -> None:
    from app.http.server import HTTPServer
    from app.service.app import create_server

    settings = Settings(checkpoints_dir=tmp_path, head_timeout_s=2.5, shutdown_grace_s=7.0)
    server = create_server(settings)
    assert isinstance(server, HTTPServer)
    assert (server.head_timeout_s, server.shutdown_grace_s) == (2.5, 7.0)


def test_list_flags_take_repeats_commas_or_json(tmp_path: Path) -> None:
    parser = build_parser()
    upstreams = ["--upstream", "http://a:8000,http://b:8000", "--upstream", "http://c:8000"]
    args = parser.parse_args(
        ["serve", *upstreams, "--cache-error-statuses", "400,422", "--checkpoints-dir", str(tmp_path)]
    )
    flags = {name: getattr(args, name) for name in Settings.model_fields}
    settings = Settings.load(None, **flags)
    assert settings.upstream == ["http://a:8000", "http://b:8000", "http://c:8000"]
    assert settings.cache_error_statuses == [400, 422]
    json_args = parser.parse_args(["serve", "--upstream", '["http://a:1", "http://b:2"]'])
    assert Settings.load(None, upstream=json_args.upstream).upstream == ["http://a:1", "http://b:2"]


def test_a_toml_syntax_error_names_the_file_line_and_column(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from app.cli import main

    config = tmp_path / "x.toml"
    config.write_text("port = 8x\n")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(config))}: line 1, column 9: Expected newline"):
        Settings.load(config)
    assert main(["serve", f"--config={config}"]) == 2
    assert f"{config}: line 1, column 9: " in capsys.readouterr().err


def test_a_bad_value_is_named_where_it_was_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from app.cli import main

    config = tmp_path / "x.toml"
    config.write_text('port = "abc"\n')
    assert main(["serve", f"--config={config}"]) == 2
    err = capsys.readouterr().err
    assert f"{config}: port: Input should be a valid integer" in err
    assert "--port" not in err
    monkeypatch.setenv("INFERPROXY_PORT", "xyz")  # the environment wins over the file: it is the one named
    assert main(["serve", f"--config={config}"]) == 2
    assert "  INFERPROXY_PORT: Input should be a valid integer" in capsys.readouterr().err
    assert main(["serve", f"--config={config}", "--port=99999"]) == 2
    assert "  --port: Input should be less than or equal to 65535" in capsys.readouterr().err
    assert main(["serve", "--checkpoints-dir=s3://bucket/checkpoints"]) == 2
    err = capsys.readouterr().err
    assert "  --checkpoints-dir: the checkpoints dir is a local path (a shared filesystem works), not a URL" in err


def test_inferproxy_config_names_the_config_file_and_the_flag_wins_over_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from_env = tmp_path / "env.toml"
    from_env.write_text("port = 1111\n")
    from_flag = tmp_path / "flag.toml"
    from_flag.write_text("port = 2222\n")
    monkeypatch.setenv("INFERPROXY_CONFIG", str(from_env))
    assert Settings.load().port == 1111
    assert Settings.load(from_flag).port == 2222
    monkeypatch.setenv("INFERPROXY_CONFIG", str(tmp_path / "nope.toml"))
    with pytest.raises(FileNotFoundError, match=r"nope\.toml \(from INFERPROXY_CONFIG\) does not exist"):
        Settings.load()


async def test_the_settings_logged_at_start_show_the_connection_limit_in_force(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Not `None` when derived from the open files limit: an operator reads the number that applies.
    caplog.set_level(logging.INFO, logger="app.service.app")
    async with serve_proxy(settings(tmp_path, "http://127.0.0.1:9")):
        pass
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("settings: ")]
    assert len(logged) == 1
    shown = ast.literal_eval(logged[0].removeprefix("settings: "))
    assert shown["max_connections"] == default_max_connections(shown["max_open_ranks"]) > 0


def test_a_config_file_that_is_a_folder_or_not_utf8_is_named_with_what_to_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from app.cli import main

    assert main(["serve", f"--config={tmp_path}"]) == 2
    assert (
        capsys.readouterr().err == f"inferproxy serve: config file {tmp_path} is a folder: give the TOML file in it\n"
    )
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes('output = "sortie-d\xe9j\xe0"\n'.encode("latin-1"))
    assert main(["serve", f"--config={latin1}"]) == 2
    assert capsys.readouterr().err == (
        f"inferproxy serve: config file {latin1} is not UTF-8 text (byte 18): save it as UTF-8 TOML\n"
    )


@pytest.mark.parametrize("command", ["serve", "run-batch"])
def test_a_config_file_that_cannot_be_read_or_is_no_file_is_one_line(tmp_path: Path, command: str) -> None:
    # An unreadable file (or one in a folder that cannot be entered) was a PermissionError traceback from
    # the TOML reader; a FIFO was said not to exist.
    without_capabilities = ["setpriv", "--bounding-set=-all", "--inh-caps=-all"] if os.geteuid() == 0 else []
    unreadable, shut, fifo = tmp_path / "c.toml", tmp_path / "shut", tmp_path / "fifo.toml"
    unreadable.write_text("port = 1\n")
    unreadable.chmod(0)
    shut.mkdir()
    (shut / "c.toml").write_text("port = 1\n")
    shut.chmod(0)
    os.mkfifo(fifo)
    extra = ["-i", str(tmp_path / "in"), "-o", str(tmp_path / "out")] if command == "run-batch" else []
    expected = {
        unreadable: f"config file {unreadable} cannot be read: Permission denied",
        shut / "c.toml": f"config file {shut / 'c.toml'} cannot be read: Permission denied",
        fifo: f"config file {fifo} is not a regular file: give a TOML file",
    }
    try:
        for config, message in expected.items():
            done = subprocess.run(
                [*without_capabilities, sys.executable, "-m", "app.cli", command, *extra, f"--config={config}"],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            assert (done.returncode, done.stderr) == (2, f"inferproxy {command}: {message}\n")
    finally:
        shut.chmod(0o755)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.toml", "fifo.toml", "shut"]  # nothing made


def test_credentials_in_a_refused_setting_are_never_shown(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from app.cli import main

    assert main(["serve", "--upstream=ftp://admin:hunter2@gpu:8000"]) == 2
    assert capsys.readouterr().err == (
        "inferproxy serve: invalid settings:\n  --upstream: an upstream is an http(s) URL such as "
        "http://127.0.0.1:8000, got 'ftp://***:***@gpu:8000'\n"
    )
    monkeypatch.setenv("INFERPROXY_UPSTREAM", "http://admin:hunter2@gpu:8000,http://admin:hunter2@gpu:8000/v1")
    assert main(["serve"]) == 2
    err = capsys.readouterr().err
    assert "given twice" in err
    assert "hunter2" not in err
    assert "admin" not in err
    monkeypatch.delenv("INFERPROXY_UPSTREAM")
    assert main(["serve", "--upstream=http://127.0.0.1:9", "--upstream-api-key=hunter2\nsecond-line"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("inferproxy serve: invalid settings:\n  --upstream-api-key: a key is a line of text")
    assert "hunter2" not in err
    assert Settings.load(api_key="", upstream_api_key="").api_key is None  # INFERPROXY_API_KEY=: no key


def test_a_refused_value_the_message_already_shows_is_not_repeated(capsys: pytest.CaptureFixture[str]) -> None:
    from app.cli import main

    assert main(["serve", "--upstream=notaurl"]) == 2
    err = capsys.readouterr().err
    assert err.count("notaurl") == 1, err


def test_an_output_filename_without_chunk_index_says_why_both_are_needed(capsys: pytest.CaptureFixture[str]) -> None:
    from app.cli import main

    assert main(["serve", "--output-filename=${rank}.jsonl.gz"]) == 2
    err = capsys.readouterr().err
    assert "must use ${rank} and ${chunk_index}" in err
    assert "each chunk a file of its own" in err
