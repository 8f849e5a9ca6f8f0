"""What the training loop says and records across calls, against one NumPy process.

Run under ``mpirun -n N python -m pytest --with-mpi`` for N = 1, 2, 4.

* ``epochs`` is a total: a second ``optimize(epochs=3)`` trains nothing and says so
  once (rank 0), naming the epochs done and asked.
* The metrics file is appended to by a call that continues the data position and
  started anew otherwise; a run without validation writes ``"val_loss": null``,
  and every line parses with a strict JSON parser.
* ``nonfinite="skip"``: ``TrainResult.steps`` counts the updates, ``skipped_steps``
  the refused ones, ``losses`` both.
* A stream batch that is refused counts as read: ``BatchStream(..., first=k + 1)``
  (or the live iterator) goes on with the next one.
* Stream errors name ranks of ``MPI.COMM_WORLD``, with the group rank beside.
* NumPy integers are accepted where an int is (``unit_rows=np.int64(2)``, ...).
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
from mpi4py import MPI
from reference import sampler_batches, train_serial
from worlds import batch_splits

from mpishard import ShardingConfiguration
from mpishard.checkpoint import CheckpointManager
from mpishard.data import BatchStream, DataPositionWarning
from mpishard.nn import MLP, FunctionModel
from mpishard.optim import SGD, Adam
from mpishard.optim.schedules import CosineSchedule
from mpishard.strategies import DDPOptimizer, ZeRO2Optimizer

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD
BATCH = 16                    # splits over 1, 2 and 4 ranks (3: the tests skip)


def make_data(n=64, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 5))
    return x, np.argmax(x @ rng.standard_normal((5, 3)), axis=1)


def make_model():
    return MLP([5, 7, 3], activation="tanh", dtype=np.float64, seed=3)


def serial(data, epochs):
    """One process, Adam(lr=1e-2) on each whole global batch of the strategies' order."""
    return train_serial(make_model(), Adam(lr=1e-2), sampler_batches(*data, BATCH, epochs))


def strict(line):
    """``json.loads`` that refuses NaN and infinities (as strict parsers do)."""
    def refuse(name):
        raise ValueError(f"not strict JSON: {name}")

    return json.loads(line, parse_constant=refuse)


# --- epochs are a total ------------------------------------------------------------------

@batch_splits(BATCH)
def test_a_second_call_with_the_same_epochs_warns_once_and_trains_nothing():
    data = make_data()
    model = make_model()
    opt = DDPOptimizer(Adam(lr=1e-2), ShardingConfiguration(WORLD))
    first = opt.optimize(model, data, epochs=3, batch_size=BATCH)
    reference = serial(data, 3)
    np.testing.assert_allclose(model.params, reference.params, rtol=1e-10)
    np.testing.assert_allclose(first.losses, reference.losses, rtol=1e-10)
    before = model.params.copy()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = opt.optimize(model, data, epochs=3, batch_size=BATCH)
    said = [str(w.message) for w in caught if issubclass(w.category, DataPositionWarning)]
    if WORLD.rank == 0:
        assert said == ["optimize(): nothing to train: epochs=3 is a total and 3 epoch(s) are "
                        "complete already; pass a larger total (epochs=6 for 3 more) or call "
                        "new_pass() to start again at epoch 0"], said
    else:
        assert said == [], said
    assert (again.steps, again.losses, again.epochs) == (0, [], 3)
    np.testing.assert_array_equal(model.params, before)
    # The total that the warning suggests trains the three more epochs.
    more = opt.optimize(model, data, epochs=6, batch_size=BATCH)
    assert more.steps == 3 * len(data[0]) // BATCH
    np.testing.assert_allclose(model.params, serial(data, 6).params, rtol=1e-10)


# --- the metrics file ----------------------------------------------------------------------

def records(path, parse=json.loads):
    with open(path) as f:
        return [parse(line) for line in f]


