"""The README is part of the product: its quickstart and its tables must stay true."""

from __future__ import annotations

import re
from pathlib import Path

from app.cli import build_parser

README = (Path(__file__).parent.parent / "README.md").read_text()


def test_every_demo_flag_is_in_the_readme_table_with_its_default() -> None:
    demo = build_parser()._subparsers._group_actions[0].choices["demo"]  # type: ignore[union-attr]
    for action in demo._actions:
        flag = next((o for o in action.option_strings if o.startswith("--")), None)
        if flag in (None, "--help"):
            continue
        row = re.search(rf"^\| `{flag}` \| `?([^|`]+)`? \|", README, re.MULTILINE)
        assert row, f"README's demo table lacks {flag}"
        defaults = {"--seed": "random", "--upstream": "the fake upstream"}
        default = defaults.get(flag) or str(action.default).removesuffix(".0")
        assert row.group(1).strip() == default, flag


def test_quickstart_is_two_make_commands_that_exist() -> None:
    makefile = (Path(__file__).parent.parent / "Makefile").read_text()
    for target in ("demo", "test"):
        assert f"make {target}" in README
        assert re.search(rf"^{target}:", makefile, re.MULTILINE)
    assert "$(BIN)/inferproxy demo" in makefile
