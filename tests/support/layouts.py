"""A small tensor/pipeline-parallel MLP and its whole twin, for the checkpoint tests.

``hybrid(world, tp, pp, data_parallel)`` builds the 3D layout over ``world``;
``mlp_factory()()`` is the same model whole on one process (the same seed, the
same logical tensors), and ``assert_slices`` checks that each local tensor of the
layout is its slice of the whole model's tensor.
"""

from __future__ import annotations

import functools

import numpy as np

from mpishard import ShardingConfiguration
from mpishard.nn import ParallelMLP
from mpishard.optim import AdamW

__all__ = ["assert_slices", "hybrid", "mlp_data", "mlp_factory"]


def mlp_factory():
    """The model: 6 -> 8 -> 8 -> 8 -> 4, tanh, float64, seed 5."""
    return functools.partial(ParallelMLP, [6, 8, 8, 8, 4], activation="tanh",
                             dtype=np.float64, seed=5)


def mlp_data(n=48):
    """``n`` rows of 6 features and their class (4 classes)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((n, 6))
    return x, np.argmax(x[:, :4] + 0.1 * rng.standard_normal((n, 4)), axis=1)


def hybrid(world, tp, pp, data_parallel, seed_shift=0.0, **options):
    """The model and its ``HybridShardedOptimizer`` (AdamW) over ``world``, tp x pp;
    ``seed_shift`` moves the parameters off the seed's (values a load must replace)."""
    from mpishard.strategies import HybridShardedModel, HybridShardedOptimizer

    config = ShardingConfiguration(world, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    model = HybridShardedModel(mlp_factory(), config, micro_batches=2)
    if seed_shift:
        model.params[...] += seed_shift
    opt = HybridShardedOptimizer(AdamW(lr=1e-2, weight_decay=0.01), config,
                                 data_parallel=data_parallel, model=model, **options)
    return model, opt


def assert_slices(model, params, full_params, full_layout, rtol=0.0):
    """Each local tensor of ``params`` (the layout's vector of ``model``) is its slice
    of the logical tensor in ``full_params``: equal, or to ``rtol``."""
    for name, shard in model.tensor_shards().items():
        local = model.layout.view(params, name)
        whole = full_layout.view(full_params, shard.logical_name)[shard.index]
        if rtol:
            np.testing.assert_allclose(local, whole, rtol=rtol, atol=rtol * 1e-2)
        else:
            np.testing.assert_array_equal(local, whole)
