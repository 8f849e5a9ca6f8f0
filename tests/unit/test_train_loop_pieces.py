"""The pieces of the training loop without an MPI world: ``evaluate``, the dataset
protocol, the sampler's short batches and positions, ``StopRequest``.

Plain pytest (the loop against one process, under ``mpirun``:
``tests/mpi/test_train_loop.py``).
"""

from __future__ import annotations

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from mpishard.data import ArrayDataset, HDF5Dataset, ShardedSampler, rank_rows
from mpishard.nn import MLP
from mpishard.protocols import Dataset
from mpishard.train import StopRequest, evaluate

SIZES = [5, 7, 3]


def make_data(n=64, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 5))
    return x, np.argmax(x @ rng.standard_normal((5, 3)), axis=1)


def make_model(seed=3):
    return MLP(SIZES, activation="tanh", dtype=np.float64, seed=seed)


# --- evaluation ----------------------------------------------------------------------

def test_evaluate_is_the_loss_of_the_whole_set():
    x, y = make_data(n=45)
    model = make_model()
    logits = model.forward(x)
    shifted = logits - logits.max(axis=1, keepdims=True)
    expected = np.mean(np.log(np.exp(shifted).sum(axis=1)) - shifted[np.arange(45), y])
    assert evaluate(model, x, y) == pytest.approx(expected, rel=1e-12)
    assert evaluate(model, x, y, batch=7) == pytest.approx(expected, rel=1e-12)
    # Regression: the mean over every element, batches of unequal size weighted by it.
    reg = MLP([5, 4, 2], dtype=np.float64, seed=2, loss="mse")
    target = np.random.default_rng(5).standard_normal((45, 2))
    expected = np.mean((reg.forward(x) - target) ** 2)
    assert evaluate(reg, x, target, batch=8) == pytest.approx(expected, rel=1e-12)
    assert np.isnan(evaluate(reg, x[:0], target[:0]))


def test_evaluate_on_each_backend(xp):
    """No np.asarray on the model's output: a CuPy model evaluates on the device."""
    x, y = make_data(n=20)
    model = MLP(SIZES, activation="tanh", dtype=np.float64, seed=3, xp=xp)
    value = evaluate(model, xp.asarray(x), y, batch=6)
    assert isinstance(value, float)
    assert value == pytest.approx(evaluate(make_model(), x, y), rel=1e-10)


# --- the data layer ------------------------------------------------------------------

def test_dataset_protocol(tmp_path):
    x, y = make_data(n=10)
    path = tmp_path / "d.h5"
    with h5py.File(path, "w") as f:
        f["x"], f["y"] = x, x[:, :2]
    with HDF5Dataset(path, "/x", "/y", comm=MPI.COMM_SELF) as h5:
        assert isinstance(h5, Dataset)
    assert isinstance(ArrayDataset(x, y), Dataset)
    assert not isinstance((x, y), Dataset) and not isinstance(x, Dataset)


def test_sampler_short_batches_and_positions():
    s = ShardedSampler(10, 4, seed=2, drop_last=False)
    sizes = []
    while s.state.epoch == 0:
        sizes.append(s.current_batch_size())
        s.advance()
    assert sizes == [4, 4, 2] and s.batches_per_epoch == 3
    assert ShardedSampler(10, 4).batches_per_epoch == 2
    # A position restored at another batch size goes on from the same sample.
    a = ShardedSampler(48, 8, seed=1)
    a.advance()
    a.advance()
    b = ShardedSampler.from_position(a.position(), 12)
    assert np.array_equal(b.batch_indices(0, 12), a.order(0)[16:28])
    # With fewer samples left than a batch (drop_last), the next epoch begins.
    c = ShardedSampler.from_position({**a.position(), "samples_consumed": 40}, 12)
    assert (c.state.epoch, c.state.samples_consumed) == (1, 0)
    assert [rank_rows(3, 4, r) for r in range(4)] == [(0, 0), (0, 1), (1, 2), (2, 3)]
    assert [rank_rows(16, 4, r) for r in range(4)] == [(0, 4), (4, 8), (8, 12), (12, 16)]


def test_stop_request_outside_the_main_thread_only_requests():
    import threading

    seen = []

    def run():
        with StopRequest() as stop:
            seen.append(dict(stop._previous))
            stop.request("resize")
            seen.append(stop.received)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert seen == [{}, "resize"]
