"""Errors at the public boundary that say the way out (README issue 13, items 1 and 8)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from mpi4py import MPI

from mpishard import ShardingConfiguration
from mpishard.nn import GPT, MLP, ParallelMLP
from mpishard.nn.hybrid import _factory_problem
from mpishard.optim import SGD
from mpishard.strategies import DDPOptimizer, HybridShardedModel, ZeRO2Optimizer


def test_factories_that_take_a_tensor_group_pass():
    assert _factory_problem(functools.partial(ParallelMLP, [4, 8, 2])) is None
    assert _factory_problem(functools.partial(GPT, 16, 4, 8, 2, 1)) is None
    assert _factory_problem(lambda **kw: ParallelMLP([4, 8, 2], **kw)) is None


def test_plain_mlp_is_refused_with_the_way_out():
    config = ShardingConfiguration(MPI.COMM_SELF)
    with pytest.raises(TypeError, match=r"MLP takes no tp_comm and no stage_layers; for an "
                                        r"MLP use ParallelMLP \(the same model, split\)"):
        HybridShardedModel(functools.partial(MLP, [4, 8, 2]), config)
    assert _factory_problem(lambda tp_comm: None) == (
        "the model factory must take tp_comm= and stage_layers= (GPT or ParallelMLP, other "
        "arguments bound with functools.partial); <lambda> takes no stage_layers")


def test_own_loop_without_a_model_says_how_to_attach_one():
    ddp = DDPOptimizer(SGD(lr=0.1), ShardingConfiguration(MPI.COMM_SELF))
    x, y = np.zeros((4, 4)), np.zeros(4, dtype=int)
    with pytest.raises(RuntimeError, match=r"DDPOptimizer has no model: pass model= when you "
                                           r"make it \(DDPOptimizer\(optimizer, config, "
                                           r"model=model\)\), or call attach\(model\)"):
        ddp.backward(x, y)
    ddp.attach(MLP([4, 8, 2]))
    ddp.backward(x, y)
    assert ddp.step() > 0


@pytest.mark.parametrize("cls, message", [
    (ZeRO2Optimizer, r"optimize\(\) takes no buddy_copies since 0\.6: pass it to the "
                     r"constructor: ZeRO2Optimizer\(\.\.\., buddy_copies=\.\.\.\)"),
    (DDPOptimizer, r"it is an option of ZeRO2Optimizer\(\.\.\., buddy_copies=\.\.\.\) and "
                   r"ZeRO3Optimizer\(\.\.\., buddy_copies=\.\.\.\); this DDPOptimizer "
                   r"\(ddp\) keeps none"),
])
def test_optimize_buddy_copies_names_the_constructor(cls, message):
    # optimize(buddy_copies=) warned in 0.5 and set the core's option; 0.6 removed it.
    strategy = cls(SGD(lr=0.1), ShardingConfiguration(MPI.COMM_SELF))
    x, y = np.zeros((4, 4)), np.zeros((4, 2))
    with pytest.raises(TypeError, match=message):
        strategy.optimize(MLP([4, 8, 2]), (x, y), epochs=1, batch_size=4, buddy_copies=False)
