"""Global batches cut into unequal pieces, one a rank (zero rows included).

Every step, the 24 rows of a global batch are cut into unequal pieces (2 ranks:
10 and 14; 3 ranks, a sub-communicator of a 4-rank world: 7, 4, 13; 4 ranks: 9,
0, 8, 7), the sizes rotating over the ranks from step to step. The reference is
one process training on the 24 rows (``reference.train_serial``). Used by
``tests/mpi/test_unequal.py`` (every strategy of the registry) and
``tests/mpi/test_zero3.py`` (ZeRO-3's own options).
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI
from reference import train_serial
from worlds import written_for

__all__ = ["COUNTS", "MAX_NORM", "ROWS", "STEPS", "any_comm_fixture", "comm_fixture",
           "global_batch", "my_rows", "serial_reference", "train"]

ROWS = 24
COUNTS = {1: [24], 2: [10, 14], 3: [7, 4, 13], 4: [9, 0, 8, 7]}
STEPS = 10
MAX_NORM = 0.1    # below every gradient norm of these runs: clipping is always active


def global_batch(step, n=ROWS):
    rng = np.random.default_rng([11, step])
    x = rng.standard_normal((n, 5))
    w = rng.standard_normal((5, 3))
    y = np.argmax(x @ w + 0.3 * rng.standard_normal((n, 3)), axis=1)
    return x, y


def my_rows(size, rank, step):
    """This rank's rows of step ``step``: counts rotate over the ranks (skips at a
    size the counts are not written for)."""
    base = written_for(COUNTS, size, "the unequal pieces (COUNTS)")
    counts = [base[(r + step) % size] for r in range(size)]
    lo = sum(counts[:rank])
    return lo, lo + counts[rank]


def serial_reference(make_model, make_opt, steps=STEPS, max_grad_norm=MAX_NORM, context=False,
                     batch=global_batch):
    """One process on all 24 rows of every step, the optimizer called directly
    (``reference``): the parameters, losses and gradient norms."""
    run = train_serial(make_model(), make_opt(), (batch(step) for step in range(steps)),
                       max_grad_norm=max_grad_norm, batch_context=context)
    return run.params, run.losses, run.norms


def train(dist, group, mode="plain", steps=STEPS, context=False, batch=global_batch):
    """The distributed run: this rank's unequal piece of each global batch; the
    global losses. ``mode``: ``"plain"`` or ``"accumulation"`` (``train_step``, the
    piece split unevenly over the strategy's micro-batches), ``"no_sync"`` (two
    unequal micro-batches, the first without communication)."""
    losses = []
    for step in range(steps):
        x, y = batch(step)
        lo, hi = my_rows(group.size, group.rank, step)
        xs, ys = x[lo:hi], y[lo:hi]
        if mode == "no_sync":
            k = (hi - lo) // 3
            with dist.no_sync():
                dist.backward(xs[:k], ys[:k], **_where(context, lo, 0, k))
            dist.backward(xs[k:], ys[k:], **_where(context, lo, k, hi - lo))
            losses.append(dist.step())
        elif context:
            m = dist.accumulation_steps
            n = hi - lo
            for j in range(m):
                a, b = j * n // m, (j + 1) * n // m
                dist.backward(xs[a:b], ys[a:b], **_where(True, lo, a, b))
            losses.append(dist.step())
        else:
            losses.append(dist.train_step(xs, ys))
    return np.array(losses)


def _where(context, lo, a, b):
    return {"batch_start": lo + a, "global_rows": ROWS} if context else {}


@pytest.fixture(name="comm", params=["world", "three-of-four"])
def comm_fixture(request):
    """The communicator a test trains on: the world, or 3 ranks of a 4-rank world
    (the fourth rank skips); at a world size COUNTS is written for."""
    yield from _communicator(request.param, counts=True)


@pytest.fixture(name="any_comm", params=["world", "three-of-four"])
def any_comm_fixture(request):
    """The same communicators at any world size, for a test that cuts its own pieces."""
    yield from _communicator(request.param, counts=False)


def _communicator(param, counts):
    world = MPI.COMM_WORLD
    if param == "world":
        if counts:
            written_for(COUNTS, world.size, "the unequal pieces (COUNTS)")
        yield world
        return
    if world.size != 4:
        pytest.skip("a 3-rank sub-communicator is taken from a 4-rank world")
    sub = world.Split(0 if world.rank < 3 else MPI.UNDEFINED, world.rank)
    if sub == MPI.COMM_NULL:
        pytest.skip("this rank is outside the 3-rank sub-communicator")
    yield sub
    sub.Free()
