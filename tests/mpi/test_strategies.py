"""Every strategy of the registry (DDP, ZeRO-2, ZeRO-3) against one process
training on the global batch.

Run under ``mpirun -n N python -m pytest --with-mpi`` for N = 1, 2, 4. Each test
computes the serial reference itself (plain optimizer updates on the whole global
batch, no strategy code) and compares the parameters after many steps:
float64 to rtol 1e-10, float32 to rtol 1e-5 after a few steps.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from mpi4py import MPI
from reference import classification_data, sampler_batches, train_serial
from strategies import NAMES, SHARDED, build, whole
from worlds import batch_splits

from mpishard import MpiShardError, ShardingConfiguration
from mpishard.data import ShardedSampler
from mpishard.nn import MLP, FunctionModel
from mpishard.optim import SGD, Adam, AdamW
from mpishard.optim.schedules import CosineSchedule
from mpishard.strategies import DDPOptimizer, ZeRO2Optimizer

pytestmark = pytest.mark.mpi

OPTIMIZERS = {
    "sgd-nesterov": lambda: SGD(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4),
    "adam": lambda: Adam(lr=3e-3, weight_decay=1e-4),
    "adamw": lambda: AdamW(lr=3e-3, weight_decay=0.05),
}
# 5*7+7 + 7*7+7 + 7*3+3 = 122 parameters: not a multiple of 4 (nor of 3).
SIZES = [5, 7, 7, 3]


def serial_reference(make_model, make_opt, data, batch_size, epochs, seed=0,
                     schedule=None, max_grad_norm=None):
    """One process, whole global batch, the optimizer called directly (``reference``)."""
    model = make_model()
    x, y = data
    x = x.astype(model.params.dtype)
    run = train_serial(model, make_opt(), sampler_batches(x, y, batch_size, epochs, seed=seed),
                       max_grad_norm=max_grad_norm, schedule=schedule,
                       batch_context=hasattr(model, "set_batch_context"))
    return run.params, run.losses


def assert_close(actual, expected, rtol, what="parameters"):
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * 1e-2, err_msg=what)


@batch_splits(16)
@pytest.mark.parametrize("strategy", NAMES)
@pytest.mark.parametrize("opt_name", OPTIMIZERS)
def test_matches_serial_float64(strategy, opt_name):
    data = classification_data()
    make_model = functools.partial(MLP, SIZES, activation="tanh", dtype=np.float64, seed=7)
    ref, ref_losses = serial_reference(make_model, OPTIMIZERS[opt_name], data, 16, epochs=4)
    model = make_model()
    # Tiny buckets: every layer is its own bucket, and the overlap path is exercised
    # (pinned: DDP's default "auto" may choose the other).
    dist = build(strategy, OPTIMIZERS[opt_name](), ShardingConfiguration(MPI.COMM_WORLD),
                 bucket_mb=1e-4, overlap=True)
    result = dist.optimize(model, data, epochs=4, batch_size=16)
    assert result.steps == len(ref_losses) == 24
    assert_close(whole(dist), ref, 1e-10)
    assert_close(np.array(result.losses), ref_losses, 1e-10, "losses")
    assert not np.allclose(whole(dist), make_model().params)   # it did train
    dist.verify_in_sync()


@batch_splits(32)
@pytest.mark.parametrize("strategy", NAMES)
def test_matches_serial_float32(strategy):
    data = classification_data()
    make_model = functools.partial(MLP, SIZES, activation="relu", dtype=np.float32, seed=3)
    make_opt = OPTIMIZERS["adam"]
    ref, _ = serial_reference(make_model, make_opt, data, 32, epochs=1)
    model = make_model()
    dist = build(strategy, make_opt(), ShardingConfiguration(MPI.COMM_WORLD))
    dist.optimize(model, data, epochs=1, batch_size=32)
    assert_close(whole(dist), ref, 1e-5)


@batch_splits(32, micro_batches=2)
@pytest.mark.parametrize("strategy", NAMES)
@pytest.mark.parametrize("method", ["reduce_scatter", "allreduce"])
def test_accumulation_clipping_schedule(strategy, method):
    """Micro-batches, global-norm clipping and a cosine schedule together."""
    data = classification_data(n=128)
    make_model = functools.partial(MLP, SIZES, activation="gelu", dtype=np.float64, seed=5,
                                   layer_norm=True)
    make_opt = OPTIMIZERS["adamw"]
    schedule = CosineSchedule(total_steps=16, warmup_steps=3)
    ref, _ = serial_reference(make_model, make_opt, data, 32, epochs=4,
                              schedule=schedule, max_grad_norm=0.5)
    model = make_model()
    kw = {"reduce_method": method} if strategy in SHARDED else {}
    if strategy not in SHARDED and method == "allreduce":
        kw = {"overlap": False}   # the post-backward path of DDP
    dist = build(strategy, make_opt(), ShardingConfiguration(MPI.COMM_WORLD),
                 accumulation_steps=2, max_grad_norm=0.5, schedule=schedule,
                 bucket_mb=2e-4, **kw)
    dist.optimize(model, data, epochs=4, batch_size=32)
    assert_close(whole(dist), ref, 1e-10)
    assert dist.last_grad_norm > 0.5   # clipping really was active at the end


@batch_splits(32, micro_batches=2)   # two halves of each rank's rows
def test_ddp_no_sync_equals_accumulation():
    comm = MPI.COMM_WORLD
    data = classification_data(n=64)
    make_model = functools.partial(MLP, SIZES, dtype=np.float64, seed=2)
    ref, _ = serial_reference(make_model, OPTIMIZERS["sgd-nesterov"], data, 32, epochs=1)
    model = make_model()
    ddp = DDPOptimizer(OPTIMIZERS["sgd-nesterov"](), ShardingConfiguration(comm), model=model)
    sampler = ShardedSampler(64, 32, seed=0)
    x, y = data
    local = 32 // comm.size
    half = local // 2
    for _ in range(2):
        idx = sampler.batch_indices(comm.rank * local, (comm.rank + 1) * local)
        with ddp.no_sync():
            ddp.backward(x[idx[:half]], y[idx[:half]])
        ddp.backward(x[idx[half:]], y[idx[half:]])
        ddp.step()
        sampler.advance()
    assert_close(model.params, ref, 1e-10)


@batch_splits(16, micro_batches=2)
@pytest.mark.parametrize("strategy", NAMES)
def test_function_model(strategy):
    """A model that brings its own gradient: least squares, f -> (loss, grad)."""
    rng = np.random.default_rng(4)
    a_true = rng.standard_normal(11)
    x = rng.standard_normal((64, 11))
    y = x @ a_true + 0.01 * rng.standard_normal(64)

    def f(p, xb, yb):
        r = xb @ p - yb
        return float(r @ r / len(yb)), 2.0 * xb.T @ r / len(yb)

    def make_model():
        return FunctionModel(f, np.zeros(11))   # new parameters for each model

    ref, _ = serial_reference(make_model, OPTIMIZERS["adam"], (x, y), 16, epochs=3)
    model = make_model()
    dist = build(strategy, OPTIMIZERS["adam"](), ShardingConfiguration(MPI.COMM_WORLD),
                 accumulation_steps=2, bucket_mb=1e-5)
    dist.optimize(model, (x, y), epochs=3, batch_size=16)
    # A model without parameter hooks keeps its whole vector under every strategy
    # (ZeRO-3 trains it as ZeRO-2 does).
    assert model.params is not None
    assert_close(model.params, ref, 1e-10)


@batch_splits(16, micro_batches=2)
def test_dropout_split_invariant():
    """Dropout masks are drawn for the global batch, so any split gives the same run."""
    data = classification_data()
    make_model = functools.partial(MLP, SIZES, dtype=np.float64, seed=9, dropout=0.3)
    ref, _ = serial_reference(make_model, OPTIMIZERS["adam"], data, 16, epochs=2)
    model = make_model()
    dist = ZeRO2Optimizer(OPTIMIZERS["adam"](), ShardingConfiguration(MPI.COMM_WORLD),
                          accumulation_steps=2)
    dist.optimize(model, data, epochs=2, batch_size=16)
    assert_close(model.params, ref, 1e-10)


def test_sub_communicator():
    """A simulation owns COMM_WORLD; training runs on each half of it."""
    world = MPI.COMM_WORLD
    halves = {(world.size + 1) // 2, world.size // 2} - {0}
    if any(8 % h for h in halves):     # every rank skips alike, before the Split
        pytest.skip(f"its global batch of 8 rows does not split over halves of "
                    f"{sorted(halves)} ranks (a world of {world.size})")
    half = world.Split(color=world.rank % 2, key=world.rank)
    try:
        data = classification_data()
        make_model = functools.partial(MLP, SIZES, dtype=np.float64, seed=1)
        ref, _ = serial_reference(make_model, OPTIMIZERS["adam"], data, 8, epochs=1)
        model = make_model()
        dist = DDPOptimizer(OPTIMIZERS["adam"](), ShardingConfiguration(half))
        dist.optimize(model, data, epochs=1, batch_size=8)
        assert_close(model.params, ref, 1e-10)
        assert dist.dp.size == half.size
    finally:
        half.Free()


def test_zero2_memory_is_a_shard():
    comm = MPI.COMM_WORLD
    make_model = functools.partial(MLP, [32] + [64] * 8 + [4], dtype=np.float64, seed=0)
    data = (np.random.default_rng(0).standard_normal((64, 32)),
            np.zeros(64, dtype=np.int64))
    reports = {}
    for name in ("ddp", "zero2"):       # ZeRO-3's: test_zero3.py, what a rank holds
        model = make_model()
        dist = build(name, Adam(), ShardingConfiguration(comm), bucket_mb=0.05)
        dist.optimize(model, data, epochs=1, batch_size=8 * comm.size)
        reports[name] = dist.memory_report()
    n = make_model().params.size
    ddp, zero = reports["ddp"], reports["zero2"]
    shard_bytes = -(-n // comm.size) * 8
    # Summed before any assert (a collective): the shards hold the whole state once;
    # the last shard is the shortest where the ranks do not divide n.
    state_bytes = comm.allreduce(zero["optimizer_state"])
    assert ddp["gradients"] == n * 8 and ddp["optimizer_state"] == 2 * n * 8
    assert zero["optimizer_state"] <= 2 * shard_bytes
    assert state_bytes == 2 * n * 8
    # Gradients: the shard plus two bucket buffers (each at most one bucket, or
    # one layer when a layer is larger than the bucket).
    largest_layer = (64 * 64 + 64) * 8
    bucket = max(int(0.05 * 2**20), largest_layer)
    assert zero["gradients"] <= shard_bytes + 2 * bucket
    assert zero["peak"] >= zero["total"]
    if comm.size >= 4:
        assert zero["gradients"] < ddp["gradients"]


def test_bad_batch_size_raises_everywhere():
    comm = MPI.COMM_WORLD
    dist = DDPOptimizer(Adam(), ShardingConfiguration(comm), accumulation_steps=3)
    with pytest.raises(ValueError, match="does not split across"):
        dist.optimize(MLP(SIZES), classification_data(), epochs=1, batch_size=3 * comm.size + 1)


@pytest.mark.mpi(min_size=2)   # two ranks to differ
def test_mismatched_parameter_counts_raise_everywhere():
    comm = MPI.COMM_WORLD
    sizes = [5, 7 + (comm.rank == comm.size - 1), 3]
    with pytest.raises(MpiShardError, match="parameters differ between data-parallel ranks"):
        ZeRO2Optimizer(Adam(), ShardingConfiguration(comm), model=MLP(sizes))


def test_not_an_optimizer_or_bad_dtype():
    comm = MPI.COMM_WORLD
    with pytest.raises(TypeError, match="expecting a gradient optimizer"):
        DDPOptimizer("adam", ShardingConfiguration(comm))

    class HalfModel:
        layout = MLP(SIZES).layout
        params = np.zeros(layout.size, dtype=np.float16)
        grads = np.zeros(layout.size, dtype=np.float16)

        def forward(self, x):
            return x

        def forward_backward(self, x, y):
            return 0.0

    with pytest.raises(TypeError, match="float32 or float64, got float16"):
        DDPOptimizer(Adam(), ShardingConfiguration(comm), model=HalfModel())


def test_rank_dependent_problem_raises_on_every_rank():
    """Only the last rank passes a bad model; every rank raises, none hangs."""
    comm = MPI.COMM_WORLD
    model = MLP(SIZES) if comm.rank != comm.size - 1 else object()
    with pytest.raises(TypeError, match="expecting a model"):
        DDPOptimizer(Adam(), ShardingConfiguration(comm), model=model)


def test_verify_in_sync_detects_divergence():
    comm = MPI.COMM_WORLD
    model = MLP(SIZES, dtype=np.float64)
    ddp = DDPOptimizer(Adam(), ShardingConfiguration(comm), model=model)
    ddp.verify_in_sync()
    if comm.size == 1:
        return
    if comm.rank == 1:
        model.params[3] += 1e-12
    with pytest.raises(Exception, match="out of sync"):
        ddp.verify_in_sync()


def test_zero2_refuses_no_sync():
    model = MLP(SIZES)
    zero = ZeRO2Optimizer(Adam(), ShardingConfiguration(MPI.COMM_WORLD), model=model)
    x, y = classification_data(n=8)
    with pytest.raises(MpiShardError, match="no_sync"), zero.no_sync():
        zero.backward(x, y)


@batch_splits(16)
@pytest.mark.parametrize("second", NAMES)
def test_a_model_moves_between_strategies(second):
    """One model trained by ZeRO-2 (which binds its gradients to bucket buffers),
    then by each strategy: the run equals one process doing the same."""
    data = classification_data()
    make_model = functools.partial(MLP, SIZES, activation="tanh", dtype=np.float64, seed=7)
    ref, ref_losses = serial_reference(make_model, lambda: SGD(lr=0.05), data, 16, epochs=2)
    model = make_model()
    config = ShardingConfiguration(MPI.COMM_WORLD)
    first = ZeRO2Optimizer(SGD(lr=0.05), config, bucket_mb=1e-4)
    r1 = first.optimize(model, data, epochs=1, batch_size=16)
    assert model.grads is None            # ZeRO-2 holds the gradient storage now
    then = build(second, SGD(lr=0.05), config, bucket_mb=1e-4)
    then.step_count, then.data_position = first.step_count, dict(first.data_position)
    r2 = then.optimize(model, data, epochs=2, batch_size=16)   # the second epoch
    assert r1.steps == r2.steps == 6
    assert_close(whole(then), ref, 1e-10)
    assert_close(np.array(r1.losses + r2.losses), ref_losses, 1e-10, "losses")
