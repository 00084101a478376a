from __future__ import annotations

import argparse

import pytest

from app.cli import build_parser, flag_name, main
from app.settings import Settings


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("command", ["serve", "fake-upstream", "demo", "demo-job"])
def test_every_option_of_every_subcommand_has_a_help_text_and_no_none_default(command: str) -> None:
    parser = subcommands()[command]
    for action in parser._actions:
        assert action.help, f"{command} {action.option_strings} has no help text"
    assert "None" not in parser.format_help()


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