@batch_splits(BATCH)
def test_metrics_are_appended_when_the_position_continues(mpi_tmp_path):
    data = make_data()
    path = str(mpi_tmp_path / "metrics.jsonl")
    model = make_model()
    opt = ZeRO2Optimizer(Adam(lr=1e-2), ShardingConfiguration(WORLD))
    options = dict(batch_size=BATCH, metrics_path=path, log_every=1)
    a = opt.optimize(model, data, epochs=1, **options)
    b = opt.optimize(model, data, epochs=2, **options)        # continues: appended
    WORLD.Barrier()
    got = records(path)
    steps = [r for r in got if r["event"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 9))
    np.testing.assert_allclose([r["loss"] for r in steps], a.losses + b.losses, rtol=1e-12)
    np.testing.assert_allclose(a.losses + b.losses, serial(data, 2).losses, rtol=1e-10)
    assert [r["step"] for r in got if r["event"] == "end"] == [4, 8]
    assert [r["epoch"] for r in got if r["event"] == "epoch"] == [1, 2]
    WORLD.Barrier()
    opt.new_pass()                                             # a new count: a new file
    c = opt.optimize(model, data, epochs=1, **options)
    WORLD.Barrier()
    got = records(path)
    assert [r["step"] for r in got if r["event"] == "step"] == list(range(9, 13))
    np.testing.assert_allclose([r["loss"] for r in got if r["event"] == "step"], c.losses,
                               rtol=1e-12)


@batch_splits(BATCH)
@pytest.mark.parametrize("validation", [False, True])
def test_metrics_are_strict_json_with_null_for_no_validation(mpi_tmp_path, validation):
    """Without validation data ``val_loss`` is null (NaN is not JSON); with it, the
    number the result holds."""
    data = make_data()
    path = str(mpi_tmp_path / "metrics.jsonl")
    opt = DDPOptimizer(Adam(lr=1e-2), ShardingConfiguration(WORLD))
    result = opt.optimize(make_model(), data, epochs=1, batch_size=BATCH, metrics_path=path,
                          validation=make_data(16, seed=7) if validation else None)
    WORLD.Barrier()
    end = [r for r in records(path, strict) if r["event"] == "end"]
    assert len(end) == 1
    if validation:
        assert np.isfinite(result.val_loss) and end[0]["val_loss"] == result.val_loss
    else:
        assert np.isnan(result.val_loss) and end[0]["val_loss"] is None


# --- nonfinite="skip" ----------------------------------------------------------------------

MARK = 1234.5


def least_squares(p, x, y):
    r = x @ p - y
    grad = 2.0 * x.T @ r / len(y)
    if np.any(x[:, 0] == MARK):
        grad[0] = np.nan
    return float(r @ r / len(y)), grad


@batch_splits(BATCH)
def test_skipped_steps_are_not_counted_as_steps():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((64, 3))
    y = x @ np.array([1.0, -2.0, 0.5])
    x[BATCH + 3, 0] = MARK                       # a row of the second batch
    start = np.array([0.1, 0.2, 0.3])
    opt = DDPOptimizer(SGD(lr=0.05), ShardingConfiguration(WORLD), nonfinite="skip")
    model = FunctionModel(least_squares, start.copy())
    result = opt.optimize(model, (x, y), epochs=1, batch_size=BATCH, shuffle=False)
    assert result.steps == opt.step_count == 3       # the updates, not the 4 batches
    assert (result.skipped_steps, opt.skipped_steps, len(result.losses)) == (1, 1, 4)
    p, losses = start.copy(), []
    for k in range(4):                            # one process, the second batch left out
        loss, grad = least_squares(p, x[k * BATCH:(k + 1) * BATCH], y[k * BATCH:(k + 1) * BATCH])
        losses.append(loss)
        if k != 1:
            p = p - 0.05 * grad
    np.testing.assert_allclose(model.params, p, rtol=1e-12)
    np.testing.assert_allclose(result.losses, losses, rtol=1e-12)


# --- a refused stream batch ---------------------------------------------------------------

def batches(rows=(8, 8, 5, 8, 8), seed=2):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((5, 3))
    out = []
    for n in rows:
        a = rng.standard_normal((n, 5))
        out.append((a, np.argmax(a @ w, axis=1)))
    return out


