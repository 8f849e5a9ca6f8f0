"""A pipeline stage that holds no parameters (an activation alone) against one process.

Issue 21, finding 1: ``ParallelMLP([.., .., ..], activation="gelu")`` at pp=3 puts
the GELU alone on the middle stage; its data group had no gradient bucket, and
attach raised ``ValueError: expecting at least one bucket, got none`` (DDP, ZeRO-2;
ZeRO-3's parameter gathers the same). Such a stage still forwards activations and
backwards their gradients; it has zero-length buckets, shards and optimizer state.
Each test trains a float64 ``ParallelMLP`` (Adam, mse) as a ``HybridShardedModel``
whose stages are given so that one holds only an activation, and compares it with
the whole model trained by one process on the global batch in the same test:
losses, every tensor, the clipped norm (rtol 1e-10), the bits in reproducible
mode, checkpoints resharded into and out of the layout, the non-finite policies,
memory reports. Layouts with an empty stage need pp >= 3: they run at 3, 4, 6 and
8 ranks (tp2-pp4 and pp4-dp2 at 8); at other sizes the tests skip, saying why.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
from mpi4py import MPI
from reference import sampler_batches, train_serial
from worlds import world_multiple_of

from mpishard import NonFiniteError, ShardingConfiguration
from mpishard.checkpoint import load_checkpoint, save_checkpoint
from mpishard.data import ShardedSampler
from mpishard.nn import ParallelMLP
from mpishard.optim import Adam
from mpishard.strategies import HybridShardedModel, HybridShardedOptimizer

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD.size
ROWS, BATCH, MICRO, CLIP = 48, 16, 2, 0.3
TIMEOUT = 300.0            # seconds: generous for 8 ranks on 2 loaded cores

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
#: (data_parallel, options) by id; ZeRO's reduce method pinned (not measured).
STRATEGIES = {"ddp": ("ddp", {}),
              "zero2-reduce_scatter": ("zero2", {"reduce_method": "reduce_scatter"}),
              "zero2-allreduce": ("zero2", {"reduce_method": "allreduce"}),
              "zero3": ("zero3", {"reduce_method": "reduce_scatter"}),
              "zero3-no-prefetch": ("zero3", {"reduce_method": "allreduce", "prefetch": False})}


def cases(items: list) -> list:
    """``items``, or one case skipped with the reason at world sizes without a layout."""
    return items or [pytest.param(None, id="none", marks=pytest.mark.skip(reason=SKIP))]


def layout_id(layout) -> str:
    tp, pp, dp, _ = layout
    return f"tp{tp}-pp{pp}-dp{dp}"


def factory(sizes=SIZES):
    return functools.partial(ParallelMLP, list(sizes), activation="gelu", loss="mse",
                             dtype=np.float64, seed=5)


def data(nan_row: int | None = None, sizes=SIZES):
    rng = np.random.default_rng(4)
    x, y = rng.standard_normal((ROWS, sizes[0])), rng.standard_normal((ROWS, sizes[-1]))
    if nan_row is not None:
        x[nan_row, 0] = np.nan
    return x, y


def serial(steps: int, clip: float | None = CLIP, skip: frozenset = frozenset(),
           x_y=None, sizes=SIZES):
    """The whole model trained by one process (support/reference) on the first
    ``steps`` global batches of ``optimize`` (seed 0); the batches in ``skip`` are
    left out (they update nothing and do not count as steps). Returns (model, losses,
    norms)."""
    x, y = x_y if x_y is not None else data(sizes=sizes)
    batches = [b for k, b in enumerate(sampler_batches(x, y, BATCH, steps=steps))
               if k not in skip]
    run = train_serial(factory(sizes)(), Adam(lr=1e-2), batches, max_grad_norm=clip)
    return run.model, run.losses, run.norms


def hybrid(comm, layout, kind, options, *, schedule="1f1b", micro=MICRO, reproducible=False,
           **more):
    tp, pp, _, stages = layout
    # Under a timeout: a rank left behind in a collective fails instead of hanging.
    config = ShardingConfiguration(comm, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                   reproducible=reproducible, timeout=TIMEOUT)
    model = HybridShardedModel(factory(), config, micro_batches=micro, schedule=schedule,
                               stages=stages)
    opt = HybridShardedOptimizer(Adam(lr=1e-2), config, data_parallel=kind, model=model,
                                 **options, **more)
    return model, opt


def assert_matches(model, opt, whole, rtol=1e-10, exact=False):
    """Each local tensor (gathered under ZeRO-3) equals its slice of the whole
    model's tensor: to ``rtol``, or bit for bit with ``exact``."""
    checked = 0
    with opt.gathered_parameters() as params:
        for name, shard in model.tensor_shards().items():
            local = model.layout.view(params, name)
            full = whole.layout.view(whole.params, shard.logical_name)[shard.index]
            if exact:
                assert np.array_equal(local, full), name
            else:
                np.testing.assert_allclose(local, full, rtol=rtol, atol=rtol * 1e-2,
                                           err_msg=name)
            checked += local.size
        assert checked == params.size


