"""A strategy built from the two parts of a core: "ZeRO-1" (optimizer state
sharded, gradient allreduced), against one process training on the global batch.

No such strategy ships: the test shows what a new one takes, a core that names
its [gradient reduction][mpishard.parallel.reduction] and its
[parameter placement][mpishard.parallel.placement], and nothing else. Run under
``mpirun -n N python -m pytest --with-mpi`` for N = 1, 2, 4.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from mpi4py import MPI
from reference import classification_data, sampler_batches, train_serial
from worlds import batch_splits

from mpishard import ShardingConfiguration
from mpishard.flat import Range, shard_ranges
from mpishard.nn import MLP
from mpishard.optim import Adam
from mpishard.parallel.base import DataParallelCore
from mpishard.parallel.placement import GatheredAfterStep, ShardedState
from mpishard.parallel.reduction import Allreduced
from mpishard.strategies.base import Strategy

pytestmark = pytest.mark.mpi

# 5*7+7 + 7*7+7 + 7*3+3 = 122 parameters: not a multiple of 4 (nor of 3).
SIZES = [5, 7, 7, 3]


class ZeRO1Core(DataParallelCore):
    """ZeRO stage 1: every rank sums the whole gradient (DDP's reduction) and
    updates its shard of the parameters with its shard of the state (ZeRO-2's
    placement), which an ``Allgatherv`` makes whole after the step."""

    strategy = "zero1"
    public = "ZeRO1Core"

    def _new_reduction(self):
        return Allreduced(self.config, self.accumulation_steps)

    def _new_placement(self, model, shard=None):
        state = ShardedState(self.layout.size, self.dtype, self.dp, self.xp, self.optimizer)
        return GatheredAfterStep(model, self.dp, self.xp, state)


@batch_splits(16)
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("accumulation_steps", [1, 2])
def test_zero1_from_the_parts_matches_serial(overlap, accumulation_steps):
    data = classification_data()
    make_model = functools.partial(MLP, SIZES, activation="tanh", dtype=np.float64, seed=7)
    serial = train_serial(make_model(), Adam(lr=3e-3),
                          sampler_batches(*data, 16, epochs=3), max_grad_norm=0.5)
    model = make_model()
    comm = MPI.COMM_WORLD
    zero1 = Strategy(ZeRO1Core(Adam(lr=3e-3), ShardingConfiguration(comm), bucket_mb=1e-4,
                               overlap=overlap, max_grad_norm=0.5,
                               accumulation_steps=accumulation_steps))
    result = zero1.optimize(model, data, epochs=3, batch_size=16)
    assert result.steps == len(serial.losses) == 18
    np.testing.assert_allclose(model.params, serial.params, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(result.losses, serial.losses, rtol=1e-10, atol=1e-12)
    zero1.verify_in_sync()
    # The state is sharded (ZeRO-2's placement), the gradient whole (DDP's reduction).
    shard = shard_ranges(model.params.size, comm.size)[comm.rank]
    held, state = zero1.optimizer_state_shard()
    assert held == shard and all(len(v) == len(shard) for v in state.values())
    assert zero1.core.reduction.vector.size == model.params.size
    assert zero1.parameter_shard()[0] == Range(0, model.params.size)
    full = zero1.synchronize_optimizer_state()
    assert all(v.size == model.params.size for v in full.values())
