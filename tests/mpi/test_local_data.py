"""Rank-local data (:class:`mpishard.data.LocalDataset`) against one process on the union.

Each rank holds its own rows (sizes differ, zero included); training must equal
one process training on the concatenation of the ranks' rows in rank order
(float64, rtol 1e-10), and only the rows a batch needs move. Run under
``mpirun -n N python -m pytest --with-mpi`` for N = 1, 2, 4; the 3-rank case
starts its own ``mpirun`` (``tests/jobs/test_three_ranks.py``).
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI
from reference import sampler_batches, train_serial
from strategies import STRATEGIES
from worlds import batch_splits, world_multiple_of

from mpishard import ShardingConfiguration
from mpishard.data import LocalDataset, ShardedSampler, rank_rows
from mpishard.nn import MLP
from mpishard.optim import Adam

WORLD = MPI.COMM_WORLD
SIZES = [5, 7, 3]
BATCH = 12           # splits over 1, 2, 3 and 4 ranks
TOTAL = 70


def union(total=TOTAL, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((total, 5))
    return x, np.argmax(x @ rng.standard_normal((5, 3)), axis=1)


def blocks(total, ranks):
    """Unequal blocks in rank order: rank 1 holds nothing, the last holds the most."""
    weights = np.array([(r + 1) * (r != 1) for r in range(ranks)], dtype=float)
    if weights.sum() == 0:
        weights[:] = 1
    cuts = np.round(np.cumsum(weights) / weights.sum() * total).astype(int)
    starts = np.concatenate(([0], cuts[:-1]))
    return [(int(a), int(b)) for a, b in zip(starts, cuts)]


def serial_reference(x, y, epochs, batch=BATCH):
    """One process on the union: the optimizer called on each whole global batch
    (``reference``)."""
    run = train_serial(MLP(SIZES, activation="tanh", dtype=np.float64, seed=3), Adam(lr=1e-2),
                       sampler_batches(x, y, batch, epochs))
    return run.params, run.losses


@pytest.mark.mpi
@batch_splits(BATCH)
@pytest.mark.parametrize("name", ["ddp", "zero2-reduce_scatter"])
def test_local_rows_train_like_one_process_on_the_union(name):
    x, y = union()
    lo, hi = blocks(TOTAL, WORLD.size)[WORLD.rank]
    config = ShardingConfiguration(WORLD)
    data = LocalDataset(x[lo:hi].copy(), y[lo:hi].copy(), config)
    assert len(data) == TOTAL and data.start == lo
    model = MLP(SIZES, activation="tanh", dtype=np.float64, seed=3)
    strategy = STRATEGIES[name](Adam(lr=1e-2), config)
    result = strategy.optimize(model, data, epochs=2, batch_size=BATCH)
    ref_params, ref_losses = serial_reference(x, y, epochs=2)
    np.testing.assert_allclose(model.params, ref_params, rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(result.losses, ref_losses, rtol=1e-10)
    # Only what the batches needed moved: each rank received exactly the rows of
    # its parts it does not hold, and the ranks together sent what they received.
    sampler = ShardedSampler(TOTAL, BATCH, seed=0)
    a, b = rank_rows(BATCH, WORLD.size, WORLD.rank)
    expected = 0
    while sampler.state.epoch < 2:
        mine = sampler.batch_indices(a, b)
        expected += int(np.count_nonzero((mine < lo) | (mine >= hi)))
        sampler.advance()
    assert data.rows_received == expected
    assert WORLD.allreduce(data.rows_sent) == WORLD.allreduce(data.rows_received)


@pytest.mark.mpi
@batch_splits(BATCH)
def test_blocks_placed_by_start_in_any_rank_order():
    """``start=`` puts rank r's block anywhere: reversed blocks, same union."""
    x, y = union()
    parts = blocks(TOTAL, WORLD.size)[::-1]
    lo, hi = parts[WORLD.rank]
    config = ShardingConfiguration(WORLD)
    data = LocalDataset(x[lo:hi], y[lo:hi], config, start=lo)
    probe = np.arange(TOTAL)
    expect = np.empty(TOTAL, dtype=np.int64)
    for r, (a, b) in enumerate(parts):
        expect[a:b] = r
    np.testing.assert_array_equal(data.holders(probe), expect)
    model = MLP(SIZES, activation="tanh", dtype=np.float64, seed=3)
    STRATEGIES["ddp"](Adam(lr=1e-2), config).optimize(model, data, epochs=1,
                                                      batch_size=BATCH)
    ref_params, _ = serial_reference(x, y, epochs=1)
    np.testing.assert_allclose(model.params, ref_params, rtol=1e-10, atol=1e-13)


@pytest.mark.mpi(min_size=2)
def test_bad_layouts_are_errors_on_every_rank():
    config = ShardingConfiguration(WORLD)
    x, y = union()
    with pytest.raises(ValueError, match="holds rows of shape"):
        LocalDataset(x[:4, :WORLD.rank + 2], y[:4], config)
    with pytest.raises(ValueError, match="do not tile the union"):
        LocalDataset(x[:4], y[:4], config, start=0)   # every block at 0
    with pytest.raises(ValueError, match="inputs have 4 samples but targets have 3"):
        LocalDataset(x[:4], y[:4 - (WORLD.rank == 1)], config)


