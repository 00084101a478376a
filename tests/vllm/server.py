"""A real vLLM (the CPU build) serving the tiny model, as a process group of its own.

vLLM runs three processes: the API server, its engine core and the engine's worker. Killing the
API server leaves the other two running, so the server is started in a new session (its own process
group) and stopped by killing the group.
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


class VLLM:
    """`python -m vllm.entrypoints.openai.api_server` on one loopback port, started and killed at will.

    The `vllm` console script fails in the `vllm-cpu` distribution (it looks up the package `vllm`),
    hence the module. `--enforce-eager`: no torch.compile, which halves the start on CPU.
    """

    def __init__(self, model_dir: Path, port: int, log: Path, extra_args: tuple[str, ...] = ()) -> None:
        self.model_dir = model_dir
        self.extra_args = extra_args  # more of the API server's flags (bench_routing.py's context, prefix caching)
        self.url = f"http://127.0.0.1:{port}"
        self.port = port
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", f"--model={self.model_dir}"]
        args += [f"--served-model-name={MODEL}", "--host=127.0.0.1", f"--port={self.port}", "--dtype=float32"]
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [*args, "--enforce-eager", *self.extra_args],
                env={**os.environ, **ENVIRONMENT},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode} while starting:\n{self.log_tail()}")
            if self.healthy():
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
        with contextlib.suppress(ProcessLookupError, FileNotFoundError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
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
        """One of vLLM's own Prometheus series (`vllm:...`), summed over its labels."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))

    def generations(self) -> float:
        """Requests the engine has finished (not counting those aborted when their client left)."""
        return self.metric("vllm:request_success_total")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
