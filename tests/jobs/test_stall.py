"""A rank that stalls ends the job within the timeout, naming the call and the group.

Each test starts its own ``mpirun -n N`` job (plain pytest, no ``--with-mpi``), with
``ShardingConfiguration(timeout=2)``, and makes ranks sleep far past the timeout
(60 s) where others wait for them: before a checkpoint save, inside a save (before
HDF5 creates the file, and inside HDF5's file creation itself), and before a pipeline
step. The job must end within the timeout plus 10 s of the moment the waiting ranks
started to wait (printed by the job), with a non-zero exit code and a message that
names the call and the group: exactly one with 2 ranks; with 4, one from each rank
that waits, or fewer (the first abort may end the others before they print), all
naming the same call and group. (The training loop's stalls are in
``tests/jobs/test_stall_train.py``.)
"""

from __future__ import annotations

import re
import time

import pytest
from mpijobs import mpirun

# Timeouts of 2 s that every healthy rank must meet: run alone (scripts/test.sh).
pytestmark = [pytest.mark.launch, pytest.mark.timing]

TIMEOUT = 2.0
SLEEP = 60          # the stalled rank; the test fails if the job waits for it
GRACE = 10.0        # abort, Open MPI's teardown, a loaded machine

# Ranks share mpirun's output, so a line may hold another rank's text before it.
LINE = re.compile(r"\[mpishard\].*did not finish within.*$", re.MULTILINE)

CHECKPOINT_JOB = """
import os, time
import numpy as np
from mpi4py import MPI
from mpishard import ShardingConfiguration
from mpishard.checkpoint import load_checkpoint, save_checkpoint
from mpishard.nn import MLP
from mpishard.optim import AdamW
from mpishard.parallel import DDPCore

config = ShardingConfiguration(timeout={timeout})
model = MLP([5, 7, 3], seed=1, dtype=np.float64)
ddp = DDPCore(AdamW(lr=1e-3), config, model=model)
path = os.path.join({folder!r}, "c.h5")
rank = MPI.COMM_WORLD.rank
save_checkpoint(path, model, ddp, driver="mpio")     # a save that works, first
config.world.barrier()
{stall}
print(f"WAITING {{time.time():.3f}}", flush=True)
{call}
print("unreachable", flush=True)
"""
SAVE = 'save_checkpoint(path, model, ddp, driver="mpio")'
LOAD = "load_checkpoint(path, model, ddp)"


def checkpoint_job(folder, stall: str, call: str) -> str:
    """The job's code: a save that works, then ``stall``, then ``call`` again."""
    return CHECKPOINT_JOB.format(timeout=TIMEOUT, folder=str(folder), stall=stall, call=call)


def _check(job, *, where: str, waiters: list[int]) -> list[str]:
    """The job failed soon after it printed WAITING, with a timeout message from
    one of the world ranks ``waiters`` (at most one each; exactly one when only
    one rank waits), each containing ``where``; those messages."""
    end = time.time()
    code, out, _ = job
    assert code != 0, out
    assert "unreachable" not in out, out
    waiting = [float(t) for t in re.findall(r"WAITING (\d+\.\d{3})", out)]
    assert waiting, out
    assert end - min(waiting) < TIMEOUT + GRACE, f"took {end - min(waiting):.1f} s:\n{out}"
    lines = LINE.findall(out)
    ranks = [int(m) for line in lines for m in re.findall(r"\[mpishard\] world rank (\d+) ", line)]
    assert len(ranks) == len(lines) == len(set(ranks)) >= 1, out
    assert set(ranks) <= set(waiters), out
    for line in lines:
        assert where in line, out
        assert f"did not finish within {TIMEOUT:g} s" in line, out
    return lines


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("call", [SAVE, LOAD], ids=["save", "load"])
def test_rank_late_for_a_checkpoint(tmp_path, call, n):
    # The last rank comes to the save (the load) 60 s late: the others wait in its
    # first call, an agreement, before any HDF5 call.
    stall = f"if rank == {n - 1}:\n    time.sleep({SLEEP})"
    job = mpirun(n, checkpoint_job(tmp_path, stall, call), timeout=SLEEP + 60)
    function = call.split("(")[0]
    lines = _check(job, where=f"Iallreduce over the training group (size {n}) in {function}(",
                   waiters=list(range(n - 1)))
    assert all(str(tmp_path) in line for line in lines)