def empty_stage(model) -> bool:
    return model.layout.size == 0


def check_memory(model, opt, kind, whole):
    """An empty stage holds no bytes of parameters, gradients or state; the
    stages' (and under ZeRO-3 the shards') parameter bytes add up to the model's."""
    report = opt.memory_report()
    c = model.config.groups.coordinates
    counted = report["parameters"] if kind == "zero3" or c.dp == 0 else 0
    total = MPI.COMM_WORLD.allreduce(counted)     # (before any rank's assert fails)
    if empty_stage(model):
        assert report["parameters"] == report["gradients"] == report["optimizer_state"] == 0
        assert report.get("gathered", 0) == 0
    if model.config.topology.tp == 1:    # without tensor slices: a partition of the bytes
        assert total == whole.params.nbytes


@world_multiple_of(3, "pipeline_parallel_size=3")
@pytest.mark.parametrize("kind", ["ddp", "zero2", "zero3"])
def test_issue_reproducer_trains_like_one_process(kind):
    # The issue's program as written (20-32-10, gelu, pp=3 balanced by parameter
    # count, micro_batches=2, default options), at any multiple of 3 ranks.
    sizes = (20, 32, 10)
    whole, ref_losses, _ = serial(6, clip=None, sizes=sizes)
    config = ShardingConfiguration(MPI.COMM_WORLD, pipeline_parallel_size=3)
    model = HybridShardedModel(factory(sizes), config, micro_batches=2)
    opt = HybridShardedOptimizer(Adam(lr=1e-2), config, data_parallel=kind, model=model)
    assert model.stage_ranges == [(0, 1), (1, 2), (2, 3)]
    assert empty_stage(model) == (config.groups.coordinates.pp == 1)
    result = opt.optimize(model, data(sizes=sizes), epochs=2, batch_size=BATCH)
    np.testing.assert_allclose(result.losses, ref_losses, rtol=1e-10)
    assert_matches(model, opt, whole)
    check_memory(model, opt, kind, whole)


@pytest.mark.parametrize("layout", cases(LAYOUTS.get(WORLD, [])), ids=layout_id)
@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_empty_stage_trains_like_one_process(layout, strategy, schedule):
    kind, options = STRATEGIES[strategy]
    whole, ref_losses, norms = serial(6)
    ref_norm = norms[-1]
    model, opt = hybrid(MPI.COMM_WORLD, layout, kind, options, schedule=schedule,
                        max_grad_norm=CLIP)
    # The layout has a stage without parameters, on this rank or another.
    assert MPI.COMM_WORLD.allreduce(int(empty_stage(model))) == layout[0] * layout[2]
    result = opt.optimize(model, data(), epochs=2, batch_size=BATCH)
    np.testing.assert_allclose(result.losses, ref_losses, rtol=1e-10)
    opt.verify_in_sync()     # collective: before the asserts that are this rank's own
    check_memory(model, opt, kind, whole)
    assert_matches(model, opt, whole)
    # The global norm counts every stage's share (the empty one's is zero), clipped.
    assert opt.last_grad_norm > CLIP
    np.testing.assert_allclose(opt.last_grad_norm, ref_norm, rtol=1e-10)


