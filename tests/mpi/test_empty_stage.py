"""A pipeline stage that holds no parameters (an activation alone) against one process.

Issue 21, finding 1: ``ParallelMLP([.., .., ..], activation="gelu")`` at pp=3 puts
the GELU alone on the middle stage; its data group had no gradient bucket, and
attach raised ``ValueError: expecting at least one bucket, got none``. Such a stage
still forwards activations and backwards their gradients; it has zero-length
buckets, shards and optimizer state. Each test trains a float64 ``ParallelMLP``
(Adam, mse) as a ``HybridShardedModel`` whose stages are given so that one holds
only an activation, and compares it with the whole model trained by one process
on the global batch in the same test: losses, every tensor, the clipped norm
(rtol 1e-10), the bits in reproducible mode, checkpoints resharded into and out
of the layout. Layouts with an empty stage need 3 ranks (pp=3) or more: they run
at 3, 4, 6 and 8 ranks (tp2-pp4 and pp4-dp2 at 8); at 1 and 2 the tests skip.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
from mpi4py import MPI

from mpishard import NonFiniteError, ShardingConfiguration
from mpishard.checkpoint import load_checkpoint, save_checkpoint
from mpishard.data import ShardedSampler
from mpishard.nn import ParallelMLP
from mpishard.optim import Adam
from mpishard.strategies import HybridShardedModel, HybridShardedOptimizer

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD.size
ROWS, BATCH, MICRO, CLIP = 48, 16, 2, 0.3

#: The model of a world size: layers Linear, GELU, Linear[, GELU, Linear].
SIZES = {3: (6, 8, 4), 6: (6, 8, 4)}.get(WORLD, (6, 8, 8, 4))
#: (tp, pp, dp, stage ranges) by world size; stage 1 is the GELU alone: no parameters.
STAGES3 = [(0, 1), (1, 2), (2, 3)] if len(SIZES) == 3 else [(0, 1), (1, 2), (2, 5)]
STAGES4 = [(0, 1), (1, 2), (2, 3), (3, 5)]
LAYOUTS = {3: [(1, 3, 1, STAGES3)], 4: [(1, 4, 1, STAGES4)], 6: [(1, 3, 2, STAGES3)],
           8: [(1, 4, 2, STAGES4), (2, 4, 1, STAGES4)]}
ONE = (1, 1, 1, None)      # the whole model on one process
SKIP = (f"a layout with a stage of no parameters needs pp >= 3: run at 3, 4, 6 or 8 ranks, "
        f"not {WORLD}")
STRATEGIES = [("ddp", {}), ("zero2", {"reduce_method": "reduce_scatter"}),
              ("zero2", {"reduce_method": "allreduce"})]


def cases(items: list) -> list:
    """``items``, or one case skipped with the reason at world sizes without a layout."""
    return items or [pytest.param(None, id="none", marks=pytest.mark.skip(reason=SKIP))]


def layout_id(layout) -> str:
    tp, pp, dp, _ = layout
    return f"tp{tp}-pp{pp}-dp{dp}"


def factory():
    return functools.partial(ParallelMLP, list(SIZES), activation="gelu", loss="mse",
                             dtype=np.float64, seed=5)


def data(nan_row: int | None = None):
    rng = np.random.default_rng(4)
    x, y = rng.standard_normal((ROWS, SIZES[0])), rng.standard_normal((ROWS, SIZES[-1]))
    if nan_row is not None:
        x[nan_row, 0] = np.nan
    return x, y


def serial(steps: int, clip: float | None = CLIP, skip: frozenset = frozenset(),
           x_y=None):
    """The whole model trained by this process alone on the global batches of
    ``optimize`` (seed 0), the optimizer called directly; batches in ``skip``
    update nothing and do not count as steps. Returns (model, losses, last norm)."""
    model = factory()()
    opt = Adam(lr=1e-2)
    state = opt.init_state(model.params.size, model.params.dtype, np)
    x, y = x_y if x_y is not None else data()
    sampler = ShardedSampler(len(x), BATCH, seed=0)
    losses, norm, step = [], math.nan, 0
    for k in range(steps):
        idx = sampler.batch_indices(0, BATCH)
        sampler.advance()
        losses.append(model.forward_backward(x[idx], y[idx]))
        if k in skip:
            continue
        step += 1
        norm = math.sqrt(float(np.sum(model.grads ** 2)))
        coef = 1.0 if clip is None else min(1.0, clip / (norm + 1e-6))
        opt.update(model.params, model.grads, state, step, opt.lr, coef)
    return model, np.array(losses), norm


def hybrid(comm, layout, kind, options, *, schedule="1f1b", micro=MICRO, reproducible=False,
           **more):
    tp, pp, _, stages = layout
    config = ShardingConfiguration(comm, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                   reproducible=reproducible)
    model = HybridShardedModel(factory(), config, micro_batches=micro, schedule=schedule,
                               stages=stages)
    opt = HybridShardedOptimizer(Adam(lr=1e-2), config, data_parallel=kind, model=model,
                                 **options, **more)
    return model, opt


def assert_matches(model, whole, rtol=1e-10):
    """Each local tensor equals its slice of the whole model's tensor."""
    checked = 0
    for name, shard in model.tensor_shards().items():
        local = model.layout.view(model.params, name)
        full = whole.layout.view(whole.params, shard.logical_name)
        np.testing.assert_allclose(local, full[shard.index], rtol=rtol, atol=rtol * 1e-2,
                                   err_msg=name)
        checked += local.size
    assert checked == model.params.size


