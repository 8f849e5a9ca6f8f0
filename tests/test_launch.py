"""Whole jobs started with their own ``mpirun``: failures must end the job.

These run without ``--with-mpi`` (plain pytest starts mpirun itself).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.launch


def mpirun(n: int, code: str, timeout: float = 120) -> tuple[int, str, float]:
    env = dict(os.environ)
    for key in list(env):   # a pytest started by mpirun must not leak its world
        if key.startswith(("OMPI_COMM_WORLD", "PMIX_", "OMPI_MCA_ess", "OMPI_MCA_orte")):
            env.pop(key)
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    t0 = time.monotonic()
    proc = subprocess.run(
        ["mpirun", "--oversubscribe", "-n", str(n), sys.executable, "-c", textwrap.dedent(code)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout, env=env)
    return proc.returncode, proc.stdout, time.monotonic() - t0


def test_uncaught_exception_on_one_rank_aborts_the_job():
    code, out, seconds = mpirun(3, """
        from mpi4py import MPI
        import numpy as np
        from mpishard import ShardingConfiguration
        config = ShardingConfiguration(MPI.COMM_WORLD)
        if MPI.COMM_WORLD.rank == 1:
            raise RuntimeError("boom on rank one")
        MPI.COMM_WORLD.Barrier()   # the others would wait here forever
        print("unreachable")
    """)
    assert code != 0
    assert "rank 1: uncaught exception" in out
    assert "RuntimeError: boom on rank one" in out
    assert "unreachable" not in out
    assert seconds < 100


def test_collective_timeout_names_the_collective_and_group():
    code, out, _ = mpirun(2, """
        from mpi4py import MPI
        import numpy as np
        from mpishard import ShardingConfiguration
        from mpishard.comm import FlatComm
        config = ShardingConfiguration(MPI.COMM_WORLD, timeout=2.0)
        dp = config.groups.dp
        if MPI.COMM_WORLD.rank == 0:
            dp.Allreduce(np.ones(4))   # rank 1 never joins
        else:
            import time; time.sleep(60)
    """)
    assert code != 0
    assert "Iallreduce over the data-parallel group (size 2) did not finish within 2 s" in out


def test_info_command():
    code, out, _ = mpirun(2, """
        from mpishard.cli import main
        main(["info"])
    """)
    assert code == 0, out
    assert "Open MPI" in out and "world_size" in out and "h5py_mpi" in out
    assert "cuda_aware_mpi" in out
    assert out.count("world_size") == 1   # rank 0 prints
