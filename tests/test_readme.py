"""The README is part of the product: its quickstart, its tables and its code blocks must stay true.

Its `sh` and `python` blocks are run in order, as a reader runs them, in a fresh folder that holds
the clone (each of its files linked) and the `.venv` (its contents linked): `sh` blocks command by
command in bash, from a PATH where `inferproxy` is not found until a block activates the `.venv`;
`inferproxy serve` and `inferproxy fake-upstream` in the background, each waited for until it
answers, and stopped when a later block starts servers of its own (a reader stops the ones above
first: they hold the ports) or at the end; `python` blocks twice with the `.venv`'s python, as
written, the second time as the rerun the README promises is safe. The ports 8000 and 8080 the
README uses are moved to free ones, so that the walk-through runs beside anything else.
A block that cannot run says why just before it: `<!-- not run: REASON -->`, or
``<!-- not run: `COMMAND`: REASON -->`` for one command of it.
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from app.cli import build_parser
from tests.servers import free_port

ROOT = Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()


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


#: Blocks that are shown, never run: output, layouts, configuration files.
SHOWN = ("text", "toml", "yaml", "json")


@dataclass(frozen=True)
class Block:
    language: str
    code: str
    line: int  # of its opening fence in README.md
    not_run: str | None  # the reason given just before it, if any

    def commands(self) -> list[str]:
        """Its shell commands: continued lines joined, comments and blank lines left out."""
        lines = (re.sub(r"(^|\s+)#(\s.*)?$", "", line).strip() for line in self.code.replace("\\\n", " ").splitlines())
        return [line for line in lines if line]

    def runs(self) -> bool:
        """Code, and not left out whole (one command of an sh block may be)."""
        return self.language in ("sh", "python") and (self.not_run is None or self.skipped_command() is not None)

    def skipped_command(self) -> str | None:
        """The one command a `<!-- not run: `COMMAND`: REASON -->` leaves out."""
        found = re.match(r"`([^`]+)`: ", self.not_run or "")
        return found.group(1) if found else None


def readme_blocks() -> Iterator[Block]:
    for fence in re.finditer(r"^```(\S*)\n(.*?)^```$", README, re.MULTILINE | re.DOTALL):
        before = README[: fence.start()]
        marker = re.search(r"<!-- not run: (.*?) -->\n\Z", before)
        yield Block(fence.group(1), fence.group(2), before.count("\n") + 1, marker.group(1) if marker else None)


def test_every_import_of_the_readmes_python_is_covered_by_the_install_line_it_gives() -> None:
    # `pip install -e '.[s3,datatrove]'`, then the client example: "No module named 'openai'" (a dev extra).
    [line] = re.findall(r"in another\s+environment, .*?`(pip install -e '\.\[[^`]*)`", README, re.DOTALL)
    parsed = re.fullmatch(r"pip install -e '\.\[([\w,]+)\]'((?: [\w-]+)*)", line)
    assert parsed is not None, line
    extras, packages = parsed.groups()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] + [r for e in extras.split(",") for r in project["optional-dependencies"][e]]
    installed = {canonical(re.split(r"[\[<>=!~;\s]", requirement, maxsplit=1)[0]) for requirement in wanted}
    installed |= {canonical(package) for package in packages.split()}
    by_module = importlib.metadata.packages_distributions()
    missing = []
    for fence in re.finditer(r"^ *```python\n(.*?)^ *```$", README, re.MULTILINE | re.DOTALL):
        for node in ast.walk(ast.parse(textwrap.dedent(fence.group(1)))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
            for top in {name.split(".")[0] for name in names} - set(sys.stdlib_module_names) - {"app"}:
                if not {canonical(d) for d in by_module.get(top, [top])} & installed:
                    missing.append(top)
    assert missing == [], f"the README's python imports {missing}, which `{line}` does not install"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_code_block_says_its_language_and_every_block_not_run_says_why() -> None:
    for block in readme_blocks():
        where = f"README.md:{block.line}"
        assert block.language in ("sh", "python", *SHOWN), f"{where}: a block is sh, python, or one of {SHOWN}"
        if block.not_run is None:
            continue
        assert block.language not in SHOWN, f"{where}: a {block.language} block is never run: it needs no marker"
        command = block.skipped_command()
        assert command is None or block.language == "sh", f"{where}: only an sh block has commands to leave out"
        assert command is None or command in block.commands(), f"{where}: {command!r} is not one of its commands"
        reason = block.not_run.removeprefix(f"`{command}`: " if command else "")
        assert len(reason.split()) >= 4, f"{where}: say why the block is not run, got {reason!r}"
    markers = len(re.findall(r"^<!-- not run:", README, re.MULTILINE))
    assert markers == sum(1 for b in readme_blocks() if b.not_run), "a not-run marker stands just before its block"


def test_every_code_block_in_a_list_item_says_its_language_too() -> None:
    # `readme_blocks` sees the blocks at the margin only; one indented into a list item is shown, never run
    fences = list(re.finditer(r"^ *```(\S*)$", README, re.MULTILINE))
    for opening in fences[::2]:  # each block's opening fence, its closing one next
        where = f"README.md:{README[: opening.start()].count(chr(10)) + 1}"
        assert opening.group(1) in ("sh", "python", *SHOWN), f"{where}: a block is sh, python, or one of {SHOWN}"


class Reader:
    """A reader of the README at a shell, in a fresh folder: runs its blocks, keeps its servers."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir()
        for entry in ROOT.iterdir():
            if entry.name not in (".venv", ".git", "inferproxy-data"):
                (folder / entry.name).symlink_to(entry)
        # The running venv, its files linked: `make` finds it installed (its own stamp, newer than
        # pyproject.toml) and runs the commands instead of installing into the real one.
        venv = folder / ".venv"
        venv.mkdir()
        for entry in Path(sys.prefix).iterdir():
            if entry.name != ".installed":
                (venv / entry.name).symlink_to(entry)
        (venv / ".installed").touch()
        self.ports = {"8000": str(free_port()), "8080": str(free_port())}
        # The shell before activation: no inferproxy (nor the venv's python) on its PATH.
        path = [d for d in os.environ["PATH"].split(os.pathsep) if d and not (Path(d) / "inferproxy").exists()]
        self.env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
        self.env["PATH"] = os.pathsep.join(path)
        assert shutil.which("inferproxy", path=self.env["PATH"]) is None
        self.servers: list[tuple[str, subprocess.Popen[bytes], Path]] = []

    def localize(self, text: str) -> str:
        return re.sub(r"\b(8000|8080)\b", lambda port: self.ports[port.group(1)], text)

    def shell(self, block: Block) -> None:
        commands = [self.localize(c) for c in block.commands() if c != block.skipped_command()]
        if any(_is_server(c) for c in commands):
            self.stop_servers()
        setup: list[str] = []  # what the shell keeps for the next commands: activation, exports, cd
        for command in commands:
            script = "\n".join([*setup, command])
            if _is_server(command):
                self.serve(block, setup, command)
                continue
            done = subprocess.run(
                ["bash", "-e", "-c", script], cwd=self.folder, env=self.env, capture_output=True, text=True, timeout=600
            )
            assert done.returncode == 0, f"README.md:{block.line}: `{command}` failed:\n{done.stdout}{done.stderr}"
            if re.match(r"(\.|source|export|cd) ", command):
                setup.append(command)

    def serve(self, block: Block, setup: list[str], command: str) -> None:
        command = command.removesuffix("&").strip()
        log = self.folder / f"server-{len(self.servers)}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                ["bash", "-e", "-c", "\n".join([*setup, "exec " + command])],
                cwd=self.folder,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.servers.append((command, proc, log))
        port = re.search(r"--port[ =](\d+)", command)
        assert port, f"README.md:{block.line}: `{command}` names no --port"
        url = f"http://127.0.0.1:{port.group(1)}" + ("/healthz" if " serve " in command else "/v1/models")
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"README.md:{block.line}: `{command}` exited:\n{log.read_text()}"
            try:
                httpx.get(url, timeout=1.0)
                return
            except httpx.HTTPError:
                assert time.monotonic() < deadline, f"README.md:{block.line}: `{command}` never answered {url}"
                time.sleep(0.05)

    def python(self, block: Block) -> tuple[subprocess.CompletedProcess[str], subprocess.CompletedProcess[str]]:
        """Runs the block twice; what it printed each time, on stdout and stderr."""
        script = self.folder / f"readme_line_{block.line}.py"
        script.write_text(self.localize(block.code))
        printed = []
        for run in ("first", "second"):
            done = subprocess.run(
                [sys.executable, script.name],
                cwd=self.folder,
                env=self.env,
                capture_output=True,
                text=True,
                timeout=600,
            )
            assert done.returncode == 0, f"README.md:{block.line}, {run} run:\n{done.stdout}{done.stderr}"
            printed.append(done)
        return printed[0], printed[1]

    def stop_servers(self) -> None:
        """SIGTERM to each, the proxies first; each must stop on it (and all are stopped either way)."""
        unclean = []
        for command, proc, log in reversed(self.servers):
            proc.terminate()
            try:
                code = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
            # uvicorn (fake-upstream) ends by raising the signal it stopped on again, once it has stopped
            if code not in (0, -signal.SIGTERM):
                unclean.append(f"`{command}` did not stop cleanly ({code}):\n{log.read_text()}")
        self.servers = []
        assert not unclean, "\n".join(unclean)


def _is_server(command: str) -> bool:
    return re.match(r"inferproxy (serve|fake-upstream)\b", command) is not None


@pytest.mark.e2e
def test_the_readme_runs_as_written(tmp_path: Path) -> None:
    reader = Reader(tmp_path / "clone")
    try:
        for block in readme_blocks():
            if block.runs() and block.language == "sh":
                reader.shell(block)
            elif block.runs():
                first, second = reader.python(block)
                if 'raw.headers["X-Cache"]' in block.code:  # as its comment says: MISS, then HIT on a rerun
                    assert (first.stdout.split()[0], second.stdout.split()[0]) == ("MISS", "HIT")
                if "client.batches.create(" in block.code:  # every line answered, the rerun from the cache
                    for run in (first, second):
                        assert run.stdout.startswith("completed BatchRequestCounts(completed=100, failed=0, total=100)")
                        assert run.stdout.splitlines()[1].startswith("q-")
                if "run_job(" in block.code:  # run again once finished, it does nothing, and says so
                    assert "written=0," in second.stdout
                    assert "already done" in second.stderr
                    # its log is run_job's own lines, not one per request from the OpenAI client's HTTP library
                    assert len(first.stderr.splitlines()) < 10, first.stderr
    finally:
        reader.stop_servers()
