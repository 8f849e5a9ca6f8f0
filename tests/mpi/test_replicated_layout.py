"""A data-parallel strategy on a layout with tensor or pipeline parallelism: refused on
every rank with a reason that is true of each strategy of the registry (ZeRO-3 shards
its parameters, so "replicates the whole model" was wrong for it). Run at 2 and 4 ranks.
"""

from __future__ import annotations

import pytest
from mpi4py import MPI

from mpishard import ShardingConfiguration, TopologyError
from mpishard.optim import SGD
from mpishard.strategies import STRATEGIES

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD.size


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_data_parallel_strategy_refuses_a_model_parallel_layout(name):
    if WORLD % 2:
        pytest.skip(f"a pipeline of 2 stages does not tile {WORLD} rank(s): run at 2 or 4")
    config = ShardingConfiguration(MPI.COMM_WORLD, pipeline_parallel_size=2)
    public = STRATEGIES[name].public_class.__name__
    with pytest.raises(TopologyError, match=rf"{public} runs every layer whole on every rank, "
                                            r"but the layout has tensor_parallel_size=1 and "
                                            r"pipeline_parallel_size=2; use "
                                            r"HybridShardedOptimizer"):
        STRATEGIES[name].public_class(SGD(lr=0.1), config)
