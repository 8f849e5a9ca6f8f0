"""ZeRO-3 checkpoints: written from the shards, read at any size, strategy and layout.

Run under ``mpirun -n N python -m pytest --with-mpi -m mpi`` for N = 1, 2, 4 (and 8
for the 3D layout). A file written by every rank of ``COMM_WORLD`` is loaded by
the first M ranks (M = 1, 2, 3, 4 <= N) into ZeRO-3, DDP or ZeRO-2, and training
goes on. Each test computes its references in the same run: the training never
stopped (on every rank, the writer's strategy), and the saved state handed to the
reader's strategy in memory, without a file.

Tolerances: right after a load the parameters and the optimizer state equal the
saved ones exactly; the continued training equals the in-memory handover bit
for bit, and the uninterrupted run bit for bit where the reader sums as the
writer did (the same ranks; ZeRO-3 and ZeRO-2 with the same reduce method) and
to rtol 1e-12 otherwise (other ranks sum in another order).
"""

from __future__ import annotations

import os

import h5py
import numpy as np
import pytest
from layouts import assert_slices, hybrid, mlp_data, mlp_factory
from mpi4py import MPI

from mpishard import CheckpointError, ShardingConfiguration
from mpishard.checkpoint import load_checkpoint, save_checkpoint
from mpishard.nn import MLP
from mpishard.optim import AdamW
from mpishard.optim.schedules import CosineSchedule
from mpishard.strategies import (
    DDPOptimizer,
    ZeRO2Optimizer,
    ZeRO3Optimizer,
)

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD
SIZES = [5, 7, 7, 3]        # 122 parameters: no shard boundary meets a tensor's
BATCH = 24                  # splits over 1, 2, 3 and 4 ranks
EPOCHS = 3                  # 96 samples: 4 steps per epoch, 12 in all
STOP = 6                    # the save: step 6, halfway through epoch 1
SCHEDULE = CosineSchedule(total_steps=12, warmup_steps=2)
POSITION = {"epoch": 1, "samples_consumed": 48, "seed": 0, "batch_size": BATCH,
            "num_samples": 96, "shuffle": 1}
RTOL = 1e-12


class Stop(Exception):
    """Raised from optimize()'s callback: a job that ends after step STOP."""


def make_data(n=96, features=5, classes=3, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, features))
    return x, np.argmax(x @ rng.standard_normal((features, classes)), axis=1)


def make_model(seed=7):
    return MLP(SIZES, activation="tanh", seed=seed, dtype=np.float64)


def make_strategy(name, comm):
    cls = {"ddp": DDPOptimizer, "zero2": ZeRO2Optimizer, "zero3": ZeRO3Optimizer}[name]
    kw = {} if name == "ddp" else {"reduce_method": "reduce_scatter"}
    return cls(AdamW(lr=3e-3, weight_decay=0.05), ShardingConfiguration(comm),
               schedule=SCHEDULE, bucket_mb=1e-4, **kw)


def whole(strategy):
    """The whole parameter vector (gathered under ZeRO-3: collective over its dp group)."""
    if isinstance(strategy, ZeRO3Optimizer):
        with strategy.gathered_parameters() as params:
            return np.array(params)
    return np.array(strategy.model.params)


def train(strategy, model, epochs, stop=None):
    losses = []

    def callback(step, loss):
        losses.append(loss)
        if step == stop:
            raise Stop

    try:
        strategy.optimize(model, make_data(), epochs=epochs, batch_size=BATCH, callback=callback)
    except Stop:
        pass
    return np.array(losses)


def full_state(strategy):
    return {k: np.array(v) for k, v in strategy.synchronize_optimizer_state().items()}


_REFERENCES: dict[str, tuple] = {}


def reference(writer):
    """The uninterrupted run on every rank (once per strategy)."""
    if writer not in _REFERENCES:
        model = make_model()
        strategy = make_strategy(writer, WORLD)
        losses = train(strategy, model, EPOCHS)
        assert strategy.step_count == 12
        _REFERENCES[writer] = whole(strategy), losses
    return _REFERENCES[writer]


def handed_over(reader, comm, params, state):
    """The saved state put into a new strategy in memory (no file), trained on."""
    model = make_model(seed=98)
    model.params[...] = params
    strategy = make_strategy(reader, comm)
    strategy.attach(model)
    r, mine = strategy.optimizer_state_shard()
    for k in mine:
        mine[k][...] = state[k][r.start:r.stop]
    strategy.step_count = STOP
    strategy.data_position = dict(POSITION)
    return strategy, train(strategy, model, EPOCHS)


CASES = [(w, r, m) for w, r in (("zero3", "zero3"), ("zero3", "ddp"), ("zero3", "zero2"),
                                ("zero2", "zero3"), ("ddp", "zero3"))
         for m in (1, 2, 3, 4)]


@pytest.mark.parametrize("writer,reader,m", [
    pytest.param(*case, marks=pytest.mark.mpi(min_size=case[2])) for case in CASES])
