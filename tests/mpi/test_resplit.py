"""A sharded state split again over the survivors from the buddy copies, shard to
shard, without ULFM: the moves a recovery makes (``mpishard.recovery.resplit``),
with NumPy and CuPy state (the buddy copies of device arrays are kept in host
memory).

Run under ``mpirun -n N python -m pytest --with-mpi`` for N = 2 and 4 (one rank
needs another to lose). The reference is the same run's whole vectors, gathered
before the loss: the survivors' new shards must be those ranges, bit for bit.
The lost rank is left out of a sub-communicator (it takes no part); under ULFM
the same runs after a SIGKILL (``tests/faults/test_ulfm_train.py``).
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI
from strategies import build, whole

from mpishard import ShardingConfiguration
from mpishard.backend import to_numpy
from mpishard.comm import FlatComm
from mpishard.flat import shard_ranges
from mpishard.nn import MLP
from mpishard.optim import Adam
from mpishard.recovery import ShardBuddy
from mpishard.recovery.resplit import Moved, resplit
from mpishard.recovery.shardcopy import sharded_pieces

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_survivors_take_their_new_shards_from_shards_and_copies(xp, strategy):
    if WORLD.size < 2:
        pytest.skip("a lost rank needs another to survive it: run at 2 or 4 ranks")
    model = MLP([5, 7, 7, 3], activation="tanh", dtype=np.float64, xp=xp, seed=1)
    opt = build(strategy, Adam(lr=1e-2), ShardingConfiguration(WORLD), model=model,
                bucket_mb=0.0002)
    core = opt.core
    buddy = ShardBuddy(core)
    rng = np.random.default_rng(0)
    for _ in range(3):
        x = xp.asarray(rng.standard_normal((4, 5)))
        y = xp.asarray(rng.integers(0, 3, 4))
        core.train_step(x, y)
        buddy.exchange()
    params = whole(opt)
    state = {k: to_numpy(v) for k, v in core.synchronize_optimizer_state().items()}
    lost = WORLD.size - 2            # its copy is with its left neighbour
    split = WORLD.Split(MPI.UNDEFINED if WORLD.rank == lost else 0, WORLD.rank)
    if WORLD.rank == lost:
        return
    group = FlatComm(split, "survivors", 60)
    pieces = sharded_pieces(core, buddy, group, core.step_count)
    want = shard_ranges(params.size, group.size)[group.rank]
    dtypes = {name: value.dtype for name, value in pieces[0][1].items()}
    moved = Moved()
    got = resplit(group, pieces, want, dtypes, xp, moved)
    assert all(type(v) is type(pieces[0][1]["params"]) for v in got.values())
    for name, reference in {"params": params, **state}.items():
        assert np.array_equal(to_numpy(got[name]), reference[want.start:want.stop]), name
    # Only overlaps moved, straight from the pieces into the new shards: a rank
    # allocates its new shard of each vector and nothing else.
    assert moved.bytes < params.nbytes * len(dtypes) / 2
    assert moved.peak == len(want) * params.itemsize
    group.free()
