from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest

from tests.browser import CannotInstall, chromium_path
from tests.factories import RecordingWriter
from tests.servers import HTTP_SERVER

#: tests/vllm/ runs against a real vLLM, from its own venv: `make test-vllm` runs it and sets this variable.
VLLM_SUITE = bool(os.environ.get("TEST_VLLM_SUITE"))
collect_ignore = [] if VLLM_SUITE else ["vllm"]


#: The modules that take longest (each module's time in a `make test` run, longest first): started first by
#: pytest-xdist (`--dist loadfile --no-loadscope-reorder`), so that none begins near the run's end, where it
#: alone would hold the run open. Order only: a module missing here runs after them, as collected.
SLOWEST_MODULES = [
    "tests/tools/test_run_batch.py",
    "tests/chaos/test_injected_faults.py",
    "tests/service/test_page.py",
    "tests/e2e/test_slurm.py",
    "tests/e2e/test_s3_output.py",
    "tests/test_readme.py",
    "tests/e2e/test_batch_kill.py",
    "tests/e2e/test_routing.py",
    "tests/chaos/test_handovers.py",
    "tests/e2e/test_proxy_e2e.py",
    "tests/e2e/test_datatrove_pipeline.py",
    "tests/service/test_checkpoint_routes.py",
    "tests/service/test_proxy.py",
    "tests/e2e/test_demo.py",
    "tests/ops/test_metrics.py",
    "tests/service/test_batches.py",
    "tests/e2e/test_handover.py",
    "tests/chaos/test_proxy_kills.py",
    "tests/chaos/test_batch_kills.py",
    "tests/chaos/test_s3_output_faults.py",
    "tests/http/test_fuzz.py",
    "tests/e2e/test_shared_checkpoints.py",
    "tests/e2e/test_inspect.py",
    "tests/store/test_ownership.py",
    "tests/service/test_files.py",
    "tests/tools/test_status.py",
    "tests/e2e/test_docker.py",
]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {module: place for place, module in enumerate(SLOWEST_MODULES)}
    root = config.rootpath
    items.sort(key=lambda item: rank.get(item.path.relative_to(root).as_posix(), len(rank)))  # a stable sort


def pytest_report_header() -> str | None:
    return None if VLLM_SUITE else "tests/vllm/: left out (it needs a real vLLM: make test-vllm)"


@pytest.fixture(params=["builtin", "uvicorn"])
def http_server(request: pytest.FixtureRequest) -> Iterator[str]:
    """The server `tests.servers.serve_proxy` runs: each test that uses this runs under both, so that the app
    behaves the same under either (a module opts in with `pytestmark = pytest.mark.usefixtures("http_server")`;
    a test about the built-in server alone parametrizes it with `["builtin"]`, indirect)."""
    HTTP_SERVER["name"] = request.param
    try:
        yield request.param
    finally:
        HTTP_SERVER["name"] = "builtin"


@pytest.fixture(autouse=True)
def default_output(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test that does not name `output` publishes into a folder of its own, not into
    `inferproxy-data/output` of the working directory, where a README example (or another test) may have
    left chunks that the proxy would take for this rank's published ones."""
    if "INFERPROXY_OUTPUT" not in os.environ:
        monkeypatch.setenv("INFERPROXY_OUTPUT", str(tmp_path_factory.mktemp("default-output")))


@pytest.fixture(autouse=True)
def root_logging() -> Iterator[None]:
    """The root logger as each test found it: a test that runs `inferproxy ...` in this process configures
    logging on the `sys.stderr` of its moment (a pipe or a terminal another test closes), and a later test's
    log lines would go there. Under pytest-xdist the tests a process runs before another are not always the
    same, so a handler left behind made tests fail in one order and pass in another."""
    handlers, level = logging.root.handlers[:], logging.root.level
    try:
        yield
    finally:
        logging.root.handlers[:] = handlers
        logging.root.setLevel(level)


@pytest.fixture(scope="session")
def chromium() -> str:
    """Headless Chromium's executable (installed with apt-get where missing), for the tests of the pages."""
    try:
        return chromium_path()
    except CannotInstall as exc:
        pytest.skip(str(exc))


@pytest.fixture
def writer() -> RecordingWriter:
    return RecordingWriter()


def pytest_addoption(parser: pytest.Parser) -> None:
    # Here, not in tests/chaos/conftest.py: pytest takes options only from the conftest files it loads first.
    group = parser.getgroup("chaos", "the chaos suite (tests/chaos)")
    group.addoption(
        "--chaos-long",
        action="store_true",
        help="run tests/chaos with the benchmark machine's counts (>= 20 kills, longer runs) instead of the short ones",
    )
    group.addoption(
        "--chaos-seed",
        type=int,
        default=None,
        help="the seed of tests/chaos's random moments (default: a fixed one; under --chaos-long a new one each run)",
    )
