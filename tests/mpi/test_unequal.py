"""Ranks with unequal local batches (zero rows included) against one process.

Run under ``mpirun -n N python -m pytest --with-mpi`` for N = 1, 2, 4. Every
step, the 24 rows of a global batch are cut into unequal pieces, one a rank
(2 ranks: 10 and 14; 3 ranks, a sub-communicator of a 4-rank world: 7, 4, 13;
4 ranks: 9, 0, 8, 7), the sizes rotating over the ranks from step to step. The
reference is one process training on the 24 rows, computed in the same test;
parameters and losses agree to rtol 1e-10 (float64) after 10 steps, with
gradient-norm clipping active.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from mpi4py import MPI
from reference import assert_shards_match
from strategies import STRATEGIES, whole
from unequal import (
    COUNTS,
    MAX_NORM,
    ROWS,
    STEPS,
    comm_fixture,  # noqa: F401  (the ``comm`` fixture)
    global_batch,
    my_rows,
    serial_reference,
    train,
)

from mpishard import ShardingConfiguration
from mpishard.nn import MLP, FunctionModel, ParallelMLP
from mpishard.optim import SGD, AdamW
from mpishard.strategies import (
    DDPOptimizer,
    HybridShardedModel,
    HybridShardedOptimizer,
)

pytestmark = pytest.mark.mpi

SIZES = [5, 7, 7, 3]
OPTIMIZERS = {
    "sgd": lambda: SGD(lr=0.05, momentum=0.9),
    "adamw": lambda: AdamW(lr=3e-3, weight_decay=0.05),
}
MODES = ["plain", "accumulation", "no_sync"]


def assert_close(actual, expected, what, rtol=1e-10):
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * 1e-2, err_msg=what)


def make_mlp():
    return MLP(SIZES, activation="tanh", dtype=np.float64, seed=7)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("opt_name", OPTIMIZERS)
@pytest.mark.parametrize("mode", MODES)
def test_unequal_batches_match_one_process(comm, strategy, opt_name, mode):
    if mode == "no_sync" and strategy != "ddp":
        pytest.skip(f"{strategy} has no no_sync(): it reduces every micro-batch")
    make_opt = OPTIMIZERS[opt_name]
    ref, ref_losses, ref_norms = serial_reference(make_mlp, make_opt)
    assert ref_norms.min() > MAX_NORM          # clipping is active on every step
    model = make_mlp()
    # Tiny buckets: each layer its own bucket, and the overlapped path runs (pinned:
    # DDP's default "auto" may choose the other).
    dist = STRATEGIES[strategy](make_opt(), ShardingConfiguration(comm), bucket_mb=1e-4,
                                max_grad_norm=MAX_NORM, overlap=True,
                                accumulation_steps=2 if mode == "accumulation" else 1,
                                model=model)
    losses = train(dist, comm, mode)
    assert_close(whole(dist), ref, "parameters")
    assert_close(losses, ref_losses, "losses")
    assert dist.last_grad_norm == pytest.approx(ref_norms[-1], rel=1e-10)
    assert not np.allclose(whole(dist), make_mlp().params)   # it did train
    dist.verify_in_sync()


@pytest.mark.parametrize("strategy", ["ddp", "zero2-reduce_scatter"])
def test_dropout_with_exact_batch_position(comm, strategy):
    """backward(batch_start=, global_rows=) puts each rank's rows where they sit
    in the global batch, so dropout draws the one-process masks."""
    def make_model():
        return MLP(SIZES, dtype=np.float64, seed=9, dropout=0.3)

    ref, ref_losses, _ = serial_reference(make_model, OPTIMIZERS["adamw"], context=True)
    model = make_model()
    dist = STRATEGIES[strategy](OPTIMIZERS["adamw"](), ShardingConfiguration(comm),
                                max_grad_norm=MAX_NORM, accumulation_steps=2, model=model)
    losses = train(dist, comm, "accumulation", context=True)
    assert_close(whole(dist), ref, "parameters")
    assert_close(losses, ref_losses, "losses")


def least_squares(p, x, y):
    r = x @ p - y
    return float(r @ r / max(len(y), 1)), 2.0 * x.T @ r / max(len(y), 1)


class NoScaleModel:
    """A user's model without ``loss_scale``: the strategies multiply its
    gradient by the rows instead (with ``accumulate``: around the call)."""

    def __init__(self, accumulate: bool):
        self.inner = FunctionModel(least_squares, np.linspace(-1.0, 1.0, 5))
        self.params, self.grads, self.layout = (self.inner.params, self.inner.grads,
                                                self.inner.layout)
        if accumulate:
            self.forward_backward = self._accumulating

    def forward(self, x):
        return x @ self.params

    def forward_backward(self, x, y):
        return self.inner.forward_backward(x, y)

    def _accumulating(self, x, y, *, accumulate=False):
        return self.inner.forward_backward(x, y, accumulate=accumulate)


def regression_batch(step, n=ROWS):
    rng = np.random.default_rng([5, step])
    x = rng.standard_normal((n, 5))
    return x, x @ np.arange(1.0, 6.0) + 0.1 * rng.standard_normal(n)


@pytest.mark.parametrize("strategy", ["ddp", "zero2-allreduce", "zero3-reduce_scatter"])
@pytest.mark.parametrize("kind", ["function", "no-scale", "no-scale-accumulating"])
def test_models_without_hooks(comm, strategy, kind):
    """FunctionModel (scales while copying) and models without loss_scale; they
    have no parameter hooks, so each keeps its whole vector (ZeRO-3 trains them
    as ZeRO-2 does)."""
    make = {"function": lambda: FunctionModel(least_squares, np.linspace(-1.0, 1.0, 5)),
            "no-scale": lambda: NoScaleModel(False),
            "no-scale-accumulating": lambda: NoScaleModel(True)}[kind]
    make_opt = OPTIMIZERS["adamw"]
    ref, ref_losses, ref_norms = serial_reference(make, make_opt, max_grad_norm=5.0,
                                                  batch=regression_batch)
    assert ref_norms.max() > 5.0                # clipping is active on some steps
    model = make()
    dist = STRATEGIES[strategy](make_opt(), ShardingConfiguration(comm), max_grad_norm=5.0,
                                accumulation_steps=2, model=model)
    assert model.params is not None
    losses = train(dist, comm, "accumulation", batch=regression_batch)
    assert_close(model.params, ref, "parameters")
    assert_close(losses, ref_losses, "losses")
    assert dist.memory_report()["parameters"] == model.params.nbytes


@pytest.mark.parametrize("data_parallel", ["ddp", "zero2"])
def test_hybrid_unequal_replicas(data_parallel):
    """HybridShardedOptimizer: data-parallel replicas of a pipelined model with
    unequal batches (2 ranks: dp=2; 4 ranks: pp=2 x dp=2; 1 rank: one replica)."""
    world = MPI.COMM_WORLD
    pp = 2 if world.size == 4 else 1
    if world.size // pp not in (1, 2):
        pytest.skip(f"written for 1 or 2 data-parallel replicas (1, 2 or 4 ranks); "
                    f"{world.size} ranks give {world.size // pp}")
    config = ShardingConfiguration(world, pipeline_parallel_size=pp)
    dp = config.groups.dp
    factory = functools.partial(ParallelMLP, [5, 8, 8, 3], activation="tanh",
                                dtype=np.float64, seed=5)
    ref, ref_losses, _ = serial_reference(factory, OPTIMIZERS["adamw"])
    counts = {1: [24], 2: [10, 14]}[dp.size]
    model = HybridShardedModel(factory, config, micro_batches=2)
    opt = HybridShardedOptimizer(OPTIMIZERS["adamw"](), config, data_parallel=data_parallel,
                                 model=model, max_grad_norm=MAX_NORM)
    losses = []
    for step in range(STEPS):
        x, y = global_batch(step)
        mine = counts[(dp.rank + step) % dp.size]
        lo = sum(counts[(r + step) % dp.size] for r in range(dp.rank))
        opt.backward(x[lo:lo + mine], y[lo:lo + mine])
        losses.append(opt.step())
    assert_close(np.array(losses), ref_losses, "losses")
    serial = factory()
    serial.params[...] = ref
    assert_shards_match(model, serial)


def test_no_rows_anywhere_raises_everywhere():
    comm = MPI.COMM_WORLD
    if comm.size not in COUNTS:
        pytest.skip(f"the unequal pieces (COUNTS) are written for 1 to 4 ranks, not {comm.size}")
    model = make_mlp()
    dist = DDPOptimizer(OPTIMIZERS["sgd"](), ShardingConfiguration(comm), model=model)
    before = model.params.copy()
    x, y = global_batch(0)
    dist.backward(x[:0], y[:0])
    with pytest.raises(ValueError, match="global batch has no rows"):
        dist.step()
    np.testing.assert_array_equal(model.params, before)
    # The strategy is usable afterwards.
    lo, hi = my_rows(comm.size, comm.rank, 0)
    dist.backward(x[lo:hi], y[lo:hi])
    dist.step()
    assert dist.step_count == 1
