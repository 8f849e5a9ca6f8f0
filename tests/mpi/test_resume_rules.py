"""Resume rules: ``epochs`` is a total everywhere, the data position wins, and an
argument that conflicts with it is reported once, on rank 0, saying what is used.

Each case compares the parameters with a run that never stopped (bit for bit,
same layout). Run under ``mpirun -n N`` for N = 1, 2, 4.
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
from mpi4py import MPI
from strategies import STRATEGIES
from worlds import batch_splits

from mpishard import ShardingConfiguration
from mpishard.checkpoint import load_checkpoint, save_checkpoint
from mpishard.data import DataPositionWarning
from mpishard.nn import MLP
from mpishard.optim import Adam
from mpishard.strategies import ElasticOptimizer

WORLD = MPI.COMM_WORLD
BATCH = 8


def data(n=48, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 5))
    return x, np.argmax(x @ rng.standard_normal((5, 3)), axis=1)


def make_model():
    return MLP([5, 7, 3], activation="tanh", dtype=np.float64, seed=3)


def make_strategy():
    return STRATEGIES["ddp"](Adam(lr=1e-2), ShardingConfiguration(WORLD))


def recorded(call):
    """``call()``'s result and the DataPositionWarnings it gave on this rank."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = call()
    return result, [str(w.message) for w in caught if w.category is DataPositionWarning]


def uninterrupted(epochs=2, **kw):
    model, opt = make_model(), make_strategy()
    opt.optimize(model, data(), epochs=epochs, batch_size=BATCH, **kw)
    return model.params.copy()


@pytest.mark.mpi
@pytest.mark.parametrize(("first", "then", "says"), [
    ({"seed": 1}, {"seed": 2}, "seed=2 differs from the data position's seed 1: the pass "
                               "goes on with seed 1"),
    ({"seed": 1, "shuffle": True}, {"seed": 1, "shuffle": False},
     "shuffle=False differs from the data position's shuffle=True: the pass goes on with "
     "shuffle=True"),
])
@batch_splits(BATCH)
def test_a_conflicting_seed_or_shuffle_warns_once_on_rank_0_and_the_position_wins(
        first, then, says):
    model, opt = make_model(), make_strategy()
    opt.optimize(model, data(), epochs=2, batch_size=BATCH, max_steps=3, **first)
    result, said = recorded(lambda: opt.optimize(model, data(), epochs=2,
                                                 batch_size=BATCH, **then))
    assert len(said) == (1 if WORLD.rank == 0 else 0), said
    assert all(says in s for s in said), said
    assert result.steps == 12 - 3
    np.testing.assert_array_equal(model.params, uninterrupted(**first))


@pytest.mark.mpi
@batch_splits(BATCH)
def test_another_batch_size_warns_and_is_used(mpi_tmp_path):
    path = os.path.join(str(mpi_tmp_path), "b.h5")
    model, opt = make_model(), make_strategy()
    opt.optimize(model, data(), epochs=2, batch_size=BATCH, max_steps=3)
    save_checkpoint(path, model, opt)
    model2, opt2 = make_model(), make_strategy()
    load_checkpoint(path, model2, opt2)
    result, said = recorded(lambda: opt2.optimize(model2, data(), epochs=2, batch_size=16))
    assert len(said) == (1 if WORLD.rank == 0 else 0), said
    assert all("batch_size=16 differs from the data position's global batch 8: training "
               "goes on with batch_size=16 from sample 24 of epoch 0" in s for s in said)
    # 24 samples left in epoch 0 (one batch of 16; the short rest is dropped), then 3.
    assert result.steps == 1 + 3
    assert opt2.data_position["batch_size"] == 16


@pytest.mark.mpi
@batch_splits(BATCH)
def test_no_argument_given_means_no_warning_and_the_restored_seed(mpi_tmp_path):
    """After load_checkpoint, optimize() without seed goes on with the file's seed 7
    silently; a position without the newer keys (an older file) is not compared."""
    path = os.path.join(str(mpi_tmp_path), "s.h5")
    model, opt = make_model(), make_strategy()
    opt.optimize(model, data(), epochs=2, batch_size=BATCH, max_steps=3, seed=7)
    save_checkpoint(path, model, opt)
    model2, opt2 = make_model(), make_strategy()
    load_checkpoint(path, model2, opt2)
    _, said = recorded(lambda: opt2.optimize(model2, data(), epochs=2, batch_size=BATCH))
    assert said == []
    np.testing.assert_array_equal(model2.params, uninterrupted(seed=7))

    old = make_strategy()
    old.data_position = {"epoch": 1, "samples_consumed": 16}   # seed etc. unknown
    model3 = make_model()
    result, said = recorded(lambda: old.optimize(model3, data(), epochs=2, batch_size=BATCH,
                                                 seed=3))
    assert said == [] and result.steps == 4
    assert old.data_position["seed"] == 3 and old.data_position["num_samples"] == 48


@pytest.mark.mpi
@batch_splits(BATCH)
@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_elastic_returns_on_a_stop_and_epochs_is_the_total(mpi_tmp_path, strategy):
    """A requested stop (what SIGUSR1 does) checkpoints and returns, without
    ending the process; exit_code says 75; the next optimize(epochs=2) resumes
    from the checkpoint and trains only what is left, bit for bit."""
    ckpt = os.path.join(str(mpi_tmp_path), f"elastic-{strategy}")
    pinned = {"reduce_method": "reduce_scatter"} if strategy == "zero2" else {}

    def elastic(**kw):
        return ElasticOptimizer(Adam(lr=1e-2), ShardingConfiguration(WORLD), 1, 8,
                                strategy=strategy, **pinned, **kw)

    whole_model, whole = make_model(), elastic()
    whole.optimize(whole_model, data(), epochs=2, batch_size=BATCH)

    def stopped_at_4(folder):
        model, opt = make_model(), elastic(checkpoint_dir=os.path.join(ckpt, folder))
        first = opt.optimize(model, data(), epochs=2, batch_size=BATCH,
                             callback=lambda step, loss: opt.request_stop() if step == 4
                             else None)
        assert first.stopped is not None and opt.exit_code == 75 and first.steps == 4
        return model, opt

    # A new optimizer (a relaunched job) resumes from the checkpoint.
    stopped_at_4("relaunched")
    model2, opt2 = make_model(), elastic(checkpoint_dir=os.path.join(ckpt, "relaunched"))
    rest = opt2.optimize(model2, data(), epochs=2, batch_size=BATCH)
    assert opt2.resumed_from is not None and opt2.exit_code == 0
    assert (rest.steps, rest.epochs, rest.stopped) == (12 - 4, 2, None)
    np.testing.assert_array_equal(model2.params, whole_model.params)
    again = opt2.optimize(model2, data(), epochs=2, batch_size=BATCH)
    assert again.steps == 0
    # The optimizer that stopped goes on too (its stop was consumed by the return).
    model, opt = stopped_at_4("same")
    same = opt.optimize(model, data(), epochs=2, batch_size=BATCH)
    assert (same.steps, same.stopped, opt.exit_code) == (12 - 4, None, 0)
    np.testing.assert_array_equal(model.params, whole_model.params)
