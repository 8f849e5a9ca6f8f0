"""3D parallelism against one process training the whole model on the global batch.

Every (tp, pp, dp) layout whose product is the world size runs here, with DDP and
with ZeRO-2 inside the data group, GPipe and 1F1B, for the GPT and the MLP; the
serial reference (the whole model, the optimizer called directly) is computed in
the same test. float64, rtol 1e-10 after several steps. Run at 1, 2, 4 and 8 ranks.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
from mpi4py import MPI
from reference import assert_shards_match, sampler_batches, train_serial

from mpishard import ShardingConfiguration, TopologyError
from mpishard.nn import GPT, ParallelMLP
from mpishard.optim import AdamW
from mpishard.strategies import HybridShardedModel, HybridShardedOptimizer

pytestmark = [pytest.mark.mpi, pytest.mark.layout3d]   # also at 8 ranks: tp2-pp2-dp2

WORLD = MPI.COMM_WORLD.size
# (tp, pp, dp); those of the current world size run.
ALL_LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (2, 1, 2), (1, 2, 2),
               (1, 4, 1), (2, 2, 2)]


def or_skipped(cases: list, names: int, reason: str) -> list:
    """``cases``; when there are none for this world size, one case skipped with ``reason``."""
    skipped = pytest.param(*[None] * names, id="none", marks=pytest.mark.skip(reason=reason))
    return cases or [skipped]


LAYOUTS = or_skipped([layout for layout in ALL_LAYOUTS if math.prod(layout) == WORLD], 1,
                     f"no (tp, pp, dp) layout of {WORLD} ranks: run at 1, 2, 4 or 8")
VOCAB, SEQ, D, HEADS, BLOCKS = 13, 6, 8, 2, 2


def gpt_factory(**kw):
    return functools.partial(GPT, VOCAB, SEQ, D, HEADS, BLOCKS, dtype=np.float64, seed=11, **kw)


def mlp_factory():
    return functools.partial(ParallelMLP, [6, 8, 8, 8, 4], activation="tanh",
                             dtype=np.float64, seed=5)


def token_data(n=48):
    rng = np.random.default_rng(2)
    x = rng.integers(0, VOCAB, (n, SEQ))
    return x, np.roll(x, -1, axis=1)


def mlp_data(n=48):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((n, 6))
    return x, np.argmax(x[:, :4] + 0.1 * rng.standard_normal((n, 4)), axis=1)


def serial_reference(factory, data, batch, epochs, make_opt, max_grad_norm=None):
    """One process: the serial model of ``factory``, the whole global batch, the
    optimizer called directly (``reference``)."""
    x, y = data
    run = train_serial(factory()(), make_opt(), sampler_batches(x, y, batch, epochs),
                       max_grad_norm=max_grad_norm)
    return run.model, run.losses


def make_opt():
    return AdamW(lr=1e-2, weight_decay=0.01)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda t: f"tp{t[0]}-pp{t[1]}-dp{t[2]}")
@pytest.mark.parametrize("data_parallel", ["ddp", "zero2", "zero3", "zero3-whole"])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_gpt_matches_serial(layout, data_parallel, schedule):
    tp, pp, dp = layout
    data = token_data()
    serial, ref_losses = serial_reference(gpt_factory, data, 16, 2, make_opt, max_grad_norm=0.3)
    config = ShardingConfiguration(MPI.COMM_WORLD, tensor_parallel_size=tp,
                                   pipeline_parallel_size=pp)
    model = HybridShardedModel(gpt_factory(), config, micro_batches=2, schedule=schedule)
    options = {"stage_gradient": "whole"} if data_parallel == "zero3-whole" else {}
    opt = HybridShardedOptimizer(make_opt(), config, data_parallel=data_parallel[:5],
                                 model=model, max_grad_norm=0.3, **options)
    result = opt.optimize(model, data, epochs=2, batch_size=16)
    np.testing.assert_allclose(result.losses, ref_losses, rtol=1e-10)
    assert opt.last_grad_norm > 0.3          # clipping was active: the norm is global
    opt.verify_in_sync()
    if data_parallel == "zero3":             # ZeRO-3's default: no whole stage gradient
        assert model.grads is None
    if model.params is None:
        opt.unshard()
    assert_shards_match(model, serial)
    # Each rank holds only its part: its stage's layers, its tensor slice.
    assert model.layout.size < serial.layout.size or WORLD == 1 or dp == WORLD


# Each data-parallel rank's rows, step by step (2 replicas): unequal, then none.
COUNTS = [[12, 12], [4, 20], [0, 24], [24, 0]]


@pytest.mark.parametrize("stage_gradient", ["sharded", "whole"])
def test_zero3_unequal_and_empty_replicas_with_accumulation(stage_gradient):
    """Hybrid ZeRO-3, two micro-batches in the pipeline and ``accumulation_steps=2``:
    replicas of unequal rows, and one with none (its passes replayed: each
    micro-batch's buckets reduced as the others' are), against the serial
    reference on the global batch of 24 rows."""
    layouts = {1: (1, 1), 2: (1, 1), 4: (1, 2), 8: (2, 2)}
    if WORLD not in layouts:
        pytest.skip(f"written for 1, 2, 4 or 8 ranks (1 or 2 replicas), not {WORLD}")
    tp, pp = layouts[WORLD]
    config = ShardingConfiguration(MPI.COMM_WORLD, tensor_parallel_size=tp,
                                   pipeline_parallel_size=pp)
    dp = config.groups.dp
    x, y = token_data()
    steps = len(COUNTS)
    batches = [(x[24 * s % 48:][:24], y[24 * s % 48:][:24]) for s in range(steps)]
    serial = train_serial(gpt_factory()(), make_opt(), batches, max_grad_norm=0.3)
    model = HybridShardedModel(gpt_factory(), config, micro_batches=2)
    opt = HybridShardedOptimizer(make_opt(), config, data_parallel="zero3", model=model,
                                 max_grad_norm=0.3, accumulation_steps=2,
                                 stage_gradient=stage_gradient, bucket_mb=0.001,
                                 gather_mb=0.001)
    losses = []
    for s, (bx, by) in enumerate(batches):
        counts = COUNTS[s] if dp.size == 2 else [24]
        lo, mine = sum(counts[:dp.rank]), counts[dp.rank]
        for half in (0, 1):
            a = lo + half * mine // 2
            opt.backward(bx[a:a + mine // 2], by[a:a + mine // 2])
        losses.append(opt.step())
    np.testing.assert_allclose(losses, serial.losses, rtol=1e-10)
    assert (model.grads is None) == (stage_gradient == "sharded")
    opt.unshard()
    assert_shards_match(model, serial.model)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda t: f"tp{t[0]}-pp{t[1]}-dp{t[2]}")
def test_mlp_matches_serial(layout):
    tp, pp, dp = layout
    data = mlp_data()
    serial, ref_losses = serial_reference(mlp_factory, data, 16, 3, make_opt)
    config = ShardingConfiguration(MPI.COMM_WORLD, tensor_parallel_size=tp,
                                   pipeline_parallel_size=pp)
    model = HybridShardedModel(mlp_factory(), config, micro_batches=4)
    opt = HybridShardedOptimizer(make_opt(), config, data_parallel="zero2", model=model,
                                 accumulation_steps=1)
    result = opt.optimize(model, data, epochs=3, batch_size=16)
    np.testing.assert_allclose(result.losses, ref_losses, rtol=1e-10)
    assert_shards_match(model, serial)


@pytest.mark.mpi(min_size=2)   # model parallelism needs two ranks
def test_memory_report_is_the_shard():
    stages = [pp for pp in (4, 3, 2) if WORLD % pp == 0]
    if not stages:
        pytest.skip(f"a pipeline of 2, 3 or 4 stages does not tile {WORLD} ranks")
    config = ShardingConfiguration(MPI.COMM_WORLD, tensor_parallel_size=1,
                                   pipeline_parallel_size=stages[0])
    model = HybridShardedModel(gpt_factory(), config)
    opt = HybridShardedOptimizer(make_opt(), config, model=model)
    report = opt.memory_report()
    assert report["parameters"] == model.params.nbytes
    sizes = model.pp.comm.allgather(model.params.size)
    assert sum(sizes) == gpt_factory()().params.size   # the stages partition the model


def test_bad_layouts_raise_everywhere():
    comm = MPI.COMM_WORLD
    with pytest.raises(TopologyError, match="not divisible"):
        HybridShardedModel(gpt_factory(), None, pipeline_parallel_size=WORLD + 1)
    if WORLD >= 3:   # a GPT with no blocks has 2 top-level layers: embedding, head
        with pytest.raises(ValueError, match="larger than the model's 2 top-level layers"):
            HybridShardedModel(functools.partial(GPT, VOCAB, SEQ, D, HEADS, 0), None,
                               pipeline_parallel_size=WORLD)
    if WORLD % 2 == 0:
        with pytest.raises(ValueError, match="n_heads=3 is not divisible"):
            HybridShardedModel(functools.partial(GPT, VOCAB, SEQ, 12, 3, 1), None,
                               tensor_parallel_size=2)
    model = HybridShardedModel(gpt_factory(), None, pipeline_parallel_size=1, micro_batches=3)
    opt = HybridShardedOptimizer(make_opt(), model=model)
    with pytest.raises(ValueError, match="does not split across"):
        opt.optimize(model, token_data(), epochs=1, batch_size=4 * comm.size)
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        HybridShardedModel(gpt_factory(), None, schedule="zigzag")


# (writer tp, pp, data-parallel kind, ranks) -> (reader tp, pp, kind, ranks), by world size.
CONVERSIONS = {
    8: [((2, 2, "zero2", 8), (1, 1, "ddp", 1)),      # tp2-pp2-dp2 -> tp1-pp1-dp1
        ((2, 2, "ddp", 8), (2, 1, "zero2", 8)),      # tp2-pp2-dp2 -> tp2-pp1-dp4
        ((1, 1, "ddp", 1), (2, 2, "zero2", 4))],     # tp1-pp1-dp1 -> tp2-pp2-dp1
    4: [((2, 2, "zero2", 4), (1, 1, "ddp", 1)),
        ((2, 2, "ddp", 4), (2, 1, "zero2", 4)),
        ((1, 1, "ddp", 1), (2, 2, "zero2", 4))],
    2: [((2, 1, "zero2", 2), (1, 2, "ddp", 2)),
        ((1, 1, "ddp", 1), (1, 2, "zero2", 2))],
}


def _train_part(ranks, tp, pp, kind, data, load_from=None, save_to=None):
    """Train one epoch on the first ``ranks`` ranks in layout (tp, pp), optionally
    resuming from and saving a checkpoint. Returns the model on those ranks."""
    from mpishard.checkpoint import load_checkpoint, save_checkpoint

    world = MPI.COMM_WORLD
    sub = world.Split(0 if world.rank < ranks else MPI.UNDEFINED, world.rank)
    if sub == MPI.COMM_NULL:
        return None
    config = ShardingConfiguration(sub, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    model = HybridShardedModel(gpt_factory(), config, micro_batches=2)
    opt = HybridShardedOptimizer(make_opt(), config, data_parallel=kind, model=model,
                                 max_grad_norm=0.3)
    if load_from is not None:
        info = load_checkpoint(load_from, model, opt)
        assert info.step == 3 and opt.step_count == 3
    # epochs counts from epoch 0: the reader trains the second epoch only.
    opt.optimize(model, data, epochs=1 if load_from is None else 2, batch_size=16)
    if save_to is not None:
        save_checkpoint(save_to, model, opt)
    return model


@pytest.mark.parametrize("writer,reader",
                         or_skipped(CONVERSIONS.get(WORLD, []), 2,
                                    f"no layout conversion of {WORLD} ranks: run at 2, 4 or 8"),
                         ids=lambda t: f"tp{t[0]}-pp{t[1]}-{t[2]}-on-{t[3]}")
def test_checkpoint_across_layouts_continues(writer, reader, tmp_path_factory):
    world = MPI.COMM_WORLD
    folder = world.bcast(str(tmp_path_factory.mktemp("ckpt")) if world.rank == 0 else None)
    path = f"{folder}/layout.h5"
    data = token_data()
    serial, ref_losses = serial_reference(gpt_factory, data, 16, 2, make_opt, max_grad_norm=0.3)
    (wtp, wpp, wkind, wranks), (rtp, rpp, rkind, rranks) = writer, reader
    _train_part(wranks, wtp, wpp, wkind, data, save_to=path)
    world.Barrier()
    model = _train_part(rranks, rtp, rpp, rkind, data, load_from=path)
    if model is not None:     # the reader's ranks: two epochs in total, like the serial run
        assert_shards_match(model, serial)
    world.Barrier()


def assert_replicated_tensors_equal(model) -> None:
    """The replicated tensors (biases, norms: whole on every tensor rank) are equal,
    bit for bit, on every tensor rank. Collective over the tensor group."""
    whole = sorted(name for name, shard in model.tensor_shards().items() if shard.replicated)
    mine = [model.layout.view(model.params, name).copy() for name in whole]
    other = model.config.groups.tp.bcast(mine, root=0)
    assert whole
    for name, a, b in zip(whole, mine, other):
        np.testing.assert_array_equal(a, b, err_msg=name)


def test_data_groups_agree_on_the_reduce_method(monkeypatch):
    """ZeRO-2's reduce_method='auto' is measured in each data group but chosen alike
    over the job: the tensor ranks' data groups hold copies of the replicated
    tensors (biases, norms), which must stay equal bit for bit. The measurement is
    made to favour another method on each tensor rank (before, each group took its
    own: at tp2 x dp4 the copies drifted by an ulp a step)."""
    if WORLD % 2:
        pytest.skip(f"a tensor-parallel size of 2 does not divide a world of {WORLD}")
    if 16 % WORLD:   # layouts.hybrid: 2 micro-batches a data-parallel rank of WORLD / 2
        pytest.skip(f"16 rows do not split into {WORLD // 2} data-parallel ranks x 2 "
                    f"micro-batches")
    from layouts import hybrid, mlp_data

    import mpishard.parallel.reduction as reduction

    tp = ShardingConfiguration(MPI.COMM_WORLD, tensor_parallel_size=2).groups.coordinates.tp
    real = reduction.time_alternatives

    def skewed(group, ways, repeats):
        times = real(group, ways, repeats)
        favoured = "allreduce" if tp == 0 else "reduce_scatter"
        return {way: (1.0 if way == favoured else 2.0) for way in times}

    monkeypatch.setattr(reduction, "time_alternatives", skewed)
    model, opt = hybrid(MPI.COMM_WORLD, 2, 1, "zero2")
    opt.optimize(model, mlp_data(), epochs=2, batch_size=16)
    every = MPI.COMM_WORLD.allgather(opt.core.reduction.method)   # the one 'auto' chose
    assert len(set(every)) == 1, every
    assert_replicated_tensors_equal(model)


@pytest.mark.layout3d
@pytest.mark.parametrize("data_parallel", ["ddp", "zero2"])
@pytest.mark.parametrize("favoured", ["by-tensor-rank", "hierarchical"])
def test_data_groups_agree_on_flat_or_two_levels(monkeypatch, data_parallel, favoured):
    """Flat or two levels across nodes is measured in each data group but chosen
    alike over the job (the tensor ranks' data groups hold copies of the
    replicated tensors). One node stands in for several (the two levels forced,
    the node map left out) and the measurement favours two levels on tensor rank 0
    and flat on rank 1 (before: each group took its own), or two levels on both
    (then every rank reduces in two levels, and the copies stay equal)."""
    if WORLD % 2 or WORLD < 4:
        pytest.skip(f"tp 2 leaves data groups of one rank (nothing to choose) or does not "
                    f"divide a world of {WORLD}")
    if 16 % WORLD:   # layouts.hybrid: 2 micro-batches a data-parallel rank of WORLD / 2
        pytest.skip(f"16 rows do not split into {WORLD // 2} data-parallel ranks x 2 "
                    f"micro-batches")
    from layouts import hybrid, mlp_data

    import mpishard.comm.hierarchical as hier
    import mpishard.parallel.reduction as reduction

    tp = ShardingConfiguration(MPI.COMM_WORLD, tensor_parallel_size=2).groups.coordinates.tp

    class TwoLevels(hier.HierarchicalComm):
        def __init__(self, group):
            super().__init__(group)
            self.two_levels = self.usable and self.per_node > 1

    real_choose, real_times = hier.choose, hier.time_alternatives

    def choose(*args, **kwargs):
        return real_choose(*args, **{**kwargs, "nodes": None})

    def skewed(group, ways, repeats):
        times = real_times(group, ways, repeats)
        fast = "hierarchical" if favoured == "hierarchical" or tp == 0 else "flat"
        return {way: (1.0 if way == fast else 2.0) for way in times}

    monkeypatch.setattr(hier, "HierarchicalComm", TwoLevels)
    monkeypatch.setattr(hier, "time_alternatives", skewed)
    monkeypatch.setattr(reduction, "choose_reduction", choose)
    options = {"reduce_method": "reduce_scatter"} if data_parallel == "zero2" else {}
    model, opt = hybrid(MPI.COMM_WORLD, 2, 1, data_parallel, **options)
    opt.optimize(model, mlp_data(), epochs=2, batch_size=16)
    every = MPI.COMM_WORLD.allgather(opt.core.reduction_timings["choice"])
    want = "hierarchical" if favoured == "hierarchical" else "flat"
    assert every == [want] * MPI.COMM_WORLD.size, every
    assert_replicated_tensors_equal(model)
