"""Models with fewer parameters than data-parallel ranks: empty ZeRO shards.

Issue 21, finding 1: zero-length shards and optimizer state at any rank must be
fine everywhere. A float64 model of 2 or 3 parameters (a ``FunctionModel``, whose
strategy reduces its whole gradient after the backward, and a one-layer ``MLP``,
bucketed, whose ZeRO-3 parameters are gathered from the shards) is trained with
``optimize()`` by DDP, ZeRO-2 (both reduce methods) and ZeRO-3 (prefetch on, off,
gathered kept), and compared with one process training on the same global
batches in the same test: losses, parameters and the clipped norm (rtol 1e-10),
the bits in reproducible mode, the non-finite policies, the memory report (an
empty shard holds no state), checkpoints resharded from and to other world
sizes. At 4 ranks (3 where the model has 2 parameters) some shards are empty;
at 1 and 2 ranks the same tests run with no empty shard.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from mpi4py import MPI
from reference import sampler_batches, train_serial
from worlds import batch_splits

from mpishard import NonFiniteError, ShardingConfiguration
from mpishard.checkpoint import load_checkpoint, save_checkpoint
from mpishard.data import ShardedSampler
from mpishard.nn import MLP, FunctionModel
from mpishard.optim import Adam
from mpishard.strategies import DDPOptimizer, ZeRO2Optimizer, ZeRO3Optimizer

WORLD = MPI.COMM_WORLD
ROWS, BATCH, CLIP = 48, 12, 0.05
pytestmark = [pytest.mark.mpi, batch_splits(BATCH)]
STEPS = 2 * ROWS // BATCH        # two epochs; 12 rows split over 1, 2, 3 or 4 ranks
#: (class, options) by id; ZeRO's reduce method pinned (not measured).
STRATEGIES = {
    "ddp": (DDPOptimizer, {}),
    "zero2-reduce_scatter": (ZeRO2Optimizer, {"reduce_method": "reduce_scatter"}),
    "zero2-allreduce": (ZeRO2Optimizer, {"reduce_method": "allreduce"}),
    "zero3": (ZeRO3Optimizer, {"reduce_method": "reduce_scatter"}),
    "zero3-no-prefetch": (ZeRO3Optimizer, {"reduce_method": "allreduce", "prefetch": False}),
    "zero3-keep": (ZeRO3Optimizer, {"reduce_method": "reduce_scatter", "keep_gathered": True}),
}
MODELS = ["function-2", "function-3", "mlp-2", "mlp-3"]


def least_squares(params, x, y):
    """Mean squared error of ``x @ params`` and its gradient."""
    x = x[:, :params.size]
    r = x @ params - y
    return float(np.mean(r * r)), 2.0 * (x.T @ r) / len(x)


def make(name: str):
    kind, n = name.split("-")
    if kind == "function":
        return FunctionModel(least_squares, np.linspace(-1.0, 1.0, int(n)))
    return MLP([int(n) - 1, 1], loss="mse", dtype=np.float64, seed=3)   # weights and a bias


def data(name: str, nan_row: int | None = None):
    rng = np.random.default_rng(6)
    x = rng.standard_normal((ROWS, 3))
    y = x @ np.array([0.5, -2.0, 1.0]) + 0.1 * rng.standard_normal(ROWS)
    if name.startswith("mlp"):
        x, y = x[:, :int(name[-1]) - 1], y[:, None]
    if nan_row is not None:
        x[nan_row, 0] = np.nan
    return x, y


def serial(name: str, steps: int = STEPS, clip: float | None = CLIP,
           skip: frozenset = frozenset(), x_y=None):
    """The model trained by one process (support/reference) on the first ``steps``
    global batches of ``optimize`` (seed 0); the batches in ``skip`` are left out
    (they update nothing and do not count as steps). Returns (model, losses, norms)."""
    x, y = x_y if x_y is not None else data(name)
    batches = [b for k, b in enumerate(sampler_batches(x, y, BATCH, steps=steps))
               if k not in skip]
    run = train_serial(make(name), Adam(lr=0.05), batches, max_grad_norm=clip)
    return run.model, run.losses, run.norms


def strategy_options(name: str, which: str) -> dict:
    """The options of ``which``; ZeRO-3's gather options only for a model it gathers."""
    fixed = STRATEGIES[which][1]
    if which.startswith("zero3") and name.startswith("function"):
        return {"reduce_method": fixed["reduce_method"]}
    return fixed


