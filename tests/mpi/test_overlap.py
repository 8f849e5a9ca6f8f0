"""``overlap="measure"`` (the stand-in backward, as ``"auto"`` was in 0.5): the
choice is measured, the same on every rank, and either choice trains the same as
one process on the global batch; ``"auto"``'s defaults. How ``"auto"`` decides
(records, model, budget): ``test_overlap_decision.py``.

Run under ``mpirun -n N python -m pytest --with-mpi`` (N = 1, 2, 4).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from mpi4py import MPI
from reference import sampler_batches, train_serial
from worlds import batch_splits

import mpishard.parallel.overlap as overlap
from mpishard import ShardingConfiguration
from mpishard.flat import bucket_ranges
from mpishard.nn import MLP
from mpishard.optim import Adam
from mpishard.parallel.overlap import choose_overlap, forget_decisions
from mpishard.strategies import DDPOptimizer, ZeRO2Optimizer, ZeRO3Optimizer

pytestmark = pytest.mark.mpi

STRATEGIES = {"ddp": DDPOptimizer, "zero2": ZeRO2Optimizer}
SIZES = [5, 7, 7, 3]


@pytest.fixture(autouse=True)
def _fresh_decisions():
    """Each test decides afresh (a decision is kept per layout for the process)."""
    forget_decisions()
    yield
    forget_decisions()


def make_data(n=64, features=5, classes=3, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, features))
    y = np.argmax(x @ rng.standard_normal((features, classes)), axis=1)
    return x, y


def serial_reference(make_model, data, batch_size, epochs):
    """One process, whole global batch, Adam called directly (``reference``)."""
    x, y = data
    return train_serial(make_model(), Adam(lr=3e-3),
                        sampler_batches(x, y, batch_size, epochs)).params


@batch_splits(16)
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("forced", [None, True, False])
def test_auto_choice_agreed_and_results_unchanged(strategy, forced, monkeypatch):
    comm = MPI.COMM_WORLD
    if forced is not None:
        # margin -10: "during" always wins; margin 1: never (a time is never < 0).
        margin = -10.0 if forced else 1.0
        monkeypatch.setattr(overlap, "choose_overlap",
                            functools.partial(choose_overlap, margin=margin))
    data = make_data()
    make_model = functools.partial(MLP, SIZES, activation="tanh", dtype=np.float64, seed=7)
    ref = serial_reference(make_model, data, 16, epochs=2)
    model = make_model()
    # Tiny buckets: each of the 3 layers its own bucket (the stand-in runs them all).
    dist = STRATEGIES[strategy](Adam(lr=3e-3), ShardingConfiguration(comm),
                                bucket_mb=1e-4, overlap="measure")
    dist.optimize(model, data, epochs=2, batch_size=16)
    np.testing.assert_allclose(model.params, ref, rtol=1e-10, atol=1e-12)
    timings = dist.overlap_timings
    assert dist.bucketed is timings["choice"]
    if comm.size == 1:
        assert timings["choice"] is False and "one rank" in timings["reason"]
        return
    assert timings["source"] == "measured"
    # ZeRO-2 cuts its buckets inside the layers (the gradient hand-over by piece).
    assert timings["buckets"] == min(4, len(dist.buckets.ranges))
    assert len(dist.buckets.ranges) == 3 if strategy == "ddp" else len(dist.buckets.ranges) > 3
    assert timings["during"] > 0 and timings["after"] > 0 and timings["compute"] > 0
    if forced is None:
        during_wins = timings["during"] < 0.95 * timings["after"]
        assert timings["choice"] is during_wins
    else:
        assert timings["choice"] is forced
    # The same choice and the same (agreed) times on every rank.
    every = comm.allgather((dist.bucketed, timings["during"], timings["after"],
                            timings["compute"]))
    assert len(set(every)) == 1, every


def test_auto_reproducible_and_bad_value():
    comm = MPI.COMM_WORLD
    dist = DDPOptimizer(Adam(lr=1e-3), ShardingConfiguration(comm, reproducible=True),
                        model=MLP(SIZES, seed=1), overlap="auto")
    assert dist.bucketed is False
    assert dist.overlap_timings == {"choice": False, "reason": "reproducible mode"}
    with pytest.raises(ValueError,
                       match="overlap must be True, False, 'auto' or 'measure', got 'yes'"):
        DDPOptimizer(Adam(lr=1e-3), ShardingConfiguration(comm), overlap="yes")


def test_auto_with_a_data_group_without_buckets():
    # A pipeline stage of activations only has no gradient buckets: its ranks still
    # take part in every agreement over the world (measuring nothing) and choose as
    # the others do. (Before: an IndexError on that stage, the others waiting.)
    world = MPI.COMM_WORLD
    if world.size < 4 or world.size % 2:
        pytest.skip(f"two stages of 2 or more data-parallel ranks each need an even world "
                    f"of 4 or more ranks, not {world.size}")
    config = ShardingConfiguration(world, pipeline_parallel_size=2, timeout=60)
    groups = config.groups
    model = MLP(SIZES, dtype=np.float64)
    ranges = bucket_ranges(model.layout, 20) if groups.coordinates.pp == 0 else []
    record = {}
    choice = choose_overlap(groups.dp, groups.world, ranges, np.float64, np, record=record)
    assert record["buckets"] == min(4, len(ranges))
    assert len(ranges) == (3 if groups.coordinates.pp == 0 else 0)   # one bucket a layer
    every = world.allgather((choice, record["during"], record["after"]))
    assert len(set(every)) == 1, every


def test_defaults_ddp_decides_zero_overlaps(monkeypatch):
    # Issue 21, finding 5.2: DDP's default is "auto"; ZeRO-2 and ZeRO-3 keep
    # reducing during the backward (their gradient memory needs it). Issue 34,
    # item 1: on one node with host arrays "auto" decides without the stand-in.
    calls = []
    monkeypatch.setattr(overlap, "choose_overlap",
                        lambda *a, **k: calls.append(1) or choose_overlap(*a, **k))
    comm = MPI.COMM_WORLD
    config = ShardingConfiguration(comm)
    ddp = DDPOptimizer(Adam(lr=1e-3), config, bucket_mb=1e-4,
                       model=MLP(SIZES, dtype=np.float64, seed=1))
    timings = ddp.overlap_timings
    assert ddp.bucketed is timings["choice"] is False
    assert timings["source"] == "modelled" and calls == []
    if comm.size == 1:
        assert "one rank" in timings["reason"]
    else:   # 3 tiny buckets: "too small to gain" (before "one node")
        assert timings["reason"].startswith("too small to gain"), timings
    for cls in (ZeRO2Optimizer, ZeRO3Optimizer):
        zero = cls(Adam(lr=1e-3), config, bucket_mb=1e-4,
                   model=MLP(SIZES, dtype=np.float64, seed=1))
        assert zero.bucketed is True and zero.overlap_timings == {}, cls.__name__
