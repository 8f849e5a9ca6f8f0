"""Aborts and timeouts inside a larger MPI program: what is named, and what ends.

Each test starts its own ``mpirun`` (a rank that aborts ends its job), so these
run without ``--with-mpi``. The training ranks are a sub-communicator of a
world whose other ranks stand for a simulation, as in the README's example.
"""

from __future__ import annotations

import pytest
from mpijobs import mpirun

pytestmark = pytest.mark.launch


def test_constructor_names_what_it_waited_for():
    """Rank 1 never calls ShardingConfiguration(): rank 0's constructor ends the
    job after its timeout, saying what it waited for and to pass comm=."""
    code, out, seconds = mpirun(2, """
        import time
        from mpi4py import MPI
        if MPI.COMM_WORLD.rank == 0:
            from mpishard import ShardingConfiguration
            ShardingConfiguration(timeout=2)
            print("constructed", flush=True)
        time.sleep(60)                      # the simulation's work, never done
    """, timeout=120, quiet=True)
    assert code != 0 and seconds < 45, (code, seconds, out)
    assert "constructed" not in out
    line = next(x for x in out.splitlines() if x.startswith("[mpishard]"))
    assert line.startswith("[mpishard] world rank 0 on "), line
    assert "(rank 0 of the MPI.COMM_WORLD group): Iallreduce over the MPI.COMM_WORLD group " \
           "(size 2) in ShardingConfiguration() over MPI.COMM_WORLD (no comm= given), which " \
           "every one of its 2 ranks must call; where other ranks do other work (a " \
           "simulation), pass comm= the communicator of the ranks that train did not finish " \
           "within 2 s (timeout=2: a wait for the other ranks of the group)" in line, line


def test_uncaught_exception_names_world_rank_host_and_group_rank():
    """World rank 3 (rank 1 of the training sub-communicator) dies of an
    exception: the abort names it by all three and says the whole job ends."""
    code, out, seconds = mpirun(4, """
        import socket, time
        from mpi4py import MPI
        from mpishard import ShardingConfiguration
        world = MPI.COMM_WORLD
        trains = world.rank >= 2
        ml = world.Split(color=int(trains), key=world.rank)
        if trains:
            config = ShardingConfiguration(ml)
            if world.rank == 3:
                raise ValueError("bad surrogate input")
            config.world.barrier()          # rank 2 waits for rank 3
        time.sleep(60)                      # ranks 0 and 1 simulate: ended by the abort
    """, timeout=120, quiet=True)
    assert code != 0 and seconds < 45, (code, seconds, out)
    import socket

    host = socket.gethostname()
    assert (f"[mpishard] world rank 3 on {host} (rank 1 of the training group): uncaught "
            f"ValueError: bad surrogate input; MPI_Abort ends all 4 processes of "
            f"MPI.COMM_WORLD, not only the 2 that train") in out, out
    assert "abort_on_exception=False" in out
    assert "Traceback (most recent call last)" in out and "line 11, in <module>" in out


def test_the_abort_names_the_newest_configurations_ranks():
    """A 1-rank configuration first (a serial reference), then one over both ranks:
    an uncaught exception names the ranks of the newest one (before, the first
    configuration's: 'not only the 1 that train' where both trained)."""
    code, out, seconds = mpirun(2, """
        from mpi4py import MPI
        from mpishard import ShardingConfiguration
        ShardingConfiguration(MPI.COMM_SELF)
        config = ShardingConfiguration(MPI.COMM_WORLD)
        if MPI.COMM_WORLD.rank == 1:
            raise ValueError("bad input")
        config.world.barrier()
    """, timeout=120, quiet=True)
    assert code != 0 and seconds < 45, (code, seconds, out)
    assert ("(rank 1 of the training group): uncaught ValueError: bad input; MPI_Abort "
            "ends all 2 processes of MPI.COMM_WORLD (") in out, out
    assert "not only" not in out, out


@pytest.mark.timing      # ShardingConfiguration(timeout=2) over ranks that all arrive
def test_without_abort_the_waiting_rank_raises_and_the_simulation_goes_on():
    """abort_on_exception=False: the failing rank sees its own exception, the rank
    waiting for it a CommunicationError after the timeout, and the simulation
    (world rank 0) hears from both and ends normally: exit status 0."""
    code, out, seconds = mpirun(3, """
        import time
        import numpy as np
        from mpi4py import MPI
        from mpishard import CommunicationError, ShardingConfiguration
        from mpishard.nn import FunctionModel
        from mpishard.optim import SGD
        from mpishard.strategies import DDPOptimizer

        world = MPI.COMM_WORLD
        trains = world.rank >= 1
        ml = world.Split(color=int(trains), key=world.rank)
        if trains:
            config = ShardingConfiguration(ml, abort_on_exception=False, timeout=2)
            calls = [0]
            def f(p, x, y):
                calls[0] += 1
                if world.rank == 2 and calls[0] == 3:
                    raise ValueError("the solver diverged")
                r = x @ p - y
                return r @ r / len(y), 2 * x.T @ r / len(y)
            rng = np.random.default_rng(0)
            x = rng.standard_normal((256, 3))
            y = x.sum(1)
            try:
                DDPOptimizer(SGD(lr=0.1), config).optimize(FunctionModel(f, np.zeros(3)),
                                                          (x, y), 2, 32)
                status = "finished"
            except (ValueError, CommunicationError) as exc:
                status = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
            world.send(status, dest=0)
        else:
            for source in (1, 2):
                print(f"heard from {source}: {world.recv(source=source)}", flush=True)
            print("simulation goes on", flush=True)
        world.Barrier()
    """, timeout=120)
    assert code == 0, out
    assert "heard from 2: ValueError: the solver diverged" in out, out
    heard = next(x for x in out.splitlines() if x.startswith("heard from 1: "))
    assert heard.startswith("heard from 1: CommunicationError: world rank 1 on "), heard
    assert ("(rank 0 of the data-parallel group): Iallreduce over the data-parallel group "
            "(size 2) did not finish within 2 s") in heard, heard
    assert "simulation goes on" in out and seconds < 45
