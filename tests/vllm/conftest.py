"""One real vLLM for the whole suite (tests that kill it have it started again), and a fresh
`inferproxy serve` process in front of it for each test."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.servers import free_port, process, wait_for_http
from tests.vllm import tiny_model
from tests.vllm.helpers import Proxy, close_clients
from tests.vllm.server import VLLM


@pytest.fixture(scope="session")
def vllm_installed() -> None:
    if importlib.util.find_spec("vllm") is None:
        pytest.fail(f"vLLM is not installed in {sys.prefix}: `make test-vllm` runs this suite in its own venv")


@pytest.fixture(scope="session")
def model_dir(vllm_installed: None) -> Path:
    """The tiny model, built once per version of its builder and kept in the venv."""
    return tiny_model.model_dir()


@pytest.fixture(scope="session")
def vllm_server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLM]:
    server = VLLM(model_dir, free_port(), tmp_path_factory.mktemp("vllm") / "vllm.log")
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture(autouse=True)
def clients_closed() -> Iterator[None]:
    yield
    close_clients()


@pytest.fixture
def vllm(vllm_server: VLLM) -> VLLM:
    """The session's vLLM, up and healthy (started again if an earlier test killed it)."""
    vllm_server.ensure_running()
    return vllm_server


@pytest.fixture
def proxy(vllm: VLLM, tmp_path: Path) -> Iterator[Proxy]:
    """`inferproxy serve` in front of vLLM, with chunks of 10 documents."""
    port = free_port()
    checkpoints, output = tmp_path / "checkpoints", tmp_path / "output"
    args = [f"--port={port}", f"--upstream={vllm.url}", f"--checkpoints-dir={checkpoints}", f"--output={output}"]
    with process("serve", *args, "--records-per-chunk=10", "--log-level=warning") as proc:
        url = f"http://127.0.0.1:{port}"
        wait_for_http(url + "/healthz")
        yield Proxy(url, checkpoints, output)
        assert proc.poll() is None, "the proxy died during the test"