def test_resume_into_and_out_of_zero3(writer, reader, m, mpi_tmp_path):
    ref_params, ref_losses = reference(writer)
    path = os.path.join(str(mpi_tmp_path), "step6.h5")
    model = make_model()
    strategy = make_strategy(writer, WORLD)
    first = train(strategy, model, EPOCHS, stop=STOP)
    np.testing.assert_array_equal(first, ref_losses[:STOP])
    save_checkpoint(path, model, strategy)
    saved_params, saved_state = whole(strategy), full_state(strategy)
    # The file holds the logical tensors, whatever held them.
    if WORLD.rank == 0:
        with h5py.File(path, "r") as f:
            for spec in make_model().layout:
                np.testing.assert_array_equal(
                    f[f"params/{spec.name}"][...],
                    saved_params[spec.offset:spec.offset + spec.size].reshape(spec.shape))
                np.testing.assert_array_equal(
                    f[f"optimizer/exp_avg/{spec.name}"][...].ravel(),
                    saved_state["exp_avg"][spec.offset:spec.offset + spec.size])

    comm = WORLD.Split(0 if WORLD.rank < m else MPI.UNDEFINED, WORLD.rank)
    if comm != MPI.COMM_NULL:
        fresh = make_model(seed=99)           # other values: they must be loaded
        resumed = make_strategy(reader, comm)
        info = load_checkpoint(path, fresh, resumed)
        assert info.step == resumed.step_count == STOP
        assert info.layout["strategy"] == writer
        assert resumed.data_position == POSITION
        if reader == "zero3":
            assert fresh.params is None and len(resumed.core.parameter_shard()[1]) == \
                len(resumed.core.shard)
        np.testing.assert_array_equal(whole(resumed), saved_params)
        loaded = full_state(resumed)
        for k in saved_state:
            np.testing.assert_array_equal(loaded[k], saved_state[k])
        rest = train(resumed, fresh, EPOCHS)
        assert resumed.step_count == 12 and len(rest) == 12 - STOP
        twin, twin_losses = handed_over(reader, comm, saved_params, saved_state)
        np.testing.assert_array_equal(whole(resumed), whole(twin))
        np.testing.assert_array_equal(rest, twin_losses)
        same_sums = m == WORLD.size and {reader, writer} <= {"zero2", "zero3"}
        if same_sums or (m == 1 and WORLD.size == 1):
            np.testing.assert_array_equal(whole(resumed), ref_params)
            np.testing.assert_array_equal(rest, ref_losses[STOP:])
        np.testing.assert_allclose(whole(resumed), ref_params, rtol=RTOL, atol=RTOL * 1e-2)
        np.testing.assert_allclose(rest, ref_losses[STOP:], rtol=RTOL)
        resumed.verify_in_sync()
        comm.Free()
    WORLD.Barrier()


def test_without_the_strategy_is_a_clear_error(mpi_tmp_path):
    """A ZeRO-3 model holds no whole vector: saving or loading it without its
    strategy says what to do, on every rank."""
    model = make_model()
    strategy = make_strategy("zero3", WORLD)
    strategy.attach(model)
    path = os.path.join(str(mpi_tmp_path), "bare.h5")
    with pytest.raises(CheckpointError, match="gathered_parameters"):
        save_checkpoint(path, model)
    with strategy.gathered_parameters():
        save_checkpoint(path, model)            # the whole vector: a parameters-only file
    with pytest.raises(CheckpointError, match="gathered_parameters"):
        load_checkpoint(path, model)
    other = make_model(seed=3)
    load_checkpoint(path, other)
    np.testing.assert_array_equal(other.params, whole(strategy))
    WORLD.Barrier()


# --- 3D layouts: the same logical tensors ---------------------------------------------
@pytest.mark.layout3d   # also at 8 ranks: tp2-pp2-dp2
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)],
                         ids=["tp1-pp1", "tp2", "pp2", "tp2-pp2"])
def test_3d_zero3_to_whole_zero3_and_back(tp, pp, mpi_tmp_path):
    """A tensor/pipeline-parallel ZeRO-3 run's file is loaded by ZeRO-3 on the
    whole model over every rank, both go on alike; the whole model's file is
    loaded back by a fresh 3D ZeRO-3 layout."""
    if WORLD.size % (tp * pp):
        pytest.skip(f"tp={tp} x pp={pp} does not divide a world of {WORLD.size}")
    folder = str(mpi_tmp_path)
    data = mlp_data()
    model, opt = hybrid(WORLD, tp, pp, "zero3", reduce_method="reduce_scatter")
    opt.optimize(model, data, epochs=1, batch_size=16)
    path = save_checkpoint(os.path.join(folder, "hybrid.h5"), model, opt)
    flat = mlp_factory()()
    plain = ZeRO3Optimizer(AdamW(lr=1e-2, weight_decay=0.01), ShardingConfiguration(WORLD),
                           reduce_method="reduce_scatter")
    info = load_checkpoint(path, flat, plain)
    assert info.layout["strategy"] == "hybrid-zero3" and plain.step_count == opt.step_count == 3
    with opt.gathered_parameters() as params:
        assert_slices(model, params, whole(plain), flat.layout, rtol=RTOL)
    opt.optimize(model, data, epochs=2, batch_size=16)     # epochs is the total
    plain.optimize(flat, data, epochs=2, batch_size=16)
    assert plain.step_count == opt.step_count == 6
    full = whole(plain)
    with opt.gathered_parameters() as params:
        assert_slices(model, params, full, flat.layout, rtol=RTOL)
    back = save_checkpoint(os.path.join(folder, "whole.h5"), flat, plain)
    other, other_opt = hybrid(WORLD, tp, pp, "zero3", seed_shift=1.0,
                              reduce_method="reduce_scatter")
    load_checkpoint(back, other, other_opt)
    with other_opt.gathered_parameters() as params:
        assert_slices(other, params, full, flat.layout, rtol=RTOL)
    assert other_opt.step_count == 6 and other_opt.data_position["epoch"] == 2
    WORLD.Barrier()

