"""Streaming: data that grows between ``optimize()`` calls, against one NumPy process.

The rule under test (:mod:`mpishard.data.sampler`): each epoch covers the samples
present when it starts, shuffled by ``(seed, epoch)``; an epoch in progress
finishes over the samples it started with. ``new_pass()`` starts again at epoch
0. The reference is a plain NumPy loop that applies the rule itself (its own
permutations, not the library's sampler), float64, rtol 1e-10; a restore from a
checkpoint in the middle of it continues bit for bit. Run under ``mpirun -n N``
for N = 1, 2, 4 (the datasets alone: ``tests/unit/test_streaming_dataset.py``).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from mpi4py import MPI
from reference import train_serial
from strategies import STRATEGIES
from worlds import batch_splits

from mpishard import ShardingConfiguration
from mpishard.checkpoint import load_checkpoint, save_checkpoint
from mpishard.data import StreamingDataset
from mpishard.nn import MLP
from mpishard.optim import Adam

WORLD = MPI.COMM_WORLD
SIZES = [5, 7, 3]
BATCH = 8            # splits over 1, 2 and 4 ranks


def stream(total=96, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((total, 5))
    return x, np.argmax(x @ rng.standard_normal((5, 3)), axis=1)


def make_model():
    return MLP(SIZES, activation="tanh", dtype=np.float64, seed=3)


def reference(x, y, epochs):
    """One process: ``epochs`` is a list of (seed, epoch, samples present at its start);
    the batches cut from its own permutations, trained by ``reference.train_serial``."""
    def batches():
        for seed, epoch, n in epochs:
            order = np.random.default_rng([seed, epoch]).permutation(n)
            for b in range(n // BATCH):
                idx = order[b * BATCH:(b + 1) * BATCH]
                yield x[idx], y[idx]

    run = train_serial(make_model(), Adam(lr=1e-2), batches())
    return run.params, run.losses


@pytest.mark.mpi
@batch_splits(BATCH)
@pytest.mark.parametrize("kind", ["StreamingDataset", "arrays"])
@pytest.mark.parametrize("name", ["ddp", "zero2-reduce_scatter"])
def test_growing_data_trains_each_epoch_on_what_it_started_with(name, kind):
    x, y = stream()
    data = StreamingDataset(x[:40], y[:40])

    def grow_to(n):
        nonlocal data
        if kind == "StreamingDataset":
            data.append(x[len(data):n], y[len(data):n])
        else:
            data = (x[:n], y[:n])

    if kind == "arrays":
        data = (x[:40], y[:40])
    model, opt = make_model(), STRATEGIES[name](Adam(lr=1e-2), ShardingConfiguration(WORLD))
    losses = opt.optimize(model, data, epochs=1, batch_size=BATCH).losses      # 40 samples
    grow_to(64)
    losses += opt.optimize(model, data, epochs=2, batch_size=BATCH).losses     # 64
    # Stop 3 steps into epoch 2; 32 samples arrive; epoch 2 still covers 64.
    losses += opt.optimize(model, data, epochs=3, batch_size=BATCH,
                           max_steps=opt.step_count + 3).losses
    assert opt.data_position["num_samples"] == 64
    grow_to(96)
    rest = opt.optimize(model, data, epochs=4, batch_size=BATCH)
    losses += rest.losses
    assert (rest.steps, rest.epochs) == (5 + 12, 4)
    assert opt.data_position == {"epoch": 4, "samples_consumed": 0, "seed": 0,
                                 "batch_size": BATCH, "num_samples": 96, "shuffle": 1}
    # A new pass: epoch 0 again, over everything, with its own seed.
    opt.new_pass()
    assert opt.data_position is None
    losses += opt.optimize(model, data, epochs=1, batch_size=BATCH, seed=5).losses
    ref_params, ref_losses = reference(x, y, [(0, 0, 40), (0, 1, 64), (0, 2, 64),
                                              (0, 3, 96), (5, 0, 96)])
    np.testing.assert_allclose(model.params, ref_params, rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-10)


@pytest.mark.mpi
@batch_splits(BATCH)
def test_a_checkpoint_in_a_growing_stream_resumes_exactly(mpi_tmp_path):
    """Stopped mid-epoch, checkpointed, restored into a new strategy, more data
    arrives: the same bits as the run that never stopped."""
    x, y = stream()
    path = os.path.join(str(mpi_tmp_path), "stream.h5")
    whole_model, whole = make_model(), STRATEGIES["ddp"](Adam(lr=1e-2),
                                                         ShardingConfiguration(WORLD))
    whole.optimize(whole_model, (x[:64], y[:64]), epochs=1, batch_size=BATCH)
    whole.optimize(whole_model, (x, y), epochs=3, batch_size=BATCH)

    model, opt = make_model(), STRATEGIES["ddp"](Adam(lr=1e-2), ShardingConfiguration(WORLD))
    opt.optimize(model, (x[:64], y[:64]), epochs=1, batch_size=BATCH, max_steps=5)
    save_checkpoint(path, model, opt)
    model2 = make_model()
    opt2 = STRATEGIES["ddp"](Adam(lr=1e-2), ShardingConfiguration(WORLD))
    load_checkpoint(path, model2, opt2)
    assert opt2.data_position["samples_consumed"] == 5 * BATCH
    opt2.optimize(model2, (x, y), epochs=3, batch_size=BATCH)   # grown before the resume
    np.testing.assert_array_equal(model2.params, whole_model.params)
    assert opt2.step_count == whole.step_count == 8 + 2 * 12


@pytest.mark.mpi
@batch_splits(BATCH)
def test_shrinking_or_disagreeing_data_is_an_error_on_every_rank():
    x, y = stream()
    model, opt = make_model(), STRATEGIES["ddp"](Adam(lr=1e-2), ShardingConfiguration(WORLD))
    opt.optimize(model, (x[:64], y[:64]), epochs=1, batch_size=BATCH, max_steps=2)
    with pytest.raises(ValueError, match="the data has 48 samples but the data position"):
        opt.optimize(model, (x[:48], y[:48]), epochs=1, batch_size=BATCH)
    if WORLD.size > 1:
        n = 64 + 8 * (WORLD.rank == 1)     # one rank received more than the others
        with pytest.raises(ValueError, match="ranks hold data of different lengths"):
            opt.optimize(model, (x[:n], y[:n]), epochs=2, batch_size=BATCH)
    opt.new_pass()        # other data is fine after a new pass
    assert opt.optimize(model, (x[:48], y[:48]), epochs=1, batch_size=BATCH).steps == 6
