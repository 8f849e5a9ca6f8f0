"""A rank lost (ULFM) while an asynchronous checkpoint is written in the background.

Runs only in the fault-tolerant runtime (``.venv-ft/bin/python -m pytest
tests/faults/test_ulfm_async_checkpoint.py``); elsewhere it skips, saying why.
Each test starts ``mpirun --with-ft ulfm -n 3``.

DDP trains with ``CheckpointManager(async_=True)`` and ``checkpoint_every=4``; the
background write is slowed (``MPISHARD_ASYNC_CHECKPOINT_SLOW``) so that the save
of step 4 is still in flight when the victim SIGKILLs itself after step 5. The
survivors discard that save (never committed: its communicator holds the dead
rank) and go on; the saves after the recovery are complete. No half file ever
has a checkpoint's name, and the last one holds the survivors' parameters. The
victim is rank 2 or rank 0 (the rank that creates and seals the files).
"""

from __future__ import annotations

import json
import re

import pytest
from test_ulfm import _ft_or_skip, ulfm_job

pytestmark = pytest.mark.launch

JOB = r"""
import json, os, signal
import numpy as np
from mpi4py import MPI
from mpishard import ShardingConfiguration
from mpishard.checkpoint import CheckpointManager, load_checkpoint, verify_checkpoint
from mpishard.checkpoint import background
from mpishard.comm import ulfm
from mpishard.nn import MLP
from mpishard.optim import Adam
from mpishard.strategies import DDPOptimizer

assert ulfm.available()[0], ulfm.available()[1]
VICTIM, FOLDER = {victim}, {folder!r}
rank = MPI.COMM_WORLD.rank
rng = np.random.default_rng(0)
X = rng.standard_normal((8 * 24, 5))
Y = rng.integers(0, 3, 8 * 24)
model = MLP([5, 16, 3], activation="tanh", dtype=np.float64, seed=1)
config = ShardingConfiguration(MPI.COMM_WORLD, timeout=60, fault_tolerance="ulfm")
opt = DDPOptimizer(Adam(lr=1e-2), config, model=model)
manager = CheckpointManager(FOLDER, keep=None, async_=True)
os.environ[background.SLOW_ENV] = "32,0.05"   # 2 s for step 4's save: in flight at step 5


def callback(step, loss):
    if step == 5:
        os.environ.pop(background.SLOW_ENV)   # the saves after this one at full speed
        if rank == VICTIM:
            print(f"IN_FLIGHT {{background.pending_checkpoint()}}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


result = opt.optimize(model, (X, Y), epochs=2, batch_size=24, seed=3, checkpoints=manager,
                      checkpoint_every=4, callback=callback)
world = opt.config.world
if world.rank == 0:
    names = sorted(os.listdir(FOLDER))
    verified = [verify_checkpoint(os.path.join(FOLDER, n)).step for n in names
                if n.endswith(".h5")]
    last = MLP([5, 16, 3], activation="tanh", dtype=np.float64, seed=2)
    load_checkpoint(result.checkpoint, last, comm=MPI.COMM_SELF)
    print("RESULT " + json.dumps({{
        "names": names, "verified": verified, "recoveries": len(result.recoveries),
        "steps": opt.step_count, "checkpoint": os.path.basename(result.checkpoint),
        "same": bool(np.array_equal(last.params, model.params)),
        "pending": background.pending_checkpoint()}}), flush=True)
"""


@pytest.mark.parametrize("victim", [2, 0])
def test_save_in_flight_when_a_rank_is_lost_is_discarded_cleanly(tmp_path, victim):
    _ft_or_skip()
    job = ulfm_job(3, JOB.format(victim=victim, folder=str(tmp_path / "ckpt")), timeout=60)
    out = job.stdout
    assert "IN_FLIGHT " + str(tmp_path / "ckpt" / "ckpt-0000000004.h5") in out, out
    found = re.findall(r"^RESULT (.*)$", out, re.MULTILINE)
    assert found, out
    result = json.loads(found[-1])
    # Step 4's save was discarded; the saves after the recovery (8, 12, 16) are whole.
    assert result["names"] == [f"ckpt-{s:010d}.h5" for s in (8, 12, 16)], out
    assert result["verified"] == [8, 12, 16], out
    assert result["recoveries"] == 1 and result["steps"] == 16, out
    assert result["checkpoint"] == "ckpt-0000000016.h5" and result["same"], out
    assert result["pending"] is None, out
    assert job.returncode in (0, None), out