def strategy(comm, name: str, which: str, reproducible: bool = False, **options):
    """A fresh model and the strategy ``which`` over ``comm``, attached."""
    model = make(name)
    # Under a timeout: a rank left behind in a collective fails instead of hanging.
    config = ShardingConfiguration(comm, reproducible=reproducible, timeout=300)
    return model, STRATEGIES[which][0](Adam(lr=0.05), config, model=model,
                                       **strategy_options(name, which), **options)


def params_of(opt) -> np.ndarray:
    with opt.gathered_parameters() as params:
        return np.array(params)


def empty_shards(opt, comm) -> int:
    """How many ranks of ``comm`` hold an empty shard of the optimizer state."""
    return comm.allreduce(int(len(opt.optimizer_state_shard()[0]) == 0))


#: (model, overlap): a FunctionModel has no backward hooks, so it is reduced after
#: the backward whatever ``overlap`` says: one case.
OVERLAPS = [(name, overlap) for name in MODELS
            for overlap in ([True, False, "auto"] if name.startswith("mlp") else ["auto"])]


@pytest.mark.parametrize("which", list(STRATEGIES))
@pytest.mark.parametrize("name, overlap", OVERLAPS)
def test_small_model_trains_like_one_process(name, which, overlap):
    whole, ref_losses, norms = serial(name)
    ref_norm = norms[-1]
    model, opt = strategy(WORLD, name, which, max_grad_norm=CLIP, overlap=overlap)
    result = opt.optimize(model, data(name), epochs=2, batch_size=BATCH)
    np.testing.assert_allclose(result.losses, ref_losses, rtol=1e-10)
    params = params_of(opt)
    opt.verify_in_sync()
    # Empty shards where there are more ranks than parameters; each holds no state,
    # and the shards' state adds up to Adam's two vectors of the whole model.
    # (The collectives first, before any rank's own assert can fail.)
    n = whole.params.size
    shard, state = opt.optimizer_state_shard()
    report = opt.memory_report()
    empty, total = empty_shards(opt, WORLD), WORLD.allreduce(report["optimizer_state"])
    np.testing.assert_allclose(params, whole.params, rtol=1e-10)
    assert opt.last_grad_norm > CLIP
    np.testing.assert_allclose(opt.last_grad_norm, ref_norm, rtol=1e-10)
    assert report["optimizer_state"] == 2 * len(shard) * 8
    if which != "ddp":
        assert empty == max(0, WORLD.size - n)
        assert total == 2 * n * 8
        if which.startswith("zero3") and name.startswith("mlp"):
            assert report["parameters"] == len(shard) * 8      # the shard, empty or not


@pytest.mark.parametrize("which", list(STRATEGIES))
@pytest.mark.parametrize("name", MODELS)
def test_small_model_reproducible_bits_of_one_process(name, which):
    # Reproducible mode: the bits of DDP on one process.
    self_model = make(name)
    self_opt = DDPOptimizer(Adam(lr=0.05), ShardingConfiguration(MPI.COMM_SELF,
                                                                 reproducible=True),
                            model=self_model, max_grad_norm=CLIP)
    ref = self_opt.optimize(self_model, data(name), epochs=2, batch_size=BATCH)
    model, opt = strategy(WORLD, name, which, reproducible=True, max_grad_norm=CLIP)
    result = opt.optimize(model, data(name), epochs=2, batch_size=BATCH)
    assert result.losses == ref.losses
    assert np.array_equal(params_of(opt), self_model.params)
    assert opt.last_grad_norm == self_opt.last_grad_norm


