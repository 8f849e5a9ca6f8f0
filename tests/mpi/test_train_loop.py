"""The one training loop (:mod:`mpishard.train`) against one process on the global batch.

Run under ``mpirun -n N python -m pytest --with-mpi`` for N = 1, 2, 4 (the
pieces without MPI: ``tests/unit/test_train_loop_pieces.py``). Each MPI test computes its
reference in the same test: a serial loop that calls the optimizer directly on
each whole global batch (float64, rtol 1e-10), or the same training run
without interruption (bit for bit, same layout).
"""

from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest
from mpi4py import MPI
from reference import sampler_batches, train_serial
from worlds import batch_splits, world_multiple_of

from mpishard import ShardingConfiguration
from mpishard.nn import MLP
from mpishard.optim import Adam
from mpishard.strategies import DDPOptimizer, ZeRO2Optimizer
from mpishard.train import StopRequest, TrainResult, evaluate, run_training

WORLD = MPI.COMM_WORLD
STRATEGIES = {"ddp": DDPOptimizer, "zero2": ZeRO2Optimizer}
SIZES = [5, 7, 3]
BATCH = 16                    # splits over 1, 2 and 4 ranks


def make_data(n=64, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 5))
    return x, np.argmax(x @ rng.standard_normal((5, 3)), axis=1)


def make_model(seed=3):
    return MLP(SIZES, activation="tanh", dtype=np.float64, seed=seed)


def make_strategy(name, comm=WORLD, **kw):
    return STRATEGIES[name](Adam(lr=1e-2), ShardingConfiguration(comm), **kw)


def serial_reference(data, epochs, batch=BATCH, drop_last=True):
    """One process: the optimizer called directly on each whole global batch
    (``reference``)."""
    x, y = data
    run = train_serial(make_model(), Adam(lr=1e-2),
                       sampler_batches(x, y, batch, epochs, drop_last=drop_last))
    return run.params, run.losses


# --- against one process -------------------------------------------------------------

