"""A single-node Slurm cluster for the tests: munged, slurmctld and slurmd started here, as real
daemons, on free loopback ports, with everything (config, state, logs, munge's key and socket) in one
folder; Debian's `slurm-wlm` and `munge`, installed with apt-get where missing."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.apt import CannotInstall, installed
from tests.servers import free_port

#: the daemons' commands and the Debian packages that have them
COMMANDS = {"munged": "munge", "slurmctld": "slurmctld", "slurmd": "slurmd", "sbatch": "slurm-client"}


@dataclass
class Slurm:
    """A running cluster: `env` is what its commands (sbatch, squeue, scancel) need."""

    root: Path
    env: dict[str, str]

    def run(self, *command: str) -> str:
        done = subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=60, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}): {done.stderr.strip()}")
        return done.stdout

    def jobs(self) -> list[tuple[str, str, str]]:
        """Every job in the queue: (id, state, name); an array's elements one by one ("12_3")."""
        out = self.run("squeue", "--noheader", "--array", "--format=%i|%T|%j")
        return [(i, state, name) for i, state, name in (line.split("|") for line in out.splitlines() if line)]

    def wait_until_no_job(self, name: str, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while any(job_name == name for _, _, job_name in self.jobs()):
            if time.monotonic() > deadline:
                raise AssertionError(f"Slurm jobs still queued after {timeout:g} s: {self.jobs()}\n{self.logs()}")
            time.sleep(0.2)

    def logs(self) -> str:
        return daemon_logs(self.root)


def daemon_logs(root: Path) -> str:
    """The end of each daemon's log, for a failure's message."""
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(root.glob("*.log")))


def slurm_commands() -> None:
    """Slurm's and munge's commands, installed with apt-get if missing; `CannotInstall` says why not."""
    if os.geteuid() != 0:
        raise CannotInstall("slurmd runs jobs as their users and needs root: run the tests as root")
    for command in COMMANDS:
        installed(command, ["slurm-wlm", "munge"])


def config(root: Path, host: str, ctld_port: int, slurmd_port: int) -> str:
    cpus = os.cpu_count() or 1
    return "\n".join(
        [
            "ClusterName=inferproxy-tests",
            f"SlurmctldHost={host}",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}",
            "AuthType=auth/munge",
            f"AuthInfo=socket={root}/munge.socket",
            f"StateSaveLocation={root}/state",
            f"SlurmdSpoolDir={root}/spool",
            f"SlurmctldPidFile={root}/slurmctld.pid",
            f"SlurmdPidFile={root}/slurmd.pid",
            f"SlurmctldLogFile={root}/slurmctld.log",
            f"SlurmdLogFile={root}/slurmd.log",
            # no cgroups in a container: processes tracked by their parents, no task binding
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "MpiDefault=none",
            "ReturnToService=2",
            "SchedulerType=sched/backfill",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "KillWait=10",
            f"NodeName={host} CPUs={cpus} RealMemory=4096 State=UNKNOWN",
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
            "",
        ]
    )


@contextlib.contextmanager
def slurm_cluster(root: Path) -> Iterator[Slurm]:
    slurm_commands()
    host = socket.gethostname().split(".")[0]
    for folder in ("state", "spool"):
        (root / folder).mkdir(parents=True)
    conf = root / "slurm.conf"
    conf.write_text(config(root, host, free_port(), free_port()))
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    env = {**os.environ, "SLURM_CONF": str(conf)}
    daemons: list[subprocess.Popen[bytes]] = []

    def start(*command: str) -> None:
        log = (root / f"{Path(command[0]).name}.out.log").open("wb")
        daemons.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT))
        log.close()

    try:
        munge = [f"--socket={root}/munge.socket", f"--key-file={key}", f"--pid-file={root}/munged.pid"]
        munge += [f"--seed-file={root}/munged.seed", f"--log-file={root}/munged.log"]
        start(shutil.which("munged") or "munged", "--foreground", "--force", *munge)
        _wait_for(lambda: (root / "munge.socket").exists(), "munged's socket", root)
        start(shutil.which("slurmctld") or "slurmctld", "-D", "-i")
        start(shutil.which("slurmd") or "slurmd", "-D")
        cluster = Slurm(root, env)
        _wait_for(lambda: _node_idle(cluster), "the node to be idle", root)
        yield cluster
    finally:
        with contextlib.suppress(Exception):
            subprocess.run(["scancel", "--full", "--user=root"], env=env, capture_output=True, timeout=30, check=False)
        for daemon in reversed(daemons):
            daemon.terminate()
        for daemon in reversed(daemons):
            try:
                daemon.wait(timeout=20)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()


def _node_idle(cluster: Slurm) -> bool:
    try:
        return cluster.run("sinfo", "--noheader", "--format=%T").strip() == "idle"
    except RuntimeError:
        return False


def _wait_for(ready: Callable[[], bool], what: str, root: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout:g} s for {what}\n{daemon_logs(root)}")
        time.sleep(0.1)