def empty_stage(model) -> bool:
    return model.params.size == 0


@pytest.mark.parametrize("layout", cases(LAYOUTS.get(WORLD, [])), ids=layout_id)
@pytest.mark.parametrize("kind,options", STRATEGIES,
                         ids=["ddp", "zero2-reduce_scatter", "zero2-allreduce"])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_empty_stage_trains_like_one_process(layout, kind, options, schedule):
    whole, ref_losses, ref_norm = serial(6)
    model, opt = hybrid(MPI.COMM_WORLD, layout, kind, options, schedule=schedule,
                        max_grad_norm=CLIP)
    # The layout has a stage without parameters, on this rank or another.
    assert MPI.COMM_WORLD.allreduce(int(empty_stage(model))) == layout[0] * layout[2]
    result = opt.optimize(model, data(), epochs=2, batch_size=BATCH)
    np.testing.assert_allclose(result.losses, ref_losses, rtol=1e-10)
    assert_matches(model, whole)
    # The global norm counts every stage's share (the empty one's is zero), clipped.
    assert opt.last_grad_norm > CLIP
    np.testing.assert_allclose(opt.last_grad_norm, ref_norm, rtol=1e-10)
    opt.verify_in_sync()
    report = opt.memory_report()
    if empty_stage(model):
        assert report["parameters"] == report["gradients"] == report["optimizer_state"] == 0
    if layout[0] == 1:   # without tensor slices the stages partition the model's bytes
        c = model.config.groups.coordinates
        counted = report["parameters"] if c.dp == 0 else 0
        assert MPI.COMM_WORLD.allreduce(counted) == whole.params.nbytes


@pytest.mark.parametrize("layout", cases(LAYOUTS.get(WORLD, [])), ids=layout_id)
@pytest.mark.parametrize("kind,options", STRATEGIES,
                         ids=["ddp", "zero2-reduce_scatter", "zero2-allreduce"])
def test_empty_stage_nonfinite_step(layout, kind, options):
    # A NaN in one row of the second batch: "error" raises on every rank (the empty
    # stage's included) and changes nothing; "skip" trains as one process that
    # leaves that batch out.
    sampler = ShardedSampler(ROWS, BATCH, seed=0)
    sampler.advance()
    bad = int(sampler.batch_indices(0, BATCH)[3])
    x_y = data(nan_row=bad)
    model, opt = hybrid(MPI.COMM_WORLD, layout, kind, options, nonfinite="error")
    before = model.params.copy()
    with pytest.raises(NonFiniteError, match="step 2: non-finite"):
        opt.optimize(model, x_y, epochs=1, batch_size=BATCH)
    assert opt.step_count == 1
    once, _, _ = serial(1, clip=None)
    assert_matches(model, once)
    assert not empty_stage(model) or np.array_equal(model.params, before)

    model, opt = hybrid(MPI.COMM_WORLD, layout, kind, options, nonfinite="skip")
    result = opt.optimize(model, x_y, epochs=1, batch_size=BATCH)
    whole, ref_losses, _ = serial(3, clip=None, skip=frozenset({1}), x_y=x_y)
    assert opt.skipped_steps == 1 and opt.step_count == 2
    assert math.isnan(result.losses[1])
    np.testing.assert_allclose(np.delete(result.losses, 1), np.delete(ref_losses, 1),
                               rtol=1e-10)
    assert_matches(model, whole)


