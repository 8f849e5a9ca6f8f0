"""Reproducible mode: the same bits at any data-parallel size, strategy and pipeline layout.

Every MPI test computes its reference in the same test: the same training run
by one process on ``MPI.COMM_SELF`` (a 1-rank ``ShardingConfiguration``), and
compares the SHA-256 of the flat parameters and of the list of losses after 30
steps. Run at 1, 2, 4 and 8 ranks; ``tests/jobs/test_three_ranks.py`` runs these
training runs in its own ``mpirun -n 3``, ``tests/jobs/test_train_cli.py`` the
``--reproducible`` flag of ``mpishard train``. The binned sum itself is tested
without MPI against ``math.fsum`` (``tests/unit/test_reprosum.py``).
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys

import numpy as np
import pytest
from mpi4py import MPI
from worlds import batch_splits

from mpishard import ShardingConfiguration
from mpishard.nn import GPT, MLP, ParallelMLP
from mpishard.optim import AdamW
from mpishard.strategies import (
    DDPOptimizer,
    HybridShardedModel,
    HybridShardedOptimizer,
    ZeRO2Optimizer,
)

WORLD = MPI.COMM_WORLD.size
BATCH = 48          # 24 units of 2 rows by default: dp = 1, 2, 3, 4, 6, 8, 12, 24
EPOCHS = 6          # 5 steps an epoch: 30 steps
VOCAB, SEQ = 11, 5


# --- training runs shared by the MPI tests and the 3-rank job (tests/jobs) ----------
def mlp_data(n=240):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((n, 6))
    return x, np.argmax(x[:, :4] + 0.1 * rng.standard_normal((n, 4)), axis=1)


def token_data(n=240):
    rng = np.random.default_rng(2)
    x = rng.integers(0, VOCAB, (n, SEQ))
    return x, np.roll(x, -1, axis=1)


def digest(params, losses) -> tuple[str, str]:
    """SHA-256 of the flat parameters and of the losses (float64)."""
    return (hashlib.sha256(np.ascontiguousarray(params).tobytes()).hexdigest(),
            hashlib.sha256(np.asarray(losses, dtype=np.float64).tobytes()).hexdigest())


def make_strategy(kind, config, **options):
    opt = AdamW(lr=1e-2, weight_decay=0.01)
    if kind == "ddp":
        return DDPOptimizer(opt, config, **options)
    method = kind.split("-", 1)[1]
    return ZeRO2Optimizer(opt, config, reduce_method=method, **options)


def units_of(model):
    """Rows per unit: the MLP the default (24 units of 2 rows), the GPT 4 units of
    12 (fewer, larger units keep the test short)."""
    return 12 if model == "gpt" else None


def train(comm, kind="ddp", model="mlp", dtype=np.float32, accumulation=1, clip=None,
          reproducible=True, epochs=EPOCHS, unit_rows="auto", sizes=None, xp=np):
    """Train 30 steps (the model on ``xp``'s device); returns (parameter digest,
    loss digest, params, losses)."""
    unit_rows = (units_of(model) if sizes is None else None) if unit_rows == "auto" \
        else unit_rows
    config = ShardingConfiguration(comm, reproducible=reproducible, unit_rows=unit_rows,
                                   reproducible_sizes=sizes)
    if model == "mlp":
        net, data = MLP([6, 16, 16, 4], activation="tanh", dtype=dtype, seed=5, xp=xp), \
            mlp_data()
    else:
        net, data = GPT(VOCAB, SEQ, 8, 2, 2, dtype=dtype, seed=11, xp=xp), token_data()
    strategy = make_strategy(kind, config, accumulation_steps=accumulation,
                             max_grad_norm=clip)
    result = strategy.optimize(net, (data[0], data[1]), epochs=epochs, batch_size=BATCH)
    strategy.verify_in_sync()
    params = np.array(net.params) if xp is np else xp.asnumpy(net.params)
    config.free()
    return (*digest(params, result.losses), params, np.array(result.losses))


# (strategy, model, dtype, accumulation_steps, max_grad_norm)
CASES = [
    ("ddp", "mlp", np.float32, 1, None),
    ("ddp", "mlp", np.float64, 2, 0.5),
    ("zero2-reduce_scatter", "mlp", np.float32, 2, 0.5),
    ("zero2-allreduce", "mlp", np.float64, 1, 0.5),
    ("zero2-reduce_scatter", "mlp", np.float64, 1, None),
    ("ddp", "gpt", np.float32, 1, 0.5),
    ("zero2-reduce_scatter", "gpt", np.float64, 2, None),
]


def case_id(case):
    kind, model, dtype, acc, clip = case
    return f"{kind}-{model}-{np.dtype(dtype).name}-acc{acc}-clip{clip}"


# --- the same bits at every data-parallel size ---------------------------------------
def units_fit(world: int, accumulation: int, model: str = "mlp") -> bool:
    rows = units_of(model)
    units = BATCH // rows if rows else 24
    return units % (world * accumulation) == 0


@pytest.mark.mpi
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_same_bits_as_one_process(case):
    kind, model, dtype, acc, clip = case
    if not units_fit(WORLD, acc, model):
        pytest.skip(f"the units do not split over {WORLD} ranks x {acc} micro-batches")
    serial = train(MPI.COMM_SELF, "ddp", model, dtype, acc, clip)
    mine = train(MPI.COMM_WORLD, kind, model, dtype, acc, clip)
    assert len(mine[3]) == 30
    assert mine[:2] == serial[:2], (np.max(np.abs(mine[2] - serial[2])),
                                    np.max(np.abs(mine[3] - serial[3])))


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.parametrize("case", [("ddp", "mlp", np.float32, 1, None),
                                  ("zero2-reduce_scatter", "gpt", np.float64, 1, 0.5),
                                  ("zero2-allreduce", "mlp", np.float64, 2, 0.5)], ids=case_id)
def test_same_bits_on_the_device(case):
    """CuPy arrays (the deposit's CUDA kernels with MPISHARD_GPU_KERNELS=1, the
    twin without): the same bits at any size, as one process on the device."""
    from backends import cupy_or_skip

    cp = cupy_or_skip()
    kind, model, dtype, acc, clip = case
    if not units_fit(WORLD, acc, model):
        pytest.skip(f"the units do not split over {WORLD} ranks x {acc} micro-batches")
    serial = train(MPI.COMM_SELF, "ddp", model, dtype, acc, clip, xp=cp)
    mine = train(MPI.COMM_WORLD, kind, model, dtype, acc, clip, xp=cp)
    assert mine[:2] == serial[:2]


@batch_splits(BATCH)
@pytest.mark.mpi
def test_reproducible_is_the_same_training_as_default():
    """Within float tolerance of the default mode (it is the same mean gradient)."""
    for dtype, rtol in ((np.float64, 1e-9), (np.float32, 2e-3)):
        repro = train(MPI.COMM_WORLD, "ddp", "mlp", dtype, 1, 0.5)
        default = train(MPI.COMM_WORLD, "ddp", "mlp", dtype, 1, 0.5, reproducible=False)
        np.testing.assert_allclose(repro[3], default[3], rtol=rtol)
        np.testing.assert_allclose(repro[2], default[2], rtol=rtol, atol=rtol)
        if dtype == np.float64 and WORLD > 1:
            assert repro[0] != default[0]    # and yet not the same arithmetic


@batch_splits(BATCH)
@pytest.mark.mpi(min_size=2)
def test_units_cut_by_a_rank_is_an_error_on_every_rank():
    config = ShardingConfiguration(MPI.COMM_WORLD, reproducible=True, unit_rows=BATCH // 2 + 1)
    strategy = make_strategy("ddp", config)
    with pytest.raises(ValueError, match=f"units of unit_rows={BATCH // 2 + 1} rows"):
        strategy.optimize(MLP([6, 4], seed=1), mlp_data(), epochs=1, batch_size=BATCH)
    config = ShardingConfiguration(MPI.COMM_WORLD, reproducible=True, unit_rows=BATCH // 3)
    strategy = make_strategy("ddp", config)
    if 3 % WORLD:
        with pytest.raises(ValueError, match="cut a unit of 16 rows"):
            strategy.optimize(MLP([6, 4], seed=1), mlp_data(), epochs=1, batch_size=BATCH)
    with pytest.raises(ValueError, match="unit_rows must be a positive integer"):
        ShardingConfiguration(MPI.COMM_WORLD, reproducible=True, unit_rows=0)


# --- reproducible_sizes: the units the sizes a user needs allow ----------------------
@pytest.mark.mpi
@pytest.mark.parametrize("kind, dtype, acc", [("ddp", np.float32, 1),
                                              ("zero2-reduce_scatter", np.float64, 1),
                                              ("zero2-allreduce", np.float32, 2)])
def test_reproducible_sizes_same_bits_as_one_process(kind, dtype, acc):
    """Sizes (1, 2, 4): 4 units of 12 rows (8 with accumulation 2), each rank
    computing as few as the size allows."""
    sizes = (1, 2, 4) if acc == 1 else (2, 4, 8)
    if 4 % WORLD:
        pytest.skip(f"reproducible_sizes {sizes} does not include {WORLD} ranks")
    serial = train(MPI.COMM_SELF, "ddp", "mlp", dtype, acc, 0.5, sizes=sizes)
    mine = train(MPI.COMM_WORLD, kind, "mlp", dtype, acc, 0.5, sizes=sizes)
    assert mine[:2] == serial[:2]


# --- pipelines: pp = 1, 2, 4, GPipe and 1F1B, micro-batches 1, 2, 4 ---------------------
PIPE_UNIT = 6       # 8 units of 6 rows: a pipeline micro-batch is one unit


def pipeline_factory(kind, dtype):
    if kind == "gpt":
        return functools.partial(GPT, VOCAB, SEQ, 8, 2, 2, dtype=dtype, seed=11)
    return functools.partial(ParallelMLP, [6, 8, 8, 8, 4], activation="tanh", dtype=dtype,
                             seed=5)


def train_pipeline(comm, pp, kind, dtype, schedule, data_parallel, clip=0.5, micro=1):
    config = ShardingConfiguration(comm, pipeline_parallel_size=pp, reproducible=True,
                                   unit_rows=PIPE_UNIT)
    model = HybridShardedModel(pipeline_factory(kind, dtype), config, micro_batches=micro,
                               schedule=schedule)
    strategy = HybridShardedOptimizer(AdamW(lr=1e-2, weight_decay=0.01), config,
                                      data_parallel=data_parallel, model=model,
                                      max_grad_norm=clip)
    data = token_data() if kind == "gpt" else mlp_data()
    result = strategy.optimize(model, data, epochs=EPOCHS, batch_size=BATCH)
    # Each stage's tensors by logical name, gathered to compare with one process.
    with strategy.gathered_parameters() as params:
        tensors = {name: np.array(model.layout.view(params, name))
                   for name in model.layout.names}
    every = config.groups.pp.allgather(tensors)
    config.free()
    merged = {}
    for part in every:
        merged.update(part)
    return merged, np.array(result.losses)


def flat_digest(tensors, losses):
    """SHA-256 of the tensors in the whole model's order, and of the losses."""
    names = sorted(tensors, key=_layer_order)
    return digest(np.concatenate([tensors[n].reshape(-1) for n in names]), losses)


