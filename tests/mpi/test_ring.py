"""RingComm (mpishard.comm.ring) against the group's own MPI collectives.

Run under ``mpirun -n N python -m pytest --with-mpi`` for N = 1, 2, 3, 4 (3: pieces
of unequal length). On 1 and 2 ranks every element is a sum of at most two
numbers, so the ring must give MPI's bits exactly; on more ranks it adds in its
own fixed order, so it is compared to rtol 1e-12 (float64) / 1e-5 (float32),
and two runs of it must agree bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from mpishard import ShardingConfiguration
from mpishard.comm import FlatComm
from mpishard.comm.hierarchical import choose
from mpishard.comm.ring import RING_MIN_ELEMENTS, RingComm
from mpishard.comm.timing import agree_on_fastest
from mpishard.flat import shard_ranges
from mpishard.nn import MLP
from mpishard.optim import SGD
from mpishard.parallel.zero2 import REDUCE_METHODS
from mpishard.strategies import DDPOptimizer, ZeRO2Optimizer

pytestmark = pytest.mark.mpi

LENGTHS = [1, 3, 7, 1000, 12345]      # 1 and 3: ranks with empty pieces at 4 ranks
DTYPES = {"float64": (np.float64, 1e-12), "float32": (np.float32, 1e-5)}


@pytest.fixture(scope="module")
def group():
    g = FlatComm(MPI.COMM_WORLD.Dup(), "test")
    yield g
    g.free()


def check(actual, expected, rtol, size, what):
    if size <= 2:
        np.testing.assert_array_equal(actual, expected, err_msg=what)
    else:
        np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol, err_msg=what)


def data(n, dtype, rank, seed=0):
    return np.random.default_rng(seed + 97 * rank).standard_normal(n).astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", LENGTHS)
def test_allreduce_equals_mpi(group, n, dtype):
    dt, rtol = DTYPES[dtype]
    ring = RingComm(group)
    x = data(n, dt, group.rank)
    expected = x.copy()
    group.Allreduce(expected)
    for blocking in (True, False):
        mine = x.copy()
        if blocking:
            ring.Allreduce(mine)
        else:
            ring.Iallreduce(mine, slot=1).wait()
        check(mine, expected, rtol, group.size, f"allreduce of {n}, blocking={blocking}")
    again = x.copy()
    ring.Allreduce(again)
    np.testing.assert_array_equal(again, mine)      # its own order, every time
    ring.free()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", LENGTHS)
def test_reduce_scatter_equals_mpi(group, n, dtype):
    dt, rtol = DTYPES[dtype]
    ring = RingComm(group)
    x = data(n, dt, group.rank)
    x.flags.writeable = False                          # the send buffer is only read
    counts = [len(r) for r in shard_ranges(n, group.size)]
    expected = np.empty(counts[group.rank], dt)
    group.Reduce_scatter(x, expected, counts)
    for blocking in (True, False):
        got = np.full(counts[group.rank], np.nan, dt)
        if blocking:
            ring.Reduce_scatter(x, got, counts)
        else:
            ring.Ireduce_scatter(x, got, counts, slot=2).wait()
        check(got, expected, rtol, group.size, f"reduce-scatter of {n}, blocking={blocking}")
    ring.free()


def test_unequal_counts_and_empty_pieces(group):
    # ZeRO-2 buckets: per-rank pieces of any length, zero included.
    ring = RingComm(group)
    counts = [(3 * r + 1) % 4 for r in range(group.size)]        # 1, 0, 3, 2, ...
    n = sum(counts)
    x = data(n, np.float64, group.rank, seed=5)
    expected = np.empty(counts[group.rank])
    group.Reduce_scatter(x, expected, counts)
    got = np.empty(counts[group.rank])
    ring.Reduce_scatter(x, got, counts)
    check(got, expected, 1e-12, group.size, "unequal counts")
    with pytest.raises(ValueError, match=f"expecting {group.size} counts, got"):
        ring.Reduce_scatter(x, got, counts + [0])
    ring.free()


def test_calls_in_flight_complete_in_any_order(group):
    # Buckets launched one after the other, polled at rank-dependent moments and
    # waited in reverse: each call's messages must find their own call.
    ring = RingComm(group)
    rng = np.random.default_rng(11 + group.rank)
    xs = [rng.standard_normal(n) for n in (3000, 5, 2000, 777, 4096, 1)]
    flats = [x.copy() for x in xs]
    for f in flats:
        group.Allreduce(f)
    outs = [x.copy() for x in xs]
    shards = [np.zeros(len(shard_ranges(x.size, group.size)[group.rank])) for x in xs]
    handles = []
    for i, (x, out) in enumerate(zip(xs, outs)):
        if i % 2:
            counts = [len(r) for r in shard_ranges(x.size, group.size)]
            handles.append(ring.Ireduce_scatter(out, shards[i], counts, slot=("rs", i)))
        else:
            handles.append(ring.Iallreduce(out, slot=("ar", i)))
        if (i + group.rank) % 3 == 0:
            handles[0].test()
    for h in reversed(handles):
        h.wait()
    for i, (out, f) in enumerate(zip(outs, flats)):
        if i % 2:
            mine = shard_ranges(f.size, group.size)[group.rank]
            check(shards[i], f[mine.start:mine.stop], 1e-12, group.size, f"in flight {i}")
        else:
            check(out, f, 1e-12, group.size, f"in flight {i}")
    ring.free()


def test_choose_tries_the_ring_on_large_buckets_only(group):
    small = {}
    assert choose(group, RING_MIN_ELEMENTS - 1, np.float64, np, record=small) is group
    assert small["ring"] is None and small["choice"] == "flat", small
    record = {}
    chosen = choose(group, RING_MIN_ELEMENTS, np.float64, np, record=record)
    assert record["choice"] in ("flat", "hierarchical", "ring"), record
    assert (chosen is group) == (record["choice"] == "flat"), record
    if group.size > 1:
        assert record["flat"] > 0 and record["ring"] > 0, record
    x = data(1000, np.float64, group.rank, seed=3)
    expected = x.copy()
    group.Allreduce(expected)
    chosen.Allreduce(x)
    check(x, expected, 1e-12, group.size, f"chosen {record['choice']}")
    if chosen is not group:
        chosen.free()


def test_zero2_uses_the_ring_only_as_its_reduce_method():
    # ZeRO-2's ring is reduce_method="ring" (measured by "auto"); a pinned MPI
    # method keeps MPI's calls even on buckets large enough for the ring, so that
    # pinning it keeps MPI's order of addition from run to run. DDP measures the
    # ring in choose() (no reduce_method of its own).
    sizes = [512, 520, 10]                     # 271,890 parameters: one bucket >= the minimum
    for method in ("reduce_scatter", "allreduce", "ring"):
        model = MLP(sizes, dtype=np.float32, seed=0)
        assert model.params.size >= RING_MIN_ELEMENTS
        zero = ZeRO2Optimizer(SGD(lr=0.1), ShardingConfiguration(MPI.COMM_WORLD), model=model,
                              reduce_method=method)
        assert isinstance(zero.reducer, RingComm) == (method == "ring"), (method, zero.reducer)
        assert zero.reduction_timings.get("ring") is None or method == "ring"
    ddp = DDPOptimizer(SGD(lr=0.1), ShardingConfiguration(MPI.COMM_WORLD),
                       model=MLP(sizes, dtype=np.float32, seed=0))
    record = ddp.reduction_timings
    if MPI.COMM_WORLD.size > 1:
        assert record["ring"] > 0 and record["flat"] > 0, record
    assert isinstance(ddp.reducer, RingComm) == (record["choice"] == "ring"), record


def test_agree_on_fastest_never_chooses_a_way_nobody_measured(group):
    # ZeRO-2's agreed reduce_method: a job whose buckets (or device arrays) never
    # measured the ring must not take it for its 0.
    assert agree_on_fastest(group, {"reduce_scatter": 2.0, "allreduce": 3.0},
                            REDUCE_METHODS, "reduce_scatter") == "reduce_scatter"
    assert agree_on_fastest(group, {}, REDUCE_METHODS, "allreduce") == "allreduce"
    # Only rank 0 measured the ring: it is a candidate, timed by rank 0.
    times = {"reduce_scatter": 2.0, "allreduce": 3.0}
    if group.rank == 0:
        times["ring"] = 1.0
    assert agree_on_fastest(group, times, REDUCE_METHODS, "reduce_scatter") == "ring"
