"""3D layouts with ZeRO-3 inside, built in shards: each data-parallel rank allocates and
initialises only its shard of its (stage, tensor) slice.

``HybridShardedOptimizer(..., data_parallel="zero3").build(factory)`` against the whole
construction then attach (0.5's way) in the same job: the shards are the same bits,
and trained the same, bit for bit; both against the serial reference (one process,
the whole model and the global batch), float64, rtol 1e-10. Run at 1, 2, 4 and 8
ranks (tp2 x dp2 at 4, tp2 x pp2 x dp2 at 8).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
from mpi4py import MPI
from reference import assert_shards_match, sampler_batches, train_serial

from mpishard import ShardingConfiguration
from mpishard.flat import ParameterShard
from mpishard.nn import GPT, MLP, ParallelMLP
from mpishard.optim import AdamW
from mpishard.strategies import HybridShardedModel, HybridShardedOptimizer

pytestmark = [pytest.mark.mpi, pytest.mark.layout3d]   # also at 8 ranks: tp2-pp2-dp2

WORLD = MPI.COMM_WORLD.size
ALL_LAYOUTS = [(1, 1, 1), (1, 1, 2), (2, 1, 1), (2, 1, 2), (1, 2, 2), (2, 2, 2)]
LAYOUTS = [layout for layout in ALL_LAYOUTS if math.prod(layout) == WORLD] or [
    pytest.param(None, marks=pytest.mark.skip(reason=f"no layout of {WORLD} ranks here: "
                                                     f"run at 1, 2, 4 or 8"))]
VOCAB, SEQ, D, HEADS, BLOCKS = 13, 6, 8, 2, 3
OPTIONS = {"bucket_mb": 0.001, "gather_mb": 0.001}     # several buckets a stage


def gpt_factory():
    return functools.partial(GPT, VOCAB, SEQ, D, HEADS, BLOCKS, dtype=np.float64, seed=11)


def mlp_factory():
    return functools.partial(ParallelMLP, [6, 10, 8, 8, 4], activation="tanh",
                             dtype=np.float64, seed=5)


FACTORIES = {"gpt": gpt_factory, "mlp": mlp_factory}


def data(kind, n=32):
    rng = np.random.default_rng(2)
    if kind == "gpt":
        x = rng.integers(0, VOCAB, (n, SEQ))
        return x, np.roll(x, -1, axis=1)
    x = rng.standard_normal((n, 6))
    return x, np.argmax(x[:, :4], axis=1)


def make_opt():
    return AdamW(lr=1e-2, weight_decay=0.01)


def config_of(layout):
    tp, pp, _ = layout
    return ShardingConfiguration(MPI.COMM_WORLD, tensor_parallel_size=tp,
                                 pipeline_parallel_size=pp)


def bits(a):
    return np.ascontiguousarray(a).view(np.uint8)


@pytest.mark.parametrize("layout", LAYOUTS,
                         ids=lambda t: f"tp{t[0]}-pp{t[1]}-dp{t[2]}" if t else "none")
@pytest.mark.parametrize("kind", ["gpt", "mlp"])
@pytest.mark.parametrize("stage_gradient", ["sharded", "whole"])
def test_built_in_shards_is_the_whole_construction_bit_for_bit(layout, kind, stage_gradient):
    factory = FACTORIES[kind]
    config = config_of(layout)
    options = dict(OPTIONS, stage_gradient=stage_gradient)
    whole = HybridShardedModel(factory(), config, micro_batches=2)
    ref = HybridShardedOptimizer(make_opt(), config, data_parallel="zero3", model=whole,
                                 max_grad_norm=0.5, **options)
    opt = HybridShardedOptimizer(make_opt(), config, data_parallel="zero3", max_grad_norm=0.5,
                                 **options)
    model = opt.build(factory(), micro_batches=2)
    assert model.shard == ParameterShard(config.groups.dp.rank, config.groups.dp.size)
    assert model.params is None and model.built_shard() is None      # attached
    (r0, v0), (r1, v1) = ref.parameter_shard(), opt.parameter_shard()
    assert r0 == r1 and np.array_equal(bits(v0), bits(v1))
    if stage_gradient == "whole":   # the pipeline sums its micro-batches there
        assert model.grads is not None and model.grads.size == model.layout.size
    else:                           # reduced to the shards micro-batch by micro-batch
        assert model.grads is None and whole.grads is None
    # Trained alike, bit for bit, and as one process on the whole model.
    x, y = data(kind)
    serial = train_serial(factory()(), make_opt(), sampler_batches(x, y, 16, 2),
                          max_grad_norm=0.5)
    a = ref.optimize(whole, (x, y), epochs=2, batch_size=16)
    b = opt.optimize(model, (x, y), epochs=2, batch_size=16)
    assert a.losses == b.losses
    np.testing.assert_allclose(b.losses, serial.losses, rtol=1e-10)
    (r0, v0), (r1, v1) = ref.parameter_shard(), opt.parameter_shard()
    assert np.array_equal(bits(v0), bits(v1))
    for name in opt.state:
        assert np.array_equal(bits(ref.state[name]), bits(opt.state[name])), name
    opt.unshard()
    assert_shards_match(model, serial.model)


@pytest.mark.mpi(min_size=2)
def test_bad_builds_raise_on_every_rank():
    config = ShardingConfiguration(MPI.COMM_WORLD, tensor_parallel_size=1,
                                   pipeline_parallel_size=1)
    ddp = HybridShardedOptimizer(make_opt(), config, data_parallel="ddp")
    with pytest.raises(ValueError, match="needs data_parallel='zero3', got 'ddp'"):
        ddp.build(gpt_factory())
    dp = config.groups.dp
    wrong = ParameterShard((dp.rank + 1) % dp.size, dp.size)
    # The lowest rank's message on every rank.
    with pytest.raises(ValueError, match=rf"rank 0 of {dp.size}: pass ParameterShard\(0, "):
        HybridShardedModel(gpt_factory(), config, shard=wrong)

    def no_shard(tp_comm=None, stage_layers=None):   # a factory that takes no shard=
        return ParallelMLP([6, 4], tp_comm=tp_comm, stage_layers=stage_layers)

    opt = HybridShardedOptimizer(make_opt(), config, data_parallel="zero3")
    with pytest.raises(TypeError, match="must take tp_comm=, stage_layers= and shard="):
        opt.build(no_shard)
    with pytest.raises(TypeError, match="for an MLP use ParallelMLP"):
        opt.build(functools.partial(MLP, [6, 4]))
