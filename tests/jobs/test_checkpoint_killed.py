"""Whole ``mpirun`` jobs killed in the middle of a checkpoint save: the previous
checkpoint stays the latest, and a new job at another size resumes from it.

Plain pytest: each test starts its own ``mpirun`` (the ``mpirun`` fixture). The
checkpoint files without MPI: ``tests/unit/test_checkpoint.py``.
"""

from __future__ import annotations

import os

import pytest

TRAIN = """
import os, signal, sys
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
manager = CheckpointManager(folder, keep=3)
"""


@pytest.mark.launch
@pytest.mark.parametrize("driver", ["direct", "mpio", "serial"])
def test_rank_killed_during_save_leaves_the_previous_checkpoint(tmp_path, driver, mpirun):
    folder = str(tmp_path / "run")
    code, out, _ = mpirun(2, TRAIN.format(folder=folder) + f"""
zero2.optimize(model, (x, y), epochs=1, batch_size=16)
manager.driver = {driver!r}
manager.save(model, zero2)                                    # step 4: complete
state = zero2.synchronize_optimizer_state()
if comm.rank == 0:
    np.save(os.path.join(folder, "params-4.npy"), model.params)
    np.save(os.path.join(folder, "exp_avg-4.npy"), state["exp_avg"])
zero2.optimize(model, (x, y), epochs=2, batch_size=16)        # epochs is the total
import h5py
writer = 0 if {driver!r} == "serial" else 1                     # the rank that writes data
if comm.rank == writer:
    # direct: os.pwrite; the HDF5 drivers: h5py's write_direct
    owner, name = (os, "pwrite") if {driver!r} == "direct" else (h5py.Dataset, "write_direct")
    real = getattr(owner, name)
    calls = []
    def dying(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGKILL)               # mid-save, one piece written
        return real(*args, **kwargs)
    setattr(owner, name, dying)
manager.save(model, zero2)                                    # step 8: killed
print("unreachable")
""")
    assert code != 0, out
    assert "unreachable" not in out
    names = sorted(os.listdir(folder))
    assert "ckpt-0000000004.h5" in names and "ckpt-0000000008.h5" not in names, names
    assert any(".tmp-" in n for n in names), names              # the interrupted save's file
    # A new job, at another size, resumes from the last complete checkpoint.
    code, out, _ = mpirun(3, TRAIN.format(folder=folder) + """
info = manager.load_latest(model, zero2)
state = zero2.synchronize_optimizer_state()
if comm.rank == 0:
    same = np.array_equal(model.params, np.load(os.path.join(folder, "params-4.npy")))
    same_state = np.array_equal(state["exp_avg"], np.load(os.path.join(folder, "exp_avg-4.npy")))
    print("RESUMED", info.step, zero2.step_count, same, same_state, zero2.data_position["epoch"])
""")
    assert code == 0, out
    assert "RESUMED 4 4 True True 1" in out, out
