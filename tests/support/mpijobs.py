"""Jobs started from a test with their own ``mpirun``.

* ``mpirun(n, code, timeout=120, env=None)`` runs Python code, or ``python`` with
  arguments, as a whole ``mpirun -n N`` job with the settings of
  ``scripts/mpienv.sh`` and the interpreter running the tests (also a fixture of
  the same name, from ``tests/conftest.py``).
* ``mpi_env()`` and ``mpirun_command()`` are its parts, for tests that need the
  ``Popen`` themselves (a signal sent to a running job).
* ``REPO``: the repository root; ``SUPPORT``: this folder (for job scripts).
"""

from __future__ import annotations

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
from typing import NamedTuple

import pytest

__all__ = ["REPO", "SUPPORT", "Job", "mpi_env", "mpirun", "mpirun_command"]

SUPPORT = Path(__file__).resolve().parent
REPO = SUPPORT.parents[1]
MPIENV = REPO / "scripts" / "mpienv.sh"

# Variables through which a process started by mpirun knows its job. A test run under
# ``mpirun ... pytest --with-mpi`` has them: a job it starts must not inherit them.
_WORLD_PREFIXES = ("OMPI_COMM_WORLD", "PMIX_", "OMPI_MCA_ess", "OMPI_MCA_orte")
# Set by the elastic agent for its workers: a job started by a test is a first launch.
_AGENT_VARIABLES = ("MPISHARD_ELASTIC_RESTARTS",)


@functools.cache
def _mpienv_settings() -> dict[str, str]:
    """The ``OMPI_*``, ``PMIX_*`` and ``MPISHARD_*`` variables that ``scripts/mpienv.sh`` sets.

    Read by sourcing the script, so it stays the one place that says which flags and
    variables this machine's Open MPI needs.
    """
    base = _without_world(os.environ)
    proc = subprocess.run(["bash", "-c", 'source "$1" && env -0', "bash", str(MPIENV)],
                          env=base, capture_output=True, timeout=30, check=True)
    after = dict(item.split("=", 1) for item in proc.stdout.decode().split("\0") if "=" in item)
    return {key: value for key, value in after.items()
            if key.startswith(("OMPI_", "PMIX_", "MPISHARD_")) and base.get(key) != value}


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


@functools.cache
def _mpirun_takes_quiet() -> bool:
    """Whether ``mpirun`` takes ``-q``: Open MPI 4's does; Open MPI 5's (PRRTE)
    refuses it as an unrecognized option (exit 213, seen on the GPU machine)."""
    try:
        version = subprocess.run(["mpirun", "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "Open MPI" in version and " 4." in version.splitlines()[0]


def mpirun_command(n: int, *args: str, quiet: bool = False) -> list[str]:
    """``mpirun <MPISHARD_MPIRUN_FLAGS> -n N <this python> *args``.

    ``quiet`` adds ``-q`` where ``mpirun`` takes it (Open MPI 4): no banner about
    ranks that exit non-zero (for tests of bad input, whose exit code is the point).
    """
    if n < 1:
        raise ValueError(f"expecting at least 1 rank, got {n}")
    flags = shlex.split(_mpienv_settings().get("MPISHARD_MPIRUN_FLAGS", "--oversubscribe"))
    quiet_flag = ["-q"] if quiet and _mpirun_takes_quiet() else []
    return ["mpirun", *flags, *quiet_flag, "-n", str(n), sys.executable, *args]


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
