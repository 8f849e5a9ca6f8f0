"""What a checkpoint recorded, compared on load: architecture, tensor names, settings.

The record comparison is pure (no MPI: ``tests/unit/test_architecture_records.py``);
the loads run under ``mpirun -n N python -m pytest --with-mpi`` for N = 1, 2, 4 (the
pipelined case needs 2 ranks).
References: the file's own tensors (a refused load changes nothing; a forced one
gives the saved parameters exactly), and training never interrupted in the same
test (a resume that takes the file's schedule continues bit for bit: same
layout, same summation order).
"""

from __future__ import annotations

import functools
import os
import warnings

import numpy as np
import pytest
from mpi4py import MPI
from worlds import batch_splits, world_multiple_of

from mpishard import CheckpointError, CheckpointWarning, ShardingConfiguration
from mpishard.checkpoint import load_checkpoint, save_checkpoint
from mpishard.nn import MLP, ParallelMLP
from mpishard.optim import AdamW, CosineSchedule
from mpishard.strategies import (
    DDPOptimizer,
    HybridShardedModel,
    HybridShardedOptimizer,
    ZeRO2Optimizer,
)

WORLD = MPI.COMM_WORLD


# --- loads into strategies, at any world size -------------------------------------

def _data(n=96, features=4, outputs=2, seed=3):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, features)), rng.standard_normal((n, outputs))


@pytest.mark.mpi
@batch_splits(24)
def test_strategy_load_refuses_another_architecture_on_every_rank(mpi_tmp_path):
    path = os.path.join(str(mpi_tmp_path), "gelu.h5")
    config = ShardingConfiguration(WORLD)
    model = MLP([4, 8, 2], activation="gelu", loss="mse")
    ddp = DDPOptimizer(AdamW(lr=1e-2), config)
    ddp.optimize(model, _data(), epochs=1, batch_size=24)
    save_checkpoint(path, model, ddp)

    other = MLP([4, 8, 2], activation="relu", loss="mse", seed=5)
    zero2 = ZeRO2Optimizer(AdamW(lr=1e-2), config, model=other)
    before = other.params.copy()
    with pytest.raises(CheckpointError) as raised:              # on every rank
        load_checkpoint(path, other, zero2)
    assert "activation: 'gelu' in the file, 'relu' in the model" in str(raised.value)
    np.testing.assert_array_equal(other.params, before)
    assert zero2.step_count == 0
    info = load_checkpoint(path, other, zero2, strict_architecture=False)
    np.testing.assert_array_equal(other.params, model.params)
    assert info.step == zero2.step_count == ddp.step_count == 4
    WORLD.Barrier()


@pytest.mark.mpi
@batch_splits(24)
def test_settings_warn_and_the_schedule_is_taken_from_the_file(mpi_tmp_path):
    path = os.path.join(str(mpi_tmp_path), "half.h5")
    data = _data()
    config = ShardingConfiguration(WORLD)
    schedule = CosineSchedule(total_steps=8, warmup_steps=2)
    ref_model = MLP([4, 8, 2], loss="mse")
    ref = DDPOptimizer(AdamW(lr=1e-2), config, max_grad_norm=0.5, schedule=schedule)
    ref.optimize(ref_model, data, epochs=1, batch_size=24)      # 4 steps
    save_checkpoint(path, ref_model, ref)
    ref.optimize(ref_model, data, epochs=2, batch_size=24)      # the uninterrupted run

    # Same clipping, no schedule: the file's schedule is taken, and the resumed
    # run equals the uninterrupted one bit for bit (same layout and order).
    model = MLP([4, 8, 2], loss="mse", seed=4)
    ddp = DDPOptimizer(AdamW(lr=1e-2), config, max_grad_norm=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)      # nothing differs
        info = load_checkpoint(path, model, ddp)
    assert ddp.schedule == schedule
    assert info.notes == [f"schedule: taken from the file, {schedule!r}"]
    assert info.settings == {"max_grad_norm": 0.5, "accumulation_steps": 1}
    ddp.optimize(model, data, epochs=2, batch_size=24)
    np.testing.assert_array_equal(model.params, ref_model.params)

    # Other settings: kept, and said (a warning on rank 0, the notes everywhere).
    other = MLP([4, 8, 2], loss="mse", seed=4)
    mine = CosineSchedule(total_steps=20)
    changed = DDPOptimizer(AdamW(lr=2e-2), config, accumulation_steps=2, schedule=mine)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        info = load_checkpoint(path, other, changed)
    expected = ["optimizer lr: 0.01 in the file, 0.02 in the strategy",
                "schedule: CosineSchedule(total_steps=8, warmup_steps=2, min_ratio=0.0) in "
                "the file, CosineSchedule(total_steps=20, warmup_steps=0, min_ratio=0.0) in "
                "the strategy",
                "max_grad_norm: 0.5 in the file, None in the strategy",
                "accumulation_steps: 1 in the file, 2 in the strategy"]
    assert info.notes == expected
    assert changed.schedule is mine and changed.max_grad_norm is None
    ours = [w for w in caught if issubclass(w.category, CheckpointWarning)]
    if WORLD.rank == 0:
        assert len(ours) == 1 and all(line in str(ours[0].message) for line in expected)
    else:
        assert ours == []
    WORLD.Barrier()


@pytest.mark.mpi(min_size=2)
@world_multiple_of(2, "pipeline_parallel_size 2")
def test_pipelined_mismatch_names_the_model_wide_tensor(mpi_tmp_path):
    path = os.path.join(str(mpi_tmp_path), "pp.h5")
    size = WORLD.size
    data = _data(features=4, outputs=3)
    factory = functools.partial(ParallelMLP, [4, 8, 8, 3], activation="gelu", loss="mse")
    config = ShardingConfiguration(WORLD, pipeline_parallel_size=2)
    model = HybridShardedModel(factory, config, micro_batches=2)
    opt = HybridShardedOptimizer(AdamW(lr=1e-2), config, model=model)
    opt.optimize(model, data, epochs=1, batch_size=4 * size)
    save_checkpoint(path, model, opt)

    # The last layer's bias has another shape: only the last stage holds it, as its
    # local tensor 2 or so; the message names it as the model does.
    wider = functools.partial(ParallelMLP, [4, 8, 8, 4], activation="gelu", loss="mse")
    other = HybridShardedModel(wider, config, micro_batches=2)
    other_opt = HybridShardedOptimizer(AdamW(lr=1e-2), config, model=other)
    with pytest.raises(CheckpointError) as raised:
        load_checkpoint(path, other, other_opt)
    text = str(raised.value)
    assert "tensor 4.weight (number 4 of the 6 in the file) is (8, 3) in the file, (8, 4) in " \
           "the model" in text, text
    # The architecture record travels with a pipelined model too: another
    # activation with the same shapes is refused.
    relu = HybridShardedModel(functools.partial(ParallelMLP, [4, 8, 8, 3], activation="relu",
                                                loss="mse"), config, micro_batches=2)
    relu_opt = HybridShardedOptimizer(AdamW(lr=1e-2), config, model=relu)
    with pytest.raises(CheckpointError, match="activation: 'gelu' in the file, 'relu'"):
        load_checkpoint(path, relu, relu_opt)
    WORLD.Barrier()