@pytest.mark.parametrize("which", list(STRATEGIES))
@pytest.mark.parametrize("name", MODELS)
def test_small_model_nonfinite_step(name, which):
    # A NaN in one row of the second batch: "error" raises on every rank and changes
    # nothing; "skip" trains as one process that leaves that batch out.
    sampler = ShardedSampler(ROWS, BATCH, seed=0)
    sampler.advance()
    x_y = data(name, nan_row=int(sampler.batch_indices(0, BATCH)[5]))
    model, opt = strategy(WORLD, name, which, nonfinite="error")
    with pytest.raises(NonFiniteError, match="step 2: non-finite"):
        opt.optimize(model, x_y, epochs=1, batch_size=BATCH)
    assert opt.step_count == 1
    once, _, _ = serial(name, steps=1, clip=None)
    np.testing.assert_allclose(params_of(opt), once.params, rtol=1e-10)

    model, opt = strategy(WORLD, name, which, nonfinite="skip")
    result = opt.optimize(model, x_y, epochs=1, batch_size=BATCH)
    whole, ref_losses, _ = serial(name, steps=ROWS // BATCH, clip=None, skip=frozenset({1}),
                                  x_y=x_y)
    assert opt.skipped_steps == 1 and opt.step_count == ROWS // BATCH - 1
    assert math.isnan(result.losses[1])
    np.testing.assert_allclose(np.delete(result.losses, 1), ref_losses, rtol=1e-10)
    np.testing.assert_allclose(params_of(opt), whole.params, rtol=1e-10)


def _train_part(ranks: int, name: str, which: str, load_from=None, save_to=None):
    """One epoch (the second when resuming) on the first ``ranks`` ranks; the strategy."""
    sub = WORLD.Split(0 if WORLD.rank < ranks else MPI.UNDEFINED, WORLD.rank)
    if sub == MPI.COMM_NULL:
        return None
    model, opt = strategy(sub, name, which, max_grad_norm=CLIP)
    if load_from is not None:
        info = load_checkpoint(load_from, model, opt)
        assert info.step == opt.step_count == ROWS // BATCH
    opt.optimize(model, data(name), epochs=1 if load_from is None else 2, batch_size=BATCH)
    if save_to is not None:
        save_checkpoint(save_to, model, opt)
    sub.Free()
    return opt


#: (writer ranks, kind) -> (reader ranks, kind): out of and into the world's empty
#: shards, and between two world sizes that both have some.
#: The other world: the most ranks below the world's over which the batch splits.
OTHER = max([k for k in range(1, WORLD.size) if BATCH % k == 0], default=1)
CONVERSIONS = [((WORLD.size, "zero2-reduce_scatter"), (1, "ddp")),
               ((1, "ddp"), (WORLD.size, "zero3")),
               ((WORLD.size, "zero3"), (OTHER, "zero2-allreduce")),
               ((OTHER, "zero3-keep"), (WORLD.size, "zero3"))]


@pytest.mark.parametrize("writer,reader", CONVERSIONS,
                         ids=[f"{a}-on-{m}-to-{b}-on-{k}" for (m, a), (k, b) in CONVERSIONS])
@pytest.mark.parametrize("name", ["function-2", "mlp-3"])
def test_small_model_checkpoint_resharded(name, writer, reader, tmp_path_factory):
    folder = WORLD.bcast(str(tmp_path_factory.mktemp("shards")) if WORLD.rank == 0 else None)
    path = f"{folder}/small.h5"
    whole, _, _ = serial(name)
    _train_part(writer[0], name, writer[1], save_to=path)
    WORLD.Barrier()
    opt = _train_part(reader[0], name, reader[1], load_from=path)
    if opt is not None:          # two epochs in total, like the one process
        np.testing.assert_allclose(params_of(opt), whole.params, rtol=1e-10)
    WORLD.Barrier()