def test_rank_stalls_inside_a_save_before_hdf5(tmp_path):
    # Rank 1 stops after the agreement on the temporary name, just before the file
    # is created: rank 0 waits at the barrier that guards HDF5's collective create.
    stall = ("if rank == 1:\n"
             "    import mpishard.checkpoint.write as w\n"
             "    real = w._with_order\n"
             "    def slow(*a):\n"
             f"        time.sleep({SLEEP})\n"
             "        return real(*a)\n"
             "    w._with_order = slow")
    job = mpirun(2, checkpoint_job(tmp_path, stall, SAVE), timeout=SLEEP + 60)
    _check(job, where="Ibarrier before HDF5 File create (mpio) over the checkpoint group "
                      "(size 2) in save_checkpoint(", waiters=[0])


def test_rank_stalls_inside_hdf5_file_create(tmp_path):
    # Past the barrier rank 1 stops before h5py opens the file: rank 0 is inside
    # HDF5's collective create, holding the GIL, where FlatComm cannot time it. The
    # deadline (faulthandler) ends the process with its stack.
    stall = ("if rank == 1:\n"
             "    import h5py\n"
             "    real = h5py.File\n"
             "    def slow(*a, **k):\n"
             "        if k.get('driver') == 'mpio':\n"
             f"            time.sleep({SLEEP})\n"
             "        return real(*a, **k)\n"
             "    h5py.File = slow")
    job = mpirun(2, checkpoint_job(tmp_path, stall, SAVE), timeout=SLEEP + 60)
    end = time.time()
    code, out, _ = job
    assert code != 0, out
    assert "unreachable" not in out, out
    waiting = min(float(t) for t in re.findall(r"WAITING (\d+\.\d{3})", out))
    assert end - waiting < TIMEOUT + GRACE, f"took {end - waiting:.1f} s:\n{out}"
    assert "Timeout (0:00:02)!" in out, out
    assert re.search(r'File ".*mpishard/checkpoint/write\.py", line \d+ in _write_mpio', out), out


PIPELINE_JOB = """
import functools, time
import numpy as np
from mpi4py import MPI
from mpishard import ShardingConfiguration
from mpishard.nn import HybridShardedModel, ParallelMLP

config = ShardingConfiguration(pipeline_parallel_size=2, timeout={timeout})   # dp = n / 2
factory = functools.partial(ParallelMLP, [6, 8, 8, 4], activation="tanh", dtype=np.float64,
                            seed=5)
model = HybridShardedModel(factory, config, micro_batches=2)
rng = np.random.default_rng(0)
x, y = rng.standard_normal((8, 6)), rng.integers(0, 4, 8)
model.forward_backward(x, y)                          # a step that works, first
config.world.barrier()
if config.groups.pp.rank == {sleeper}:
    time.sleep({sleep})
print(f"WAITING {{time.time():.3f}}", flush=True)
model.forward_backward(x, y)
print("unreachable", flush=True)
"""


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("sleeper", [0, 1], ids=["first-stage-late", "last-stage-late"])
def test_stage_stalls_in_a_pipeline_step(sleeper, n):
    # The first stage late: the last waits for its activations. The last stage late:
    # the first sends its activations (non-blocking) and waits for their gradient.
    # Stage s holds world ranks [s * n/2, (s + 1) * n/2) (pipeline outermost); the
    # message names the sleeper by its rank in the pipeline group.
    job = mpirun(n, PIPELINE_JOB.format(timeout=TIMEOUT, sleeper=sleeper, sleep=SLEEP),
                 timeout=SLEEP + 60)
    waiter = 1 - sleeper
    _check(job, where=f"Irecv from rank {sleeper} over the pipeline-parallel group (size 2)",
           waiters=list(range(waiter * n // 2, (waiter + 1) * n // 2)))


def test_timeout_message_names_what_the_caller_is_doing():
    # The context of FlatComm.during nests, travels to a duplicate made inside it
    # (the checkpoint's private communicator), and ends with the block.
    from mpi4py import MPI

    from mpishard.comm import FlatComm

    world = FlatComm(MPI.COMM_SELF.Dup(), "world", timeout=TIMEOUT)
    assert world.describe("Ibcast") == "Ibcast over the world group (size 1)"
    with world.during("save_checkpoint(a.h5)"):
        with world.during("inner"):
            assert world.describe("Ibcast") == "Ibcast over the world group (size 1) in inner"
        copy = world.dup("checkpoint")
        assert copy.describe("Ibarrier before HDF5 File create") == (
            "Ibarrier before HDF5 File create over the checkpoint group (size 1) in "
            "save_checkpoint(a.h5)")
        copy.barrier(before="HDF5 File create")     # size 1: nothing to wait for
        copy.free()
    assert world.describe("Ibcast") == "Ibcast over the world group (size 1)"
    world.free()
