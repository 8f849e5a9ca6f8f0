"""``evaluate(..., group=dp)``: each rank evaluates its part of the rows, one Allreduce.

Against the serial reference (the same model on one process, every row): DDP
and ZeRO-3 (whose forward is collective over ``dp``: a rank with a shorter part
still runs as many forwards), row counts that do not split evenly and fewer
rows than ranks; rtol 1e-12. Run under ``mpirun -n N`` for N = 1, 2, 4.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from mpishard import ShardingConfiguration
from mpishard.nn import GPT
from mpishard.optim import Adam
from mpishard.strategies import DDPOptimizer, ZeRO3Optimizer
from mpishard.train import evaluate

pytestmark = pytest.mark.mpi
WORLD = MPI.COMM_WORLD
ARGS = (GPT, 32, 6, 16, 2, 3)


@pytest.mark.parametrize("name", ["ddp", "zero3"])
@pytest.mark.parametrize("rows,batch", [(7, 2), (5, 1), (2, 4), (13, 32)])
def test_shared_rows_give_the_serial_mean(name, rows, batch):
    rng = np.random.default_rng(rows)
    x = rng.integers(0, 32, (rows, 6))
    y = np.roll(x, -1, axis=1)
    serial = ARGS[0](*ARGS[1:], dtype=np.float64, seed=2)
    expected = evaluate(serial, x, y, batch=batch)
    config = ShardingConfiguration(WORLD)
    if name == "ddp":
        model = ARGS[0](*ARGS[1:], dtype=np.float64, seed=2)
        strategy = DDPOptimizer(Adam(lr=1e-3), config, model=model)
    else:
        strategy = ZeRO3Optimizer(Adam(lr=1e-3), config)
        model = strategy.build(*ARGS, dtype=np.float64, seed=2)
    value = evaluate(model, x, y, batch=batch, group=strategy.dp)
    assert value == pytest.approx(expected, rel=1e-12)
    assert WORLD.allgather(value) == [value] * WORLD.size
    config.free()
