"""FlatComm's buffer calls on NumPy and (where a device exists) CuPy arrays.

Run under ``mpirun -n N python -m pytest --with-mpi -m mpi`` for N = 1, 2, 4: the
tests run unchanged at any size. Each rank knows every rank's data (seeded by the
rank), so the expected result is computed here, serially, and compared exactly:
the values are small integers in float64, whose sums are exact in any order.
Each call runs over a group without a timeout (MPI's blocking calls) and with one
(the non-blocking calls waited on under the timeout).
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from mpishard import ShardingConfiguration
from mpishard.backend import to_numpy

pytestmark = pytest.mark.mpi

N = 37   # not a multiple of any world size: the pieces are uneven


def data(rank: int, n: int = N, seed: int = 0) -> np.ndarray:
    """Rank ``rank``'s contribution: integers in float64 (exact sums)."""
    return np.random.default_rng([seed, rank]).integers(-1000, 1000, n).astype(np.float64)


def uneven_counts(size: int, n: int = N) -> list[int]:
    """``n`` split over ``size`` ranks as unevenly as allowed, one rank with none."""
    counts = [n // size + (r < n % size) for r in range(size)]
    if size > 1:                       # move rank 1's share to rank 0: a zero count
        counts[0], counts[1] = counts[0] + counts[1], 0
    return counts


@pytest.fixture(params=[None, 30.0], ids=["blocking", "timed"])
def group(request):
    """The data-parallel group of the whole world, as the library builds it."""
    config = ShardingConfiguration(MPI.COMM_WORLD, timeout=request.param,
                                   abort_on_exception=False)
    yield config.groups.dp
    config.free()


def test_allreduce_sum_and_max(group, xp):
    buf = xp.asarray(data(group.rank))
    group.Allreduce(buf)
    expected = sum(data(r) for r in range(group.size))
    np.testing.assert_array_equal(to_numpy(buf), expected)
    buf = xp.asarray(data(group.rank, seed=1))
    group.Allreduce(buf, op="max")
    np.testing.assert_array_equal(
        to_numpy(buf), np.max([data(r, seed=1) for r in range(group.size)], axis=0))


def test_iallreduce_runs_finish_once_after_the_sum(group, xp):
    buf = xp.asarray(data(group.rank).reshape(1, N))    # any shape: reduced as flat
    seen = []
    handle = group.Iallreduce(buf, slot="test", finish=lambda: seen.append(to_numpy(buf).copy()))
    handle.wait()
    handle.wait()                                       # a second wait does nothing more
    expected = sum(data(r) for r in range(group.size)).reshape(1, N)
    assert len(seen) == 1
    np.testing.assert_array_equal(seen[0], expected)    # finish saw the reduced values
    np.testing.assert_array_equal(to_numpy(buf), expected)


def test_reduce_scatter_keeps_each_rank_its_piece(group, xp):
    counts = uneven_counts(group.size)
    start = sum(counts[:group.rank])
    recv = xp.full(counts[group.rank], np.nan)
    group.Reduce_scatter(xp.asarray(data(group.rank)), recv, counts)
    total = sum(data(r) for r in range(group.size))
    np.testing.assert_array_equal(to_numpy(recv), total[start:start + counts[group.rank]])


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "sendbuf"])
def test_allgatherv_places_each_piece(group, xp, in_place):
    counts = uneven_counts(group.size)
    start = sum(counts[:group.rank])
    mine = data(group.rank)[start:start + counts[group.rank]]
    buf = xp.full(N, np.nan)
    if in_place:
        buf[start:start + mine.size] = xp.asarray(mine)
        group.Allgatherv(buf, counts)
    else:
        group.Allgatherv(buf, counts, sendbuf=xp.asarray(mine))
    bounds = np.cumsum([0, *counts])
    expected = np.concatenate([data(r)[bounds[r]:bounds[r + 1]] for r in range(group.size)])
    np.testing.assert_array_equal(to_numpy(buf), expected)


def test_bcast_from_the_last_rank(group, xp):
    root = group.size - 1
    buf = xp.asarray(data(group.rank))
    group.Bcast(buf, root=root)
    np.testing.assert_array_equal(to_numpy(buf), data(root))


def test_isend_recv_around_a_ring(group, xp):
    right, left = (group.rank + 1) % group.size, (group.rank - 1) % group.size
    send = xp.asarray(data(group.rank))
    recv = xp.full(N, np.nan)
    handle = group.Isend(send, dest=right, tag=7)
    group.Recv(recv, source=left, tag=7)
    handle.wait()
    np.testing.assert_array_equal(to_numpy(recv), data(left))
    np.testing.assert_array_equal(to_numpy(send), data(group.rank))   # unchanged
