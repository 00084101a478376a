"""Debian packages the tests need (chromium, slurm-wlm, ...), installed with apt-get where missing."""

from __future__ import annotations

import os
import shutil
import subprocess


class CannotInstall(RuntimeError):
    """Why a package the tests need cannot be installed here (the test is skipped, saying so)."""


def installed(command: str, packages: list[str]) -> str:
    """`command`'s path, installing `packages` with apt-get first if it is missing."""
    found = shutil.which(command)
    if found:
        return found
    names = " ".join(packages)
    if shutil.which("apt-get") is None:
        raise CannotInstall(f"{command} is not installed and there is no apt-get to install {names} with")
    if os.geteuid() != 0:
        raise CannotInstall(f"{command} is not installed and installing it needs root: apt-get install {names}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "-o", "DPkg::Lock::Timeout=300", "install", "-y", *packages]
    done = subprocess.run(install, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:  # a fresh machine has no package lists yet
        subprocess.run(["apt-get", "update"], env=env, capture_output=True, check=False)
        done = subprocess.run(install, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise CannotInstall(f"apt-get install {names} failed: {(done.stderr or done.stdout).strip()[-500:]}")
    path = shutil.which(command)
    if path is None:
        raise CannotInstall(f"apt-get installed {names}, but there is no `{command}` command on PATH")
    return path
