"""Whole jobs started with their own ``mpirun``: failures must end the job.

These run without ``--with-mpi``: plain pytest starts each job with the ``mpirun``
fixture of ``conftest.py``.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest

pytestmark = pytest.mark.launch


def test_uncaught_exception_on_one_rank_aborts_the_job(mpirun):
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
    # One report, from the rank that failed, naming it in the world and in its group.
    reports = re.findall(r"\[mpishard\] world rank (\d+) on \S+ \(rank (\d+) of the world "
                         r"group\): uncaught exception; aborting the job", out)
    assert reports == [("1", "1")], out
    assert "RuntimeError: boom on rank one" in out
    assert "unreachable" not in out
    assert seconds < 100


def test_collective_timeout_names_the_collective_and_group(mpirun):
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


def test_info_command(mpirun):
    code, out, _ = mpirun(2, """
        from mpishard.cli import main
        main(["info"])
    """)
    assert code == 0, out
    assert "Open MPI" in out and "world_size" in out and "h5py_mpi" in out
    assert "cuda_aware_mpi" in out
    assert out.count("world_size") == 1   # rank 0 prints
    assert re.search(r"^world_size\s+2$", out, re.MULTILINE), out
    # What MPI granted (mpi4py asks for "multiple"; Open MPI 4.1 grants it).
    assert re.search(r"^mpi_thread_level\s+(single|funneled|serialized|multiple)$", out,
                     re.MULTILINE), out


def test_mpirun_helper_sets_mpienv_and_kills_a_hung_job(mpirun, monkeypatch):
    # The job sees scripts/mpienv.sh's settings, the extra variables, and not the
    # variables of an enclosing job (as when pytest itself runs under mpirun).
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "7")
    monkeypatch.setenv("MPISHARD_TEST_GONE", "1")
    code, out, _ = mpirun(2, """
        import os
        from mpi4py import MPI
        seen = (MPI.COMM_WORLD.size, os.environ["OMPI_MCA_mpi_yield_when_idle"],
                os.environ["MPISHARD_TEST_EXTRA"], "MPISHARD_TEST_GONE" in os.environ)
        rows = MPI.COMM_WORLD.gather(seen, root=0)
        if MPI.COMM_WORLD.rank == 0:
            print("SEEN", rows)
    """, env={"MPISHARD_TEST_EXTRA": "x", "MPISHARD_TEST_GONE": None})
    assert code == 0, out
    yield_when_idle = os.environ.get("OMPI_MCA_mpi_yield_when_idle", "1")   # mpienv.sh's default
    assert f"SEEN {[(2, yield_when_idle, 'x', False)] * 2}" in out, out
    # A job that outlives its timeout is killed with its ranks, and the test fails.
    marker = f"mpishard-hung-{os.getpid()}"
    with pytest.raises(pytest.fail.Exception, match="did not finish within 3 s"):
        mpirun(2, ["-c", "import sys, time; time.sleep(120)", marker], timeout=3)
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True)
    assert left.stdout == "", f"ranks left running: {left.stdout}"
