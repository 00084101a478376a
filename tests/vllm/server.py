"""A real vLLM (the CPU build) serving the tiny model, as a process group of its own.

vLLM runs three processes: the API server, its engine core and the engine's worker. Killing the
API server leaves the other two running, so the server is started in a new session (its own process
group) and stopped by killing the group. `engine_args`, `ENVIRONMENT`, `spawn` and `kill_group` are the
same for vLLM's other entry points (bench/bench_batch_vllm.py's `run_batch`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

#: What the model is served as: the `model` of every request.
MODEL = "tiny"
#: On 2 busy cores a start takes 30-100 s (imports, then the engine's warm-up); a margin over that.
START_TIMEOUT_S = 600.0

#: The engine's niceness (`VLLM.yield_to_the_api_server`): the API server, the proxy and the tests come first.
ENGINE_NICE = 19

ENVIRONMENT = {
    "VLLM_HOST_IP": "127.0.0.1",  # else vLLM looks for the host's outward address
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the default takes a share of the machine's memory
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}


def engine_args(model_dir: Path) -> list[str]:
    """The flags every start of vLLM here takes: the tiny model as `MODEL`, float32 (the CPU build's), and
    `--enforce-eager`: no torch.compile, which halves the start on CPU."""
    return [f"--model={model_dir}", f"--served-model-name={MODEL}", "--dtype=float32", "--enforce-eager"]


def spawn(module: str, args: list[str], log: Path) -> subprocess.Popen[bytes]:
    """`python -m module args...` in a session of its own (so that `kill_group` reaches its engine), with
    `ENVIRONMENT`, its output appended to `log`. The `vllm` console script fails in the `vllm-cpu`
    distribution (it looks up the package `vllm`), hence the modules."""
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", module, *args],
            env={**os.environ, **ENVIRONMENT},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL `proc`'s whole process group (vLLM's front end, its engine core and the engine's worker)."""
    with contextlib.suppress(ProcessLookupError, FileNotFoundError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def metric(url: str, name: str) -> float:
    """One of vLLM's own Prometheus series (`vllm:...`) at `url`/metrics, summed over its labels."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


class VLLM:
    """`python -m vllm.entrypoints.openai.api_server` on one loopback port, started and killed at will.

    `nice_engine=False` leaves the engine at the API server's niceness, as `vllm serve` runs it: for a
    benchmark that sets it against a vLLM that is not reniced.
    """

    def __init__(
        self, model_dir: Path, port: int, log: Path, extra_args: tuple[str, ...] = (), *, nice_engine: bool = True
    ) -> None:
        self.model_dir = model_dir
        self.extra_args = extra_args  # more of the API server's flags (bench_routing.py's context, prefix caching)
        self.nice_engine = nice_engine
        self.url = f"http://127.0.0.1:{port}"
        self.port = port
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        args = [*engine_args(self.model_dir), "--host=127.0.0.1", f"--port={self.port}", *self.extra_args]
        self.proc = spawn("vllm.entrypoints.openai.api_server", args, self.log)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode} while starting:\n{self.log_tail()}")
            if self.healthy():
                if self.nice_engine:
                    self.yield_to_the_api_server()
                self.warm_up()
                return
            time.sleep(0.5)
        self.kill()
        raise RuntimeError(f"vLLM did not answer /health within {START_TIMEOUT_S:g} s:\n{self.log_tail()}")

    def warm_up(self) -> None:
        """One streamed generation read to its end: vLLM's API server lags its engine on its first streams
        after a start (seconds with nothing sent), which the fault tests must not meet."""
        body = {"model": MODEL, "prompt": "the", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=120) as answer:
            answer.raise_for_status()
            answer.read()

    def healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ensure_running(self) -> None:
        """Start it again if a test killed it (or its engine)."""
        if not (self.running() and self.healthy()):
            self.kill()
            self.start()

    def kill(self) -> None:
        """SIGKILL the whole process group: the API server, the engine core and its worker."""
        if self.proc is None:
            return
        kill_group(self.proc)
        self.proc = None

    def titled(self, title: bytes) -> list[int]:
        """The pids of the processes in the server's group that vLLM titles `title...` (`VLLM::...`)."""
        assert self.proc is not None
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(ProcessLookupError, FileNotFoundError):
                in_group = os.getpgid(int(entry.name)) == self.proc.pid
                if in_group and (entry / "cmdline").read_bytes().startswith(title):
                    pids.append(int(entry.name))
        return pids

    def engine_pid(self) -> int:
        """The engine core's pid."""
        assert self.proc is not None
        engines = self.titled(b"VLLM::EngineCore")
        if not engines:
            raise LookupError(f"no VLLM::EngineCore process in vLLM's process group {self.proc.pid}")
        return engines[0]

    def yield_to_the_api_server(self) -> None:
        """Every thread of the engine core and its worker at nice `ENGINE_NICE`: on 2 shared cores their busy
        loops otherwise starve the API server, which then sends nothing of a stream for seconds (at times a
        whole generation), too late for a kill or a client leaving to stop it. A niced engine is only slower."""
        for pid in self.titled(b"VLLM::"):
            with contextlib.suppress(ProcessLookupError, FileNotFoundError):
                for thread in Path(f"/proc/{pid}/task").iterdir():
                    os.setpriority(os.PRIO_PROCESS, int(thread.name), ENGINE_NICE)

    def metric(self, name: str) -> float:
        return metric(self.url, name)

    def generations(self) -> float:
        """Requests the engine has finished (not counting those aborted when their client left)."""
        return self.metric("vllm:request_success_total")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