def _layer_order(name):
    head, _, rest = name.partition(".")
    return (int(head), rest) if head.isdigit() else (-1, name)


PIPE_LAYOUTS = [(pp, WORLD // pp) for pp in (1, 2, 4)
                if WORLD % pp == 0 and (BATCH // PIPE_UNIT) % (WORLD // pp) == 0] or [
    pytest.param((0, 0), marks=pytest.mark.skip(
        reason=f"no pp x dp layout of {WORLD} ranks whose dp divides the "
               f"{BATCH // PIPE_UNIT} units of {PIPE_UNIT} rows"))]
_PIPE_REFERENCE: dict = {}


def pipeline_reference(kind, dtype):
    """One process, no pipeline, one micro-batch (made once per model and dtype)."""
    key = (kind, np.dtype(dtype).name)
    if key not in _PIPE_REFERENCE:
        _PIPE_REFERENCE[key] = flat_digest(*train_pipeline(MPI.COMM_SELF, 1, kind, dtype,
                                                           "1f1b", "ddp"))
    return _PIPE_REFERENCE[key]


@pytest.mark.mpi
@pytest.mark.parametrize("micro", [1, 2, 4])
@pytest.mark.parametrize("layout", PIPE_LAYOUTS, ids=lambda t: f"pp{t[0]}-dp{t[1]}")
@pytest.mark.parametrize("schedule, data_parallel, kind, dtype", [
    ("1f1b", "ddp", "gpt", np.float32),
    ("gpipe", "zero2", "gpt", np.float64),
    ("gpipe", "ddp", "mlp", np.float64),
])
def test_pipeline_same_bits_as_one_process(layout, micro, schedule, data_parallel, kind,
                                           dtype):
    """Any pipeline size, schedule and micro-batch count (a pass of up to ``micro``
    units; fewer where a rank holds fewer) gives the one-process bits."""
    pp, dp = layout
    if BATCH % (dp * micro):
        # optimize() cuts a global batch into dp x micro_batches equal parts of rows,
        # in reproducible mode too (a rank's pass could run fewer units instead).
        pytest.skip(f"{BATCH} rows do not split into {dp} data-parallel ranks x {micro} "
                    f"micro-batches (optimize() cuts the batch into equal parts)")
    reference = pipeline_reference(kind, dtype)
    mine = train_pipeline(MPI.COMM_WORLD, pp, kind, dtype, schedule, data_parallel,
                          micro=micro)
    assert len(mine[1]) == 30
    assert flat_digest(*mine) == reference


def train_pipeline_unequal(comm, pp, data_parallel, micro, empty=False):
    """5 steps of ``backward`` on rows of the global batch given by hand, the
    data-parallel ranks holding unequal units (8 units: 5 and 3 at 2 ranks; 3, 2,
    2, 1 at 4; ``empty``: the last rank none, its share to the first); the
    tensors by name (gathered) and the losses."""
    config = ShardingConfiguration(comm, pipeline_parallel_size=pp, reproducible=True,
                                   unit_rows=PIPE_UNIT)
    model = HybridShardedModel(pipeline_factory("gpt", np.float64), config,
                               micro_batches=micro, schedule="1f1b")
    strategy = HybridShardedOptimizer(AdamW(lr=1e-2, weight_decay=0.01), config,
                                      data_parallel=data_parallel, model=model,
                                      max_grad_norm=0.5)
    dp, units = config.groups.dp, BATCH // PIPE_UNIT
    counts = [units // dp.size] * dp.size
    if dp.size > 1:
        moved = counts[-1] if empty else 1
        counts[0] += moved
        counts[-1] -= moved
    lo = sum(counts[:dp.rank]) * PIPE_UNIT
    hi = lo + counts[dp.rank] * PIPE_UNIT
    x, y = token_data()
    losses = []
    for step in range(5):
        xs, ys = x[step * BATCH:(step + 1) * BATCH], y[step * BATCH:(step + 1) * BATCH]
        strategy.backward(xs[lo:hi], ys[lo:hi], batch_start=lo, global_rows=BATCH)
        losses.append(strategy.step())
    with strategy.gathered_parameters() as params:
        tensors = {name: np.array(model.layout.view(params, name))
                   for name in model.layout.names}
    merged = {}
    for part in config.groups.pp.allgather(tensors):
        merged.update(part)
    config.free()
    return merged, np.array(losses)


@pytest.mark.mpi
@pytest.mark.parametrize("micro, empty", [(2, False), (4, False), (4, True)])
@pytest.mark.parametrize("data_parallel", ["zero3", "zero2"])
@pytest.mark.parametrize("layout", PIPE_LAYOUTS, ids=lambda t: f"pp{t[0]}-dp{t[1]}")
def test_pipeline_unequal_units_same_bits(layout, data_parallel, micro, empty):
    """Ranks holding unequal units, a rank none (rows given to backward by hand):
    ZeRO-3 gathers the stage's parameters over the data group inside the passes,
    so every rank runs the passes of the most units any holds (stand-ins of zeros
    for its missing ones); the bits are one process's."""
    pp, _ = layout
    reference = flat_digest(*train_pipeline_unequal(MPI.COMM_SELF, 1, "ddp", 1))
    mine = train_pipeline_unequal(MPI.COMM_WORLD, pp, data_parallel, micro, empty)
    assert flat_digest(*mine) == reference


@batch_splits(BATCH)
# --- a checkpoint written at one size and resumed at another ---------------------------
@pytest.mark.mpi(min_size=2)
def test_restart_at_another_size_gives_the_same_bits(mpi_tmp_path):
    from mpishard.checkpoint import CheckpointManager, load_checkpoint

    world = MPI.COMM_WORLD
    whole = train(MPI.COMM_SELF, "ddp", "mlp", np.float32, 1, 0.5)
    # Stop at a seeded random step, on all ranks with ZeRO-2 ...
    stop = int(np.random.default_rng(WORLD).integers(3, 27))
    folder = os.path.join(str(mpi_tmp_path), "repro")
    config = ShardingConfiguration(world, reproducible=True)
    net = MLP([6, 16, 16, 4], activation="tanh", dtype=np.float32, seed=5)
    strategy = make_strategy("zero2-reduce_scatter", config, max_grad_norm=0.5)
    first = strategy.optimize(net, mlp_data(), epochs=EPOCHS, batch_size=BATCH,
                              checkpoints=CheckpointManager(folder, keep=2), max_steps=stop)
    assert first.last_step == stop
    config.free()
    # ... and resume in one process (DDP), then once more at full size from its end.
    losses = list(first.losses)
    if world.rank == 0:
        config = ShardingConfiguration(MPI.COMM_SELF, reproducible=True)
        net = MLP([6, 16, 16, 4], activation="tanh", dtype=np.float32, seed=99)
        strategy = make_strategy("ddp", config, max_grad_norm=0.5)
        load_checkpoint(first.checkpoint, net, strategy)
        second = strategy.optimize(net, mlp_data(), epochs=EPOCHS, batch_size=BATCH,
                                   checkpoints=CheckpointManager(folder, keep=2),
                                   max_steps=stop + 2)
        config.free()
        info = (second.checkpoint, list(second.losses))
    else:
        info = None
    path, more = world.bcast(info, root=0)
    losses += more
    config = ShardingConfiguration(world, reproducible=True)
    net = MLP([6, 16, 16, 4], activation="tanh", dtype=np.float32, seed=99)
    strategy = make_strategy("ddp", config, max_grad_norm=0.5)
    load_checkpoint(path, net, strategy)
    rest = strategy.optimize(net, mlp_data(), epochs=EPOCHS, batch_size=BATCH)
    losses += rest.losses
    config.free()
    assert digest(net.params, losses) == whole[:2]


# (strategy, model, dtype, accumulation_steps, max_grad_norm, unit_rows): the
# MLP's 24 units and the GPT's 3 units of 16 rows over 3 ranks (tests/jobs/test_three_ranks.py).
CASES3 = [
    ("zero2-reduce_scatter", "mlp", np.float32, 2, 0.5, None),
    ("ddp", "gpt", np.float64, 1, 0.5, 16),
]


@batch_splits(BATCH)
@pytest.mark.mpi
@pytest.mark.parametrize("kind, dtype", [("ddp", np.float32), ("zero2-reduce_scatter", np.float64)])
def test_short_last_batch_same_bits_as_one_process(kind, dtype):
    """drop_last=False: the short last batch (37 rows: one default unit, cut by any
    split over 2 or more ranks) runs in units of one row, the same bits at any size."""
    def run(comm):
        config = ShardingConfiguration(comm, reproducible=True)
        net = MLP([6, 16, 4], activation="tanh", dtype=dtype, seed=5)
        strategy = make_strategy(kind, config, max_grad_norm=0.5)
        result = strategy.optimize(net, mlp_data(2 * BATCH + 37), epochs=2, batch_size=BATCH,
                                   drop_last=False)
        assert result.steps == 6 and result.samples == 2 * (2 * BATCH + 37)
        out = digest(np.array(net.params), result.losses)
        config.free()
        return out
    assert run(MPI.COMM_WORLD) == run(MPI.COMM_SELF)


if __name__ == "__main__":      # pragma: no cover
    sys.exit(pytest.main([__file__]))
