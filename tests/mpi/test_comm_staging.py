"""Staged collectives that start after their device-to-host copy (mpishard/comm/communicator.py).

Run under ``mpirun -n N python -m pytest --with-mpi`` (N = 1, 2, 3, 4). A
collective on a device buffer, with an MPI library that is not CUDA-aware,
copies the buffer down on a CUDA stream of its own and starts its MPI call
only when that copy is done. The order in which the calls start is what MPI
cares about: the ``numpy`` tests drive the deferral with stand-in events that
finish in a different order on each rank, and check that every rank starts its
collectives in the order they were asked for (results that would be swapped or
a job that would hang otherwise), that ``progress()`` never waits, and that any
other call of the group starts the deferred ones first. The ``gpu`` tests run
the real copies (CuPy, ``MPISHARD_CUDA_AWARE`` forced off).
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from mpishard.comm import FlatComm

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD


class StandInEvent:
    """What the deferral reads of a CUDA event: ``done`` and ``synchronize()``."""

    def __init__(self) -> None:
        self.done = False
        self.waited = False

    def synchronize(self) -> None:
        self.done = self.waited = True


@pytest.fixture
def group():
    comm = FlatComm(WORLD.Dup(), "staging-test", timeout=60)
    yield comm
    comm.free()


def deferred_sums(group, count=4):
    """``count`` deferred in-place Allreduces of distinct buffers; returns them,
    their handles and events."""
    bufs = [np.full(3, (k + 1) * 10.0 ** k * (group.rank + 1)) for k in range(count)]
    events = [StandInEvent() for _ in range(count)]
    handles = [group._defer("Iallreduce", ev, (lambda b=b: group.comm.Iallreduce(
        MPI.IN_PLACE, b, op=MPI.SUM)), None) for b, ev in zip(bufs, events)]
    return bufs, handles, events


def expected_sum(group, k):
    return (k + 1) * 10.0 ** k * group.size * (group.size + 1) / 2


def test_copies_finishing_out_of_order_start_in_order(group):
    bufs, handles, events = deferred_sums(group)
    assert all(h.request is None for h in handles)
    # The copies finish in another order on each rank; the last first here.
    order = np.random.default_rng(group.rank).permutation(len(events))
    for k in order:
        events[k].done = True
        group.progress()
        started = [h.request is not None for h in handles]
        first_waiting = next((j for j, e in enumerate(events) if not e.done), len(events))
        assert started == [j < first_waiting for j in range(len(events))]
    assert not any(e.waited for e in events)    # progress() never waits
    for k, h in enumerate(handles):
        h.wait()
        np.testing.assert_array_equal(bufs[k], expected_sum(group, k))


def test_waiting_for_one_starts_those_before_it(group):
    bufs, handles, events = deferred_sums(group)
    assert not handles[2].test()            # its copy and those before: not done
    handles[2].wait()
    assert [e.waited for e in events] == [True, True, True, False]
    assert handles[3].request is None
    for k in (0, 1, 3):
        handles[k].wait()
    for k in range(4):
        np.testing.assert_array_equal(bufs[k], expected_sum(group, k))


@pytest.mark.parametrize("call", ["allreduce", "allgather", "barrier", "Allreduce"])
def test_any_other_call_starts_the_deferred_first(group, call):
    bufs, handles, events = deferred_sums(group, 2)
    if call == "allreduce":
        assert group.allreduce(group.rank, op="max") == group.size - 1
    elif call == "allgather":
        assert group.allgather(group.rank) == list(range(group.size))
    elif call == "barrier":
        group.barrier()
    else:
        value = np.ones(2)
        group.Allreduce(value)
        np.testing.assert_array_equal(value, group.size)
    assert all(h.request is not None for h in handles) and all(e.waited for e in events)
    for k, h in enumerate(handles):
        h.wait()
        np.testing.assert_array_equal(bufs[k], expected_sum(group, k))


# --- on a GPU: the real copies -------------------------------------------------------------

@pytest.fixture
def cupy():
    from backends import cupy_or_skip as _cupy_or_skip

    return _cupy_or_skip()


@pytest.mark.gpu
def test_staged_collectives_overlap_the_work_queued_after_them(cupy, group):
    """Each kind of staged non-blocking collective, launched while the stream is
    busy, then more work queued before the wait: right results, the MPI call
    started only after its copy, the pinned buffers the same every round."""
    cp = cupy
    staged = FlatComm(WORLD.Dup(), "staged", timeout=60, cuda_aware_mpi=False)
    try:
        n, size, rank = 1 << 16, staged.size, staged.rank
        counts = [n // size + (r < n % size) for r in range(size)]
        lo = sum(counts[:rank])
        busy = cp.ones((1024, 1024), dtype=np.float32)
        pinned = None
        for round_ in range(3):
            a = cp.full(n, float(rank + round_ + 1))
            rs = cp.arange(n, dtype=np.float64) * (rank + 1)
            mine = cp.empty(counts[rank])
            ag = cp.zeros(n)
            ag[lo:lo + counts[rank]] = rank + 1
            cp.matmul(busy, busy)                    # the stream is busy while we ask
            handles = [staged.Iallreduce(a, slot=("a", 0)),
                       staged.Ireduce_scatter(rs, mine, counts, slot="rs"),
                       staged.Iallgatherv(ag, counts, slot="ag")]
            cp.matmul(busy, busy)                    # "the rest of the backward"
            for h in handles:
                h.test()
            for h in handles:
                h.wait()
            total = sum(r + round_ + 1 for r in range(size))
            np.testing.assert_array_equal(a.get(), total)
            np.testing.assert_allclose(mine.get(), np.arange(lo, lo + counts[rank])
                                       * size * (size + 1) / 2)
            np.testing.assert_array_equal(ag.get(), np.repeat(np.arange(1, size + 1), counts))
            now = {k: v.ctypes.data for k, v in staged._staging.items()}
            assert pinned is None or now == pinned    # grow-only: reused
            pinned = now
    finally:
        staged.free()
