"""Jobs submitted to a real Slurm (``tests/jobs/test_slurm.py``, and the Slurm of the
namespace cluster in ``tests/cluster/test_cluster.py``): submit a script of
``slurm/``, wait for its state, read its log and checkpoints.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from mpijobs import REPO

__all__ = ["FINAL", "checkpoint", "job_info", "log", "slurm_env", "slurm_run", "submit", "wait"]

#: The job states after which a job does not run again.
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
         "PREEMPTED", "BOOT_FAIL", "DEADLINE"}


def slurm_run(*cmd: str, timeout: float = 60,
              via: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``cmd``, prefixed by ``via`` (the Slurm of tests/cluster/test_cluster.py answers only
    inside its nodes: ``cluster-local.sh exec``)."""
    return subprocess.run([*via, *cmd], capture_output=True, text=True, timeout=timeout)


def slurm_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "SLURM_"))}
    env["MPISHARD_VENV"] = sys.prefix   # this interpreter's virtual environment
    env.update(extra)
    return env


def submit(script: str, tmp: Path, *args: str, sbatch: tuple[str, ...] = (),
           via: tuple[str, ...] = (), **env: str) -> str:
    """``sbatch SBATCH slurm/SCRIPT ARGS`` from the repository root (``via`` the
    command prefix that reaches Slurm, ``env`` added to the environment); the job id."""
    proc = subprocess.run(
        [*via, "sbatch", "--parsable", f"--output={tmp}/%x-%j.out", *sbatch,
         f"slurm/{script}", *args],
        cwd=REPO, capture_output=True, text=True, timeout=60, env=slurm_env(**env))
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def job_info(job: str, via: tuple[str, ...] = ()) -> dict[str, str]:
    proc = slurm_run("scontrol", "show", "job", "-o", job, via=via)
    return dict(re.findall(r"(\w+)=(\S*)", proc.stdout)) if proc.returncode == 0 else {}


def wait(job: str, timeout: float = 300, until: set[str] = FINAL,
         via: tuple[str, ...] = ()) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = job_info(job, via)
        if info.get("JobState") in until:
            return info
        time.sleep(0.5)
    slurm_run("scancel", job, via=via)
    pytest.fail(f"job {job} did not reach {sorted(until)} in {timeout} s: {job_info(job, via)}")


def log(tmp: Path, name: str, job: str) -> str:
    return (tmp / f"{name}-{job}.out").read_text()


def checkpoint(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    with h5py.File(path, "r") as f:
        return {k: f["params"][k][()] for k in f["params"]}, dict(f.attrs)
