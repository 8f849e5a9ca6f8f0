"""Whole ``mpirun`` jobs killed while an asynchronous checkpoint is written in the
background: the previous checkpoint stays the latest and loads, and no half file
appears under a checkpoint's name.

Plain pytest: each test starts its own ``mpirun`` (the ``mpirun`` fixture). The
background thread is slowed (``MPISHARD_ASYNC_CHECKPOINT_SLOW``: pieces of 64
bytes, 3 ms apart, about half a second per rank) and a rank kills itself with
SIGKILL at a random moment of the write, or just after it (before the commit).
"""

from __future__ import annotations

import os
import random

import pytest

TRAIN = """
import os, signal, sys, time
import numpy as np
from mpi4py import MPI
from mpishard import ShardingConfiguration
from mpishard.checkpoint import CheckpointManager
from mpishard.nn import MLP
from mpishard.optim import Adam
from mpishard.strategies import ZeRO2Optimizer
folder = {folder!r}
rng = np.random.default_rng(1)
x = rng.standard_normal((64, 5)); y = rng.integers(0, 3, 64)
comm = MPI.COMM_WORLD
model = MLP([5, 16, 16, 3], seed=7)
zero2 = ZeRO2Optimizer(Adam(lr=1e-2), ShardingConfiguration(comm))
manager = CheckpointManager(folder, keep=3, async_=True)
"""


@pytest.mark.launch
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_kill_during_the_background_write_leaves_the_previous_checkpoint(tmp_path, seed,
                                                                         mpirun):
    folder = str(tmp_path / "run")
    delay = random.Random(seed).uniform(0.0, 0.7)
    killer = seed % 2
    code, out, _ = mpirun(2, TRAIN.format(folder=folder) + f"""
zero2.optimize(model, (x, y), epochs=1, batch_size=16)
manager.save(model, zero2)
manager.wait()                                                # step 4: complete
if comm.rank == 0:
    np.save(os.path.join(folder, "params-4.npy"), model.params)
zero2.optimize(model, (x, y), epochs=2, batch_size=16)
os.environ["MPISHARD_ASYNC_CHECKPOINT_SLOW"] = "64,0.003"
manager.save(model, zero2)                                    # step 8: in the background
if comm.rank == {killer}:
    time.sleep({delay})
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(5)
manager.wait()
print("unreachable")
""", env={"MPISHARD_ASYNC_CHECKPOINT_SLOW": None})
    assert code != 0, out
    assert "unreachable" not in out
    names = sorted(os.listdir(folder))
    assert "ckpt-0000000004.h5" in names and "ckpt-0000000008.h5" not in names, names
    assert any(".tmp-" in n for n in names), names              # the interrupted save's file
    code, out, _ = mpirun(3, TRAIN.format(folder=folder) + """
info = manager.load_latest(model, zero2)
if comm.rank == 0:
    same = np.array_equal(model.params, np.load(os.path.join(folder, "params-4.npy")))
    print("RESUMED", info.step, same)
manager.save(model, zero2)                                    # removes the temporary
manager.wait()
if comm.rank == 0:
    print("LEFT", sorted(n for n in os.listdir(folder) if n.endswith(".h5") or ".tmp-" in n))
""")
    assert code == 0, out
    assert "RESUMED 4 True" in out, out
    assert "LEFT ['ckpt-0000000004.h5']" in out, out