@pytest.mark.mpi(min_size=2)
@world_multiple_of(2, "tensor_parallel_size 2")
def test_tensor_parallel_peers_must_hold_the_same_rows():
    config = ShardingConfiguration(WORLD, tensor_parallel_size=2)
    x, y = union()
    dp_rank = config.groups.dp.rank
    same = LocalDataset(x[10 * dp_rank:10 * dp_rank + 10], y[10 * dp_rank:10 * dp_rank + 10],
                        config)
    assert len(same) == 10 * config.groups.dp.size
    with pytest.raises(ValueError, match="must hold the same rows"):
        LocalDataset(x[:10] + WORLD.rank, y[:10], config)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_model_parallel_replicas_train_like_one_process(tp, pp):
    """tp=2 or pp=2: the tensor or pipeline peers of each data-parallel rank hold
    that rank's block."""
    from reference import assert_shards_match
    from test_hybrid import make_opt, mlp_data, mlp_factory
    from test_hybrid import serial_reference as hybrid_reference

    from mpishard.strategies import HybridShardedModel, HybridShardedOptimizer

    if WORLD.size % 2:
        pytest.skip("a model-parallel size of 2 needs an even world")
    dp_size = WORLD.size // (tp * pp)
    if 16 % (dp_size * pp):
        pytest.skip(f"16 rows do not split into {dp_size} data-parallel ranks x {pp} "
                    f"micro-batch(es)")
    x, y = mlp_data()
    config = ShardingConfiguration(WORLD, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    lo, hi = blocks(len(x), config.groups.dp.size)[config.groups.dp.rank]
    model = HybridShardedModel(mlp_factory(), config, micro_batches=pp)
    opt = HybridShardedOptimizer(make_opt(), config, data_parallel="ddp", model=model)
    result = opt.optimize(model, LocalDataset(x[lo:hi], y[lo:hi], config), epochs=2,
                          batch_size=16)
    serial, ref_losses = hybrid_reference(mlp_factory, (x, y), 16, 2, make_opt)
    np.testing.assert_allclose(result.losses, ref_losses, rtol=1e-10)
    assert_shards_match(model, serial)


@pytest.mark.mpi
@batch_splits(BATCH)
def test_local_rows_may_change_between_epochs_only():
    """New rows join at an epoch boundary (the next epoch shuffles the new union);
    in the middle of an epoch they would shift the indices: an error everywhere."""
    x, y = union(total=96)
    config = ShardingConfiguration(WORLD)
    old = blocks(48, WORLD.size)[WORLD.rank]
    new = blocks(48, WORLD.size)[WORLD.rank]
    model = MLP(SIZES, activation="tanh", dtype=np.float64, seed=3)
    opt = STRATEGIES["ddp"](Adam(lr=1e-2), config)
    # The union at first: x[:48]; later each rank also holds its block of x[48:].
    first = LocalDataset(x[old[0]:old[1]], y[old[0]:old[1]], config)
    opt.optimize(model, first, epochs=1, batch_size=BATCH, max_steps=2)
    grown_x = np.concatenate([x[old[0]:old[1]], x[48 + new[0]:48 + new[1]]])
    grown_y = np.concatenate([y[old[0]:old[1]], y[48 + new[0]:48 + new[1]]])
    grown = LocalDataset(grown_x, grown_y, config)
    with pytest.raises(ValueError, match="changed from 48 to 96 samples in the middle"):
        opt.optimize(model, grown, epochs=2, batch_size=BATCH)
    opt.optimize(model, first, epochs=1, batch_size=BATCH)      # the epoch ends on its rows
    result = opt.optimize(model, grown, epochs=2, batch_size=BATCH)
    assert result.steps == 96 // BATCH and opt.data_position["num_samples"] == 96
    # The same as one process: epoch 0 on the first union, epoch 1 on the grown one.
    # The grown union is rank 0's old and new rows, then rank 1's, ...
    grown_order = np.concatenate([np.r_[a:b, 48 + a:48 + b] for a, b in blocks(48, WORLD.size)])

    def batches():
        for epoch, order in ((0, np.arange(48)), (1, grown_order)):
            perm = order[np.random.default_rng([0, epoch]).permutation(len(order))]
            for b in range(len(order) // BATCH):
                idx = perm[b * BATCH:(b + 1) * BATCH]
                yield x[idx], y[idx]

    ref = train_serial(MLP(SIZES, activation="tanh", dtype=np.float64, seed=3), Adam(lr=1e-2),
                       batches()).model
    np.testing.assert_allclose(model.params, ref.params, rtol=1e-10, atol=1e-13)


@pytest.mark.mpi
@batch_splits(BATCH)
def test_short_last_batch_and_another_group_is_an_error():
    """drop_last=False: the short last batch (70 = 5 x 12 + 10) splits unevenly and
    still equals one process; a LocalDataset built over another configuration's
    group is refused on every rank."""
    x, y = union()
    lo, hi = blocks(TOTAL, WORLD.size)[WORLD.rank]
    config = ShardingConfiguration(WORLD)
    data = LocalDataset(x[lo:hi], y[lo:hi], config)
    model = MLP(SIZES, activation="tanh", dtype=np.float64, seed=3)
    result = STRATEGIES["ddp"](Adam(lr=1e-2), config).optimize(
        model, data, epochs=1, batch_size=BATCH, drop_last=False)
    ref, losses, _ = train_serial(MLP(SIZES, activation="tanh", dtype=np.float64, seed=3),
                                  Adam(lr=1e-2), sampler_batches(x, y, BATCH, 1, drop_last=False))
    assert len(losses) == 6
    np.testing.assert_allclose(result.losses, losses, rtol=1e-10)
    np.testing.assert_allclose(model.params, ref.params, rtol=1e-10, atol=1e-13)
    other = STRATEGIES["ddp"](Adam(lr=1e-2), ShardingConfiguration(WORLD))
    with pytest.raises(ValueError, match="exchanges rows over the data-parallel group, but"):
        other.optimize(MLP(SIZES, seed=3), data, epochs=1, batch_size=BATCH)
