"""A NaN or infinite loss or gradient in one rank's batch: raised everywhere, or skipped.

Run under ``mpirun -n N python -m pytest --with-mpi`` for N = 1, 2, 4. At step
``K`` the batch of one rank (two ranks, 1 and 3, at 4 ranks) is poisoned: a
model that returns a NaN gradient with a finite loss (a :class:`FunctionModel`,
whose local gradient is checked before it is reduced), or an MLP whose loss
overflows to infinity on a target of 1e200 (a bucketed library model, named
by its local loss). Clipping is active throughout, so a clip coefficient that
hid NaN (``min(1.0, nan)`` is 1.0) would show as NaN parameters. Each test
checks numbers against a reference: the parameters before the step, or one
process training on the global batches with step ``K`` left out (float64,
rtol 1e-10). Each in the default mode and in reproducible mode (its binned
words path; its float path for one strategy), which finds a unit's non-finite
gradient where the units are summed.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from mpi4py import MPI
from reference import train_serial
from strategies import STRATEGIES, whole

from mpishard import NonFiniteError, ShardingConfiguration
from mpishard.nn import MLP, FunctionModel
from mpishard.optim import AdamW
from mpishard.strategies import DDPOptimizer

pytestmark = [pytest.mark.mpi,
              # The poisoned target overflows on purpose (the loss, then the norm).
              pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")]

K = 3             # the 1-based step whose batch is poisoned
STEPS = 6
PER_RANK = 6
MARK = 1234.5     # a first input column of MARK makes the FunctionModel's gradient NaN


def bad_ranks(size):
    return [1, 3] if size >= 4 else [size - 1]


def least_squares(p, x, y):
    """Mean squared residual; its gradient is NaN for a batch holding a marked row."""
    r = x @ p - y
    grad = 2.0 * x.T @ r / len(y)
    if np.any(x[:, 0] == MARK):
        grad[1] = np.nan            # the loss stays finite: only the gradient is bad
    return float(r @ r / len(y)), grad


def make_function_model():
    return FunctionModel(least_squares, np.linspace(-1.0, 1.0, 5))


def make_mlp():
    return MLP([5, 7, 1], activation="tanh", loss="mse", dtype=np.float64, seed=3)


def global_batch(step, size, kind):
    """Rows of every rank for ``step`` (1-based); rank r holds rows
    ``[r * PER_RANK, (r + 1) * PER_RANK)``. At step K the bad ranks' rows are poisoned."""
    rng = np.random.default_rng([7, step])
    n = size * PER_RANK
    x = rng.standard_normal((n, 5))
    y = x @ np.arange(1.0, 6.0) + 0.1 * rng.standard_normal(n)
    if step == K:
        for r in bad_ranks(size):
            if kind == "nan-gradient":
                x[r * PER_RANK + 1, 0] = MARK
            else:
                y[r * PER_RANK + 2] = 1e200      # (out - y)^2 overflows: an infinite loss
    return x, y


def mine(batch, rank):
    x, y = batch
    return x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK]


MODELS = {"nan-gradient": make_function_model, "inf-loss": make_mlp}


#: The default mode, and reproducible mode with units of one row (6 a rank each
#: step: the binned words path) and of three (2 a rank: the float path).
MODES = {"default": {}, "repro-words": {"reproducible": True, "unit_rows": 1},
         "repro-floats": {"reproducible": True, "unit_rows": 3}}

#: (strategy, mode): each strategy in the default and the words mode; the float
#: path (the same code of mpishard.parallel.repro for every strategy, over its data
#: group's ranges) for one sharded strategy.
FLOATS = "zero2-reduce_scatter"
assert FLOATS in STRATEGIES, list(STRATEGIES)
STRATEGY_MODES = [(s, m) for s in STRATEGIES for m in MODES if m != "repro-floats" or s == FLOATS]


def build(strategy, kind, comm, mode="default", **kw):
    model = MODELS[kind]()
    dist = STRATEGIES[strategy](AdamW(lr=0.05, weight_decay=0.01),
                                ShardingConfiguration(comm, **MODES[mode]),
                                model=model, max_grad_norm=1.0, bucket_mb=1e-5,
                                accumulation_steps=2, **kw)
    return model, dist


@pytest.mark.parametrize("strategy,mode", STRATEGY_MODES)
@pytest.mark.parametrize("kind", MODELS)
def test_raises_on_every_rank_naming_step_and_rank(strategy, kind, mode):
    comm = MPI.COMM_WORLD
    model, dist = build(strategy, kind, comm, mode)
    for step in range(1, K):
        dist.train_step(*mine(global_batch(step, comm.size, kind), comm.rank))
    before = whole(dist)
    state = {name: value.copy() for name, value in dist.state.items()}
    with pytest.raises(NonFiniteError) as info:
        dist.train_step(*mine(global_batch(K, comm.size, kind), comm.rank))
    err, first = info.value, bad_ranks(comm.size)[0]
    assert (err.step, err.rank, err.world_rank) == (K, first, first)
    what = "loss" if kind == "inf-loss" else "gradient norm"
    assert f"step {K}: non-finite {what}" in str(err)
    assert f"data-parallel rank {first} (world rank {first})" in str(err)
    # Nothing was updated, on any rank.
    np.testing.assert_array_equal(whole(dist), before)
    for name, value in dist.state.items():
        np.testing.assert_array_equal(value, state[name], err_msg=name)
    assert dist.step_count == K - 1 and dist.skipped_steps == 0
    # The strategy goes on from there with the next batch.
    assert math.isfinite(dist.train_step(*mine(global_batch(K + 1, comm.size, kind), comm.rank)))
    assert dist.step_count == K and np.all(np.isfinite(whole(dist)))
    dist.verify_in_sync()


def serial_skipping(kind, size):
    """One process on the global batches, the poisoned step K left out (``reference``)."""
    run = train_serial(MODELS[kind](), AdamW(lr=0.05, weight_decay=0.01),
                       (global_batch(step, size, kind) for step in range(1, STEPS + 1)
                        if step != K), max_grad_norm=1.0)
    assert np.any(run.norms + 1e-6 > 1.0)          # clipping was active
    return run.params


@pytest.mark.parametrize("strategy,mode", STRATEGY_MODES)
@pytest.mark.parametrize("kind", MODELS)
def test_skip_leaves_the_step_out_on_every_rank(strategy, kind, mode):
    comm = MPI.COMM_WORLD
    model, dist = build(strategy, kind, comm, mode, nonfinite="skip")
    losses = [dist.train_step(*mine(global_batch(step, comm.size, kind), comm.rank))
              for step in range(1, STEPS + 1)]
    assert dist.skipped_steps == 1 and dist.step_count == STEPS - 1
    assert math.isfinite(losses[K - 1]) == (kind == "nan-gradient")
    assert all(math.isfinite(v) for i, v in enumerate(losses) if i != K - 1)
    np.testing.assert_allclose(whole(dist), serial_skipping(kind, comm.size),
                               rtol=1e-10, atol=1e-12)
    dist.verify_in_sync()


def test_unknown_policy_raises_everywhere():
    with pytest.raises(ValueError, match="nonfinite must be one of"):
        DDPOptimizer(AdamW(lr=0.1), ShardingConfiguration(MPI.COMM_WORLD), nonfinite="ignore")
