"""Shared test helpers: jobs started with their own ``mpirun``, and the array backends.

* ``mpirun(n, code, timeout=120, env=None)`` (a function, and a fixture of the same
  name) runs Python code, or ``python`` with arguments, as a whole ``mpirun -n N`` job
  with the settings of ``scripts/mpienv.sh`` and the interpreter running the tests.
  ``mpi_env()`` and ``mpirun_command()`` are its parts, for tests that need the
  ``Popen`` themselves (a signal sent to a running job). Import them with
  ``from conftest import mpirun``.
* ``xp``: NumPy, and CuPy where it imports and sees a CUDA device (those cases are
  marked ``gpu`` and skipped, with the reason, elsewhere).
* World sizes: ``@pytest.mark.mpi(min_size=N)`` (pytest-mpi) skips a test, on every
  rank, when the world has fewer than ``N`` ranks.
"""

from __future__ import annotations

import mpishard  # noqa: F401  (first: each rank limits its BLAS threads before NumPy loads)

# isort: split
import functools
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

import numpy as np
import pytest

from mpishard.strategies import DDPOptimizer, ZeRO2Optimizer

__all__ = ["STRATEGIES", "Job", "mpi_env", "mpirun", "mpirun_command"]

#: The data-parallel strategies with each of ZeRO-2's reduce methods pinned, by
#: test id: ``STRATEGIES[name](optimizer, config, **options)``.
STRATEGIES = {
    "ddp": lambda opt, cfg, **kw: DDPOptimizer(opt, cfg, **kw),
    "zero2-reduce_scatter": lambda opt, cfg, **kw: ZeRO2Optimizer(
        opt, cfg, reduce_method="reduce_scatter", **kw),
    "zero2-allreduce": lambda opt, cfg, **kw: ZeRO2Optimizer(
        opt, cfg, reduce_method="allreduce", **kw),
}

REPO = Path(__file__).resolve().parents[1]
MPIENV = REPO / "scripts" / "mpienv.sh"

# Variables through which a process started by mpirun knows its job. A test run under
# ``mpirun ... pytest --with-mpi`` has them: a job it starts must not inherit them.
_WORLD_PREFIXES = ("OMPI_COMM_WORLD", "PMIX_", "OMPI_MCA_ess", "OMPI_MCA_orte")
# Set by the elastic agent for its workers: a job started by a test is a first launch.
_AGENT_VARIABLES = ("MPISHARD_ELASTIC_RESTARTS",)


@functools.cache
def _mpienv_settings() -> dict[str, str]:
    """The ``OMPI_*`` and ``MPISHARD_*`` variables that ``scripts/mpienv.sh`` sets.

    Read by sourcing the script, so it stays the one place that says which flags and
    variables this machine's Open MPI needs.
    """
    base = _without_world(os.environ)
    proc = subprocess.run(["bash", "-c", 'source "$1" && env -0', "bash", str(MPIENV)],
                          env=base, capture_output=True, timeout=30, check=True)
    after = dict(item.split("=", 1) for item in proc.stdout.decode().split("\0") if "=" in item)
    return {key: value for key, value in after.items()
            if key.startswith(("OMPI_", "MPISHARD_")) and base.get(key) != value}


def _without_world(env: Mapping[str, str]) -> dict[str, str]:
    return {key: value for key, value in env.items()
            if not key.startswith(_WORLD_PREFIXES) and key not in _AGENT_VARIABLES}


def mpi_env(extra: Mapping[str, str | None] | None = None) -> dict[str, str]:
    """The environment of a job started from a test.

    This process's environment without the variables of an enclosing MPI job, plus
    the settings of ``scripts/mpienv.sh``, plus ``extra`` (a value of ``None``
    removes that variable).
    """
    env = _without_world(os.environ)
    env.update(_mpienv_settings())
    for key, value in (extra or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def mpirun_command(n: int, *args: str, quiet: bool = False) -> list[str]:
    """``mpirun <MPISHARD_MPIRUN_FLAGS> -n N <this python> *args``.

    ``quiet`` adds ``-q``: no Open MPI banner about ranks that exit non-zero (for
    tests of bad input, whose exit code is the point).
    """
    if n < 1:
        raise ValueError(f"expecting at least 1 rank, got {n}")
    flags = shlex.split(_mpienv_settings().get("MPISHARD_MPIRUN_FLAGS", "--oversubscribe"))
    return ["mpirun", *flags, *(["-q"] if quiet else []), "-n", str(n), sys.executable, *args]


class Job(NamedTuple):
    """What a finished ``mpirun`` job left: unpacks as ``code, out, seconds``."""

    returncode: int
    output: str      # stdout and stderr of every rank, interleaved as they came
    seconds: float   # wall time from start to exit


def mpirun(n: int, code: str | Sequence[str], timeout: float = 120,
           env: Mapping[str, str | None] | None = None, *, quiet: bool = False) -> Job:
    """Run ``code`` as a job of ``n`` ranks and wait for it.

    ``code`` is Python source (dedented, run with ``python -c``) or the arguments
    after ``python`` (``["-m", "mpishard", "info"]``). ``env`` adds (or, with
    ``None``, removes) variables of :func:`mpi_env`. A job still running after
    ``timeout`` seconds is killed with its ranks, and the test fails with its output.
    """
    args = ["-c", textwrap.dedent(code)] if isinstance(code, str) else list(code)
    command = mpirun_command(n, *args, quiet=quiet)
    t0 = time.monotonic()
    # A session of its own: on a timeout the whole job (mpirun, its daemon, the
    # ranks) is killed, and no rank is left spinning on the cores of later tests.
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=mpi_env(env), start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out = _kill_job(proc)
        pytest.fail(f"mpirun -n {n} did not finish within {timeout:g} s; its output:\n{out}")
    return Job(proc.returncode, out, time.monotonic() - t0)


def _kill_job(proc: subprocess.Popen) -> str:
    """End a job started in its own session: mpirun first (it stops its ranks), then all."""
    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        out = ""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if proc.poll() is None:
        out, _ = proc.communicate()
    return out or ""


@pytest.fixture(name="mpirun")
def _mpirun_fixture():
    """:func:`mpirun`, for tests that take it as a fixture."""
    return mpirun


# --------------------------------------------------------------------------- backends

def _cupy_or_skip() -> ModuleType:
    """CuPy, or a skip that says why it cannot be used here."""
    try:
        import cupy
    except ImportError as exc:
        pytest.skip(f"CuPy is not installed ({exc})")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CUDARuntimeError: no driver, no device
        pytest.skip(f"CuPy sees no CUDA device ({type(exc).__name__}: {exc})")
    if count < 1:
        pytest.skip("CuPy sees no CUDA device (device count 0)")
    return cupy


@pytest.fixture(params=[pytest.param("numpy", id="numpy"),
                        pytest.param("cupy", id="cupy", marks=pytest.mark.gpu)])
def xp(request) -> ModuleType:
    """The array library of the test: ``numpy``, or ``cupy`` where a device exists."""
    return np if request.param == "numpy" else _cupy_or_skip()