@pytest.mark.parametrize("layout", cases(LAYOUTS.get(WORLD, [])), ids=layout_id)
@pytest.mark.parametrize("kind,options", STRATEGIES,
                         ids=["ddp", "zero2-reduce_scatter", "zero2-allreduce"])
def test_empty_stage_reproducible_bits_of_one_process(layout, kind, options):
    # Reproducible mode: the bits of the same training on one process (pp=1).
    self_model, self_opt = hybrid(MPI.COMM_SELF, ONE, "ddp", {}, micro=1, reproducible=True,
                                  max_grad_norm=CLIP)
    ref = self_opt.optimize(self_model, data(), epochs=2, batch_size=BATCH)
    model, opt = hybrid(MPI.COMM_WORLD, layout, kind, options, micro=1, reproducible=True,
                        max_grad_norm=CLIP)
    result = opt.optimize(model, data(), epochs=2, batch_size=BATCH)
    assert result.losses == ref.losses
    for name, shard in model.tensor_shards().items():
        local = model.layout.view(model.params, name)
        full = self_model.layout.view(self_model.params, shard.logical_name)
        assert np.array_equal(local, full[shard.index]), name
    assert opt.last_grad_norm == self_opt.last_grad_norm
    report = opt.memory_report()
    assert report["total"] >= report["buffers"] >= 0


# (writer ranks, layout, kind) -> (reader ranks, layout, kind), by world size: into and
# out of a layout with an empty stage, and from one such layout to another.
CONVERSIONS = {
    3: [((3, LAYOUTS[3][0], "zero2"), (1, ONE, "ddp")),
        ((1, ONE, "zero2"), (3, LAYOUTS[3][0], "ddp"))],
    4: [((4, LAYOUTS[4][0], "zero2"), (1, ONE, "ddp")),
        ((1, ONE, "ddp"), (4, LAYOUTS[4][0], "zero2")),
        ((4, LAYOUTS[4][0], "ddp"), (3, (1, 3, 1, STAGES3), "zero2"))],
    6: [((6, LAYOUTS[6][0], "zero2"), (1, ONE, "ddp")),
        ((1, ONE, "ddp"), (6, LAYOUTS[6][0], "zero2"))],
    8: [((8, LAYOUTS[8][0], "zero2"), (1, ONE, "ddp")),
        ((1, ONE, "zero2"), (8, LAYOUTS[8][1], "zero2")),
        ((8, LAYOUTS[8][1], "ddp"), (6, (1, 3, 2, STAGES3), "zero2"))],
}


def _train_part(ranks, layout, kind, load_from=None, save_to=None):
    """One epoch (the second when resuming) on the first ``ranks`` ranks."""
    world = MPI.COMM_WORLD
    sub = world.Split(0 if world.rank < ranks else MPI.UNDEFINED, world.rank)
    if sub == MPI.COMM_NULL:
        return None
    model, opt = hybrid(sub, layout, kind, {}, max_grad_norm=CLIP)
    if load_from is not None:
        info = load_checkpoint(load_from, model, opt)
        assert info.step == 3 and opt.step_count == 3
    opt.optimize(model, data(), epochs=1 if load_from is None else 2, batch_size=BATCH)
    if save_to is not None:
        save_checkpoint(save_to, model, opt)
    sub.Free()
    return model


def conversion_id(case) -> str:
    ranks, (tp, pp, dp, _), kind = case
    return f"tp{tp}-pp{pp}-dp{dp}-{kind}-on-{ranks}"


@pytest.mark.parametrize(
    "writer,reader",
    CONVERSIONS.get(WORLD) or [pytest.param(None, None, id="none",
                                            marks=pytest.mark.skip(reason=SKIP))],
    ids=conversion_id)
def test_checkpoint_into_and_out_of_an_empty_stage(writer, reader, tmp_path_factory):
    world = MPI.COMM_WORLD
    folder = world.bcast(str(tmp_path_factory.mktemp("empty")) if world.rank == 0 else None)
    path = f"{folder}/empty.h5"
    whole, _, _ = serial(6)
    _train_part(*writer, save_to=path)
    world.Barrier()
    model = _train_part(*reader, load_from=path)
    if model is not None:      # two epochs in total, like the one process
        assert_matches(model, whole)
    world.Barrier()