@pytest.mark.mpi
@batch_splits(BATCH)
@pytest.mark.parametrize("name", STRATEGIES)
def test_optimize_matches_serial_and_reports_the_run(name):
    data = make_data()
    ref_params, ref_losses = serial_reference(data, epochs=3)
    model, strategy = make_model(), make_strategy(name)
    result = strategy.optimize(model, data, epochs=3, batch_size=BATCH)
    assert isinstance(result, TrainResult)
    np.testing.assert_allclose(model.params, ref_params, rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(result.losses, ref_losses, rtol=1e-10)
    assert (result.steps, result.epochs, result.samples, result.stopped) == (12, 3, 192, None)
    assert (result.first_step, result.last_step) == (0, 12)
    assert result.final_loss == result.losses[-1]
    assert result.seconds > 0 and result.samples_per_second == result.samples / result.seconds
    assert strategy.data_position == {"epoch": 3, "samples_consumed": 0, "seed": 0,
                                      "batch_size": BATCH, "num_samples": 64, "shuffle": 1}
    strategy.verify_in_sync()


@pytest.mark.mpi
@batch_splits(BATCH)
@pytest.mark.parametrize("name", STRATEGIES)
def test_epochs_is_the_total_and_a_stop_resumes_exactly(name):
    """optimize(epochs=E) trains until E epochs are complete in total: a second
    call after a stop (here: the callback's) does only the rest, bit for bit."""
    data = make_data()
    whole_model, whole = make_model(), make_strategy(name)
    whole_losses = whole.optimize(whole_model, data, epochs=3, batch_size=BATCH).losses

    model, strategy = make_model(), make_strategy(name)
    first = strategy.optimize(model, data, epochs=3, batch_size=BATCH,
                              callback=lambda step, loss: step == 6)
    assert (first.stopped, first.steps, first.epochs) == ("callback", 6, 1)
    assert strategy.data_position["epoch"] == 1
    assert strategy.data_position["samples_consumed"] == 2 * BATCH
    rest = strategy.optimize(model, data, epochs=3, batch_size=BATCH)
    assert (rest.stopped, rest.steps, rest.first_step, rest.epochs) == (None, 6, 6, 3)
    np.testing.assert_array_equal(first.losses + rest.losses, whole_losses)
    np.testing.assert_array_equal(model.params, whole_model.params)
    again = strategy.optimize(model, data, epochs=3, batch_size=BATCH)
    assert (again.steps, again.losses, again.epochs) == (0, [], 3)
    np.testing.assert_array_equal(model.params, whole_model.params)


@pytest.mark.mpi
@batch_splits(BATCH)
def test_drop_last_false_trains_the_short_batch():
    """52 samples, batch 16: three full batches and one of 4 rows an epoch (4 rows
    split evenly over 1, 2 and 4 ranks)."""
    data = make_data(n=52)
    ref_params, ref_losses = serial_reference(data, epochs=2, drop_last=False)
    model, strategy = make_model(), make_strategy("zero2")
    result = strategy.optimize(model, data, epochs=2, batch_size=BATCH, drop_last=False)
    assert (result.steps, result.samples) == (8, 104)
    np.testing.assert_allclose(result.losses, ref_losses, rtol=1e-10)
    np.testing.assert_allclose(model.params, ref_params, rtol=1e-10, atol=1e-13)
    dropped = make_strategy("zero2")
    assert dropped.optimize(make_model(), data, epochs=2, batch_size=BATCH).steps == 6


@pytest.mark.mpi(min_size=2)
@batch_splits(BATCH)
def test_drop_last_false_with_unequal_rows_per_rank():
    """A short batch of 3 rows on 2 or 4 ranks: the ranks hold different row counts
    (zero included at 4); the step is still the mean over the 3 rows."""
    strategy = make_strategy("ddp")
    data = make_data(n=51)
    ref_params, ref_losses = serial_reference(data, epochs=2, drop_last=False)
    model = make_model()
    result = strategy.optimize(model, data, epochs=2, batch_size=BATCH, drop_last=False)
    np.testing.assert_allclose(result.losses, ref_losses, rtol=1e-10)
    np.testing.assert_allclose(model.params, ref_params, rtol=1e-10, atol=1e-13)


@pytest.mark.mpi
@batch_splits(BATCH)
def test_any_ranks_signal_stops_every_rank_after_the_same_step():
    data = make_data()
    model, strategy = make_model(), make_strategy("ddp")
    last = WORLD.size - 1

    def callback(step, loss):
        if step == 3 and WORLD.rank == last:
            os.kill(os.getpid(), signal.SIGUSR1)   # only this rank gets the signal

    with StopRequest() as stop:
        result = strategy.optimize(model, data, epochs=3, batch_size=BATCH, callback=callback,
                                   stop=stop)
    assert (result.stopped, result.steps, strategy.step_count) == ("SIGUSR1", 3, 3)
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL   # handlers restored
    # A request (what ElasticOptimizer.request_stop does), and a callback's True on
    # one rank only: with a StopRequest either stops every rank.
    stop = StopRequest()
    if WORLD.rank == 0:
        stop.request("resize")
    result = strategy.optimize(model, data, epochs=3, batch_size=BATCH, stop=stop)
    assert (result.stopped, result.steps) == ("resize", 1)
    result = strategy.optimize(model, data, epochs=3, batch_size=BATCH, stop=StopRequest(),
                               callback=lambda step, loss: WORLD.rank == last and step == 6)
    assert (result.stopped, result.last_step) == ("callback", 6)


@pytest.mark.mpi
@batch_splits(BATCH)
def test_checkpoint_cadence_max_steps_and_metrics(mpi_tmp_path):
    from mpishard.checkpoint import CheckpointManager, load_checkpoint

    folder = os.path.join(str(mpi_tmp_path), "ckpt")
    metrics = os.path.join(str(mpi_tmp_path), "metrics.jsonl")
    data = make_data()
    valid = make_data(n=20, seed=9)
    model, strategy = make_model(), make_strategy("zero2")
    manager = CheckpointManager(folder, keep=10)
    result = run_training(strategy, model, data, 3, BATCH, checkpoints=manager,
                          checkpoint_every=3, max_steps=7, metrics_path=metrics, log_every=2,
                          validation=valid, start_record={"run": "t"})
    assert (result.stopped, result.steps) == ("max_steps", 7)
    # Every 3 steps, and at the stop.
    assert [s for s, _ in manager.checkpoints()] == [3, 6, 7]
    assert result.checkpoint == manager.latest()
    # The loop shares the rows out over the data-parallel group: the same value as
    # every row on every rank, up to the order of the sums.
    assert result.val_loss == evaluate(model, *valid, group=strategy.dp)
    assert result.val_loss == pytest.approx(evaluate(model, *valid), rel=1e-13)
    if WORLD.rank == 0:
        with open(metrics) as f:
            events = [json.loads(line) for line in f]
        kinds = [e["event"] for e in events]
        assert kinds[0] == "start" and kinds[-1] == "end"
        assert [e["step"] for e in events if e["event"] == "step"] == [2, 4, 6]
        assert [e["step"] for e in events if e["event"] == "checkpoint"] == [3, 6, 7]
        epoch = [e for e in events if e["event"] == "epoch"]
        assert [e["epoch"] for e in epoch] == [1]
        assert epoch[0]["loss"] == pytest.approx(np.mean(result.losses[:4]), rel=1e-12)
        assert events[-1]["final_loss"] == result.losses[-1]
    # The checkpoint at the stop holds the data position; a fresh strategy goes on
    # from it to the end, and equals the run that never stopped.
    fresh, resumed = make_model(seed=11), make_strategy("ddp")
    load_checkpoint(manager.latest(), fresh, resumed)
    assert resumed.data_position["epoch"] == 1
    assert resumed.data_position["samples_consumed"] == 3 * BATCH
    rest = resumed.optimize(fresh, data, epochs=3, batch_size=BATCH)
    assert rest.steps == 5
    whole_model = make_model()
    make_strategy("zero2").optimize(whole_model, data, epochs=3, batch_size=BATCH)
    np.testing.assert_allclose(fresh.params, whole_model.params, rtol=1e-10, atol=1e-13)
    WORLD.Barrier()


@pytest.mark.mpi
@batch_splits(BATCH)
def test_bad_batch_and_changed_data_are_errors_on_every_rank():
    model, strategy = make_model(), make_strategy("ddp")
    with pytest.raises(ValueError, match="larger than the dataset"):
        strategy.optimize(model, make_data(n=8 * WORLD.size), epochs=1,
                          batch_size=16 * WORLD.size)
    strategy.optimize(model, make_data(), epochs=1, batch_size=BATCH)
    with pytest.raises(ValueError, match="the data has 32 samples but the data position"):
        strategy.optimize(model, make_data(n=32), epochs=2, batch_size=BATCH)


# --- evaluation ----------------------------------------------------------------------

@pytest.mark.mpi(min_size=2)
@world_multiple_of(2, "tensor_parallel_size 2")
def test_evaluate_a_tensor_parallel_model_equals_the_serial_one():
    import functools

    from mpishard.nn import ParallelMLP
    from mpishard.strategies import HybridShardedModel

    config = ShardingConfiguration(WORLD, tensor_parallel_size=2)
    factory = functools.partial(ParallelMLP, [5, 8, 3], activation="tanh", dtype=np.float64,
                                seed=4)
    sharded = HybridShardedModel(factory, config)
    serial = factory()
    x, y = make_data(n=30)
    assert evaluate(sharded, x, y, batch=8) == pytest.approx(evaluate(serial, x, y), rel=1e-12)
