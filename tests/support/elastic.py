"""The elastic worker (``elastic_worker.py``, beside this module) and its reference runs.

The elastic tests run the worker under ``mpishard run`` with real failures, then a
reference that makes the same size changes at the same steps on purpose (plain
``mpirun`` jobs that stop there and resume from the checkpoint), and compare the
final parameters bit for bit.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
from mpijobs import SUPPORT, mpi_env, mpirun_command

from mpishard.exitcodes import EXIT_STOPPED

__all__ = ["WORKER", "run_reference"]

#: ``python tests/support/elastic_worker.py`` (add its arguments).
WORKER = [sys.executable, str(SUPPORT / "elastic_worker.py")]


def run_reference(tmp: Path, phases: list[tuple[int, int | None]], worker_args: list[str]):
    """Plain mpirun runs at the given sizes, each stopping on purpose after its step;
    the final parameters (``tmp/reference.npy``)."""
    for workers, stop_at in phases:
        cmd = mpirun_command(workers, *WORKER[1:]) + [
            "--ckpt", str(tmp / "ref-ckpt"), "--events", str(tmp / "ref-events"),
            "--out", str(tmp / "reference.npy"), *worker_args]
        if stop_at is not None:
            cmd += ["--stop-at", str(stop_at)]
        # mpi_env(): also without MPISHARD_ELASTIC_RESTARTS, so each job is a first launch.
        proc = subprocess.run(cmd, env=mpi_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=120)
        assert proc.returncode == (EXIT_STOPPED if stop_at is not None else 0), proc.stdout
        assert "never read opt.exit_code" not in proc.stdout   # the worker reads it
    return np.load(tmp / "reference.npy")