def serial_stream(items):
    return train_serial(make_model(), Adam(lr=1e-2), items).params


@pytest.mark.parametrize("resume", ["first", "live"])
def test_a_refused_stream_batch_counts_as_read(resume):
    """Batch 2 has 5 rows where batch_size=8 is asked: refused after 2 steps. The
    position is then 3, the caller's iterator is at 3, and either a new stream
    numbered from 3 or the live iterator goes on: batches 0, 1, 3, 4 trained."""
    items = batches()
    live = iter(items)
    model = make_model()
    opt = DDPOptimizer(Adam(lr=1e-2), ShardingConfiguration(WORLD))
    with pytest.raises(ValueError, match="stream batch 2: the global batch has 5 rows, "
                                         "expecting batch_size=8"):
        opt.optimize(model, BatchStream(live), batch_size=8)
    assert opt.data_position["batches"] == 3 and opt.data_position["samples_consumed"] == 16
    stream = BatchStream(iter(items[3:]), first=3) if resume == "first" else BatchStream(live)
    result = opt.optimize(model, stream, batch_size=8)
    assert (result.steps, result.stopped, opt.data_position["batches"]) == (2, "exhausted", 5)
    np.testing.assert_allclose(model.params, serial_stream([items[k] for k in (0, 1, 3, 4)]),
                               rtol=1e-10)


@pytest.mark.mpi(min_size=2)
def test_stream_errors_name_world_ranks_with_the_group_rank_beside():
    """The library trains on a communicator whose order is the reverse of
    MPI.COMM_WORLD's: the rank whose stream ends early is named by its world rank."""
    size = WORLD.size
    reverse = WORLD.Split(0, key=size - 1 - WORLD.rank)
    config = ShardingConfiguration(reverse)
    items = batches(rows=(8, 8, 8))
    early = size - 1                                  # its rank 0 in the group

    def stream():
        yield from items[:1 if WORLD.rank == early else 3]

    with pytest.raises(ValueError) as info:
        DDPOptimizer(Adam(lr=1e-2), config).optimize(make_model(), BatchStream(stream()))
    others = ", ".join(f"world rank {w} (rank {size - 1 - w} of the training group)"
                       for w in range(size - 2, -1, -1))
    assert (f"stream batch 1: the stream ended on world rank {early} (rank 0 of the training "
            f"group) but yielded a batch on {others}") in str(info.value)
    config.free()
    reverse.Free()


# --- NumPy integers --------------------------------------------------------------------------

@batch_splits(BATCH, micro_batches=2)
def test_numpy_integers_are_accepted_wherever_an_int_is(mpi_tmp_path):
    """The same run with NumPy integers and with Python ints: the same bits."""
    if (BATCH // 2) % (WORLD.size * 2):
        pytest.skip(f"the {BATCH // 2} units of 2 rows do not split over {WORLD.size} ranks "
                    f"x 2 accumulation steps")
    data = make_data()
    finals = []
    for kind in (int, np.int64):
        config = ShardingConfiguration(WORLD, tensor_parallel_size=kind(1),
                                       data_parallel_size=kind(-1), reproducible=True,
                                       unit_rows=kind(2))
        schedule = CosineSchedule(total_steps=kind(8), warmup_steps=kind(2))
        model = make_model()
        opt = ZeRO2Optimizer(Adam(lr=1e-2), config, accumulation_steps=kind(2),
                             schedule=schedule)
        folder = mpi_tmp_path / f"ckpt-{kind.__name__}"
        opt.optimize(model, data, epochs=kind(2), batch_size=kind(BATCH), seed=kind(3),
                     checkpoints=CheckpointManager(folder, keep=kind(1)),
                     checkpoint_every=kind(3))
        WORLD.Barrier()
        assert len(list(folder.iterdir())) == 1
        finals.append(model.params.copy())
        assert config.unit_rows == 2 and type(config.unit_rows) is int
    np.testing.assert_array_equal(finals[0], finals[1])