@pytest.mark.parametrize("layout", cases(LAYOUTS.get(WORLD, [])), ids=layout_id)
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_empty_stage_nonfinite_step(layout, strategy):
    # A NaN in one row of the second batch: "error" raises on every rank (the empty
    # stage's included) and changes nothing; "skip" trains as one process that
    # leaves that batch out.
    kind, options = STRATEGIES[strategy]
    sampler = ShardedSampler(ROWS, BATCH, seed=0)
    sampler.advance()
    bad = int(sampler.batch_indices(0, BATCH)[3])
    x_y = data(nan_row=bad)
    model, opt = hybrid(MPI.COMM_WORLD, layout, kind, options, nonfinite="error")
    with pytest.raises(NonFiniteError, match="step 2: non-finite"):
        opt.optimize(model, x_y, epochs=1, batch_size=BATCH)
    assert opt.step_count == 1
    once, _, _ = serial(1, clip=None)
    assert_matches(model, opt, once)

    model, opt = hybrid(MPI.COMM_WORLD, layout, kind, options, nonfinite="skip")
    result = opt.optimize(model, x_y, epochs=1, batch_size=BATCH)
    whole, ref_losses, _ = serial(3, clip=None, skip=frozenset({1}), x_y=x_y)
    assert opt.skipped_steps == 1 and opt.step_count == 2
    assert math.isnan(result.losses[1])
    np.testing.assert_allclose(np.delete(result.losses, 1), ref_losses, rtol=1e-10)
    assert_matches(model, opt, whole)


#: Reproducible mode's bits hold across pp and dp, not across tensor-parallel sizes
#: (a split layer cuts its matrix products differently): the layouts of tp=1.
UNSPLIT = [layout for layout in LAYOUTS.get(WORLD, []) if layout[0] == 1]


@pytest.mark.parametrize("layout", cases(UNSPLIT), ids=layout_id)
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_empty_stage_reproducible_bits_of_one_process(layout, strategy):
    # Reproducible mode: the bits of the same training on one process (pp=1).
    kind, options = STRATEGIES[strategy]
    self_model, self_opt = hybrid(MPI.COMM_SELF, ONE, "ddp", {}, micro=1, reproducible=True,
                                  max_grad_norm=CLIP)
    ref = self_opt.optimize(self_model, data(), epochs=2, batch_size=BATCH)
    model, opt = hybrid(MPI.COMM_WORLD, layout, kind, options, micro=1, reproducible=True,
                        max_grad_norm=CLIP)
    result = opt.optimize(model, data(), epochs=2, batch_size=BATCH)
    assert result.losses == ref.losses
    assert_matches(model, opt, self_model, exact=True)
    assert opt.last_grad_norm == self_opt.last_grad_norm
    check_memory(model, opt, kind, self_model)


# (writer ranks, layout, kind) -> (reader ranks, layout, kind), by world size: into and
# out of a layout with an empty stage, and from one such layout to another.
CONVERSIONS = {
    3: [((3, LAYOUTS[3][0], "zero2"), (1, ONE, "ddp")),
        ((1, ONE, "zero2"), (3, LAYOUTS[3][0], "ddp")),
        ((3, LAYOUTS[3][0], "zero3"), (1, ONE, "zero2")),
        ((1, ONE, "ddp"), (3, LAYOUTS[3][0], "zero3"))],
    4: [((4, LAYOUTS[4][0], "zero2"), (1, ONE, "ddp")),
        ((1, ONE, "ddp"), (4, LAYOUTS[4][0], "zero2")),
        ((4, LAYOUTS[4][0], "ddp"), (3, (1, 3, 1, STAGES3), "zero2")),
        ((4, LAYOUTS[4][0], "zero3"), (2, ONE[:2] + (2, None), "zero3")),
        ((2, ONE[:2] + (2, None), "zero3"), (4, LAYOUTS[4][0], "zero3"))],
    6: [((6, LAYOUTS[6][0], "zero2"), (1, ONE, "ddp")),
        ((1, ONE, "ddp"), (6, LAYOUTS[6][0], "zero2")),
        # (at 6 ranks the model has 3 layers: a 4-stage reader could not cut it)
        ((6, LAYOUTS[6][0], "zero3"), (3, (1, 3, 1, STAGES3), "zero3"))],
    8: [((8, LAYOUTS[8][0], "zero2"), (1, ONE, "ddp")),
        ((1, ONE, "zero2"), (8, LAYOUTS[8][1], "zero2")),
        ((8, LAYOUTS[8][1], "ddp"), (6, (1, 3, 2, STAGES3), "zero2")),
        ((8, LAYOUTS[8][0], "zero3"), (1, ONE, "ddp"))],
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
    return model, opt


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
    trained = _train_part(*reader, load_from=path)
    if trained is not None:      # two epochs in total, like the one process
        assert_matches(*trained, whole)
    world.Barrier()
