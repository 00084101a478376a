"""The README is part of the product: its quickstart and its tables must stay true."""

from __future__ import annotations

import re
import textwrap
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


def test_the_datatrove_snippet_is_the_example_that_the_e2e_tests_run() -> None:
    section = README.split("## From a datatrove pipeline", 1)[1].split("\n## ", 1)[0]
    snippet = re.search(
        r"```python\n(from app\.integrations\.datatrove .*?)\n\n(LocalPipelineExecutor.*?)```", section, re.DOTALL
    )
    assert snippet, "the README's datatrove section lacks the pipeline snippet"
    example = (Path(__file__).parent.parent / "examples" / "datatrove_pipeline.py").read_text()
    body = example.split("    LocalPipelineExecutor(", 1)[1].split("\n\n", 1)[0]
    assert textwrap.dedent("    LocalPipelineExecutor(" + body).replace("  # fmt: skip", "") + "\n" == snippet.group(2)
    assert snippet.group(1) + "\n" in example
    for flag in re.findall(r"--[a-z-]+", section.split("```sh", 1)[1].split("```", 1)[0]):
        assert flag in example or flag in ("--upstream", "--port", "--output-filename", "--checkpoints-dir"), flag
