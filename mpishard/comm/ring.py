"""Gradient sums as a ring of point-to-point messages: reduce-scatter and allreduce.

Open MPI 4.1's reduction collectives measured far slower than its point-to-point
messages between the ranks of one node here (2 ranks, float32 buffers rewritten
before each call, the slowest rank's best of 5 on a shared 2-core VM;
``benchmarks/bench_strategies.py`` prints these as ``raw_*``)::

    elements   Reduce_scatter   Allreduce   ring reduce-scatter   ring allreduce
    1.9M            3.1 ms         1.3 ms          0.8 ms               1.2 ms
    6.6M            6.1 ms         7.4 ms          2.5 ms               4.1 ms
    25M           166   ms        59   ms         11   ms              20   ms

and the non-blocking ``Iallreduce`` of 25M took 100 ms against the ring's 10 ms
(a ``Sendrecv`` of half of 25M float32 each way took 5-7 ms: shared memory with
one copy, while the collectives' algorithms go through small segments). So a
sum of ``n`` elements over ``N`` ranks is also offered as the classic ring:
the vector is cut into the ranks' pieces (``counts``); in step ``s = 0 .. N-2``
rank ``r`` sends its running sum of piece ``(r - 1 - s) mod N`` to rank
``r + 1`` and receives the running sum of piece ``(r - 2 - s) mod N`` from rank
``r - 1``, adding its own part to it. After ``N - 1`` steps rank ``r`` holds
piece ``r`` summed over every rank (a reduce-scatter: ``(N-1)/N n`` elements
sent per rank, the least possible); an allgather ring of ``N - 1`` more steps
passes the finished pieces round (an allreduce).

Piece ``j`` is summed in the order ``x[j+1] + x[j+2] + ... + x[j]`` (ranks
modulo ``N``): fixed, so every run gives the same bits, but not MPI's order.
On 2 ranks each element is one addition of two numbers, the same bits as any
sum of two. [`RingComm`][mpishard.comm.ring.RingComm] has the call signatures of the
[`FlatComm`][mpishard.comm.FlatComm] gradient calls (``Allreduce``, ``Iallreduce``,
``Reduce_scatter``, ``Ireduce_scatter``; sums only), so a strategy holds it as
its reduction communicator where
[`mpishard.comm.hierarchical.choose`][mpishard.comm.hierarchical.choose] measured it faster. Host
(NumPy) buffers only: device buffers take MPI's collectives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..flat import split_range
from .communicator import FlatComm, Handle

__all__ = ["RING_MIN_ELEMENTS", "RingComm"]

#: The ring is tried (`mpishard.comm.hierarchical.choose`, ZeRO-2's
#: ``reduce_method="auto"``) for buckets of at least this many elements only.
#: Below, each of its ``N - 1`` steps costs more in Python and message latency
#: than it saves; and the choice stays the group's own calls, whose order of
#: addition small jobs (the tests among them) then keep from run to run.
RING_MIN_ELEMENTS = 1 << 18

# Tags: each call takes the next ``2 * size`` of them (one per step), so calls in
# flight at once never match each other's messages. 32767: the least MPI_TAG_UB
# the standard allows.
_TAG_SPACE = 32767


class RingComm:
    """Sums over ``group`` (a [`FlatComm`][mpishard.comm.FlatComm]) by rings of ``Isend``/``Irecv``.

    Its messages travel on a duplicate of ``group``'s communicator ([`ring`][mpishard.comm.ring],
    made here: collective over ``group``), so they never meet another call's. Non-blocking
    calls return a handle whose ``test()`` advances the ring by the steps whose
    messages have arrived and ``wait()`` completes it; each step's addition is
    done by the rank in that call.
    """

    def __init__(self, group: FlatComm) -> None:
        self.group = group
        #: The duplicate the ring's messages travel on (revoked with the strategy's
        #: communicators after a lost rank: `mpishard.recovery.inplace`).
        self.ring = group.dup(f"{group.name} (ring)")
        self.name, self.rank, self.size = group.name, group.rank, group.size
        self._calls = 0
        self._scratch: dict[Any, Any] = {}

    @property
    def timeout(self) -> float | None:
        """The group's timeout (the ring's messages wait under the duplicate's)."""
        return self.group.timeout

    def describe(self) -> str:
        return f"ring of {self.size} ranks"

    # --- the calls of FlatComm ---------------------------------------------------
    def Allreduce(self, buf: Any, slot: Any = "allreduce", op: str = "sum") -> None:
        """Sum ``buf`` in place over the group. Collective over the group."""
        if op != "sum" or self.size == 1:
            self.group.Allreduce(buf, slot, op=op)
            return
        self.Iallreduce(buf, slot).wait()

    def Iallreduce(self, buf: Any, slot: Any = "allreduce",
                   finish: Callable[[], None] | None = None, op: str = "sum") -> Handle:
        """Start summing ``buf`` in place over the group. Collective over the group."""
        if op != "sum" or self.size == 1:
            return self.group.Iallreduce(buf, slot, finish, op=op)
        counts = [len(split_range(buf.size, self.size, i)) for i in range(self.size)]
        return self._start(buf, None, counts, slot, finish, gather=True)

    def Reduce_scatter(self, sendbuf: Any, recvbuf: Any, counts: list[int],
                       slot: Any = "reduce_scatter") -> None:
        """Sum ``sendbuf`` over the group, rank ``i`` keeping piece ``i`` of
        ``counts[i]`` elements in ``recvbuf``. Collective over the group."""
        self.Ireduce_scatter(sendbuf, recvbuf, counts, slot).wait()

    def Ireduce_scatter(self, sendbuf: Any, recvbuf: Any, counts: list[int],
                        slot: Any = "reduce_scatter",
                        finish: Callable[[], None] | None = None) -> Handle:
        """Start [`Reduce_scatter`][mpishard.comm.ring.RingComm.Reduce_scatter] (``sendbuf`` is only
        read). Collective over the group."""
        if len(counts) != self.size:
            raise ValueError(f"expecting {self.size} counts, got {len(counts)}")
        if self.size == 1:
            return self.group.Ireduce_scatter(sendbuf, recvbuf, counts, slot, finish)
        return self._start(sendbuf, recvbuf, list(counts), slot, finish, gather=False)

    def communicators(self) -> list[FlatComm]:
        """The ring's own communicator. Local."""
        return [self.ring]

    def free(self) -> None:
        """Free the ring's communicator. Collective over the group."""
        self.ring.free()

    # --- one call ---------------------------------------------------------------------
    def _start(self, buf: Any, out: Any, counts: list[int], slot: Any,
               finish: Callable[[], None] | None, gather: bool) -> _Ring:
        if not isinstance(buf, np.ndarray):
            raise TypeError(f"RingComm sums host (NumPy) buffers, got {type(buf).__name__}")
        steps = 2 * (self.size - 1)
        tag0 = (self._calls * steps) % (_TAG_SPACE - steps)
        self._calls += 1
        largest = max(counts)
        # tmp receives; acc holds the running sum sent on (reduce-scatter on 3+
        # ranks; an allreduce sums in place in buf, 2 ranks need no running sum).
        tmp = self._buffer((slot, "recv"), largest, buf)
        acc = self._buffer((slot, "acc"), largest, buf) if not gather and self.size > 2 \
            else None
        ring = _Ring(self, buf, out, counts, tmp, acc, tag0, gather, finish)
        ring.test()
        return ring

    def _buffer(self, key: Any, size: int, like: Any) -> Any:
        """A reusable buffer of ``size`` elements like ``like`` (grow-only, per slot):
        a bucket's slot is reused only once its previous call has completed."""
        key = (key, np.dtype(like.dtype).str)
        have = self._scratch.get(key)
        if have is None or have.size < size:
            have = np.empty(max(size, 1), dtype=like.dtype)
            self._scratch[key] = have
        return have


class _Ring(Handle):
    """One ring call in progress: the [`Handle`][mpishard.comm.Handle] of its current
    step's two messages, advanced step by step by `test` and `wait`."""

    __slots__ = ("ring", "buf", "out", "counts", "displs", "tmp", "acc", "tag0", "gather",
                 "step", "pending")

    def __init__(self, ring: RingComm, buf: Any, out: Any, counts: list[int], tmp: Any,
                 acc: Any, tag0: int, gather: bool,
                 finish: Callable[[], None] | None) -> None:
        super().__init__(ring.ring, None, "ring reduce-scatter" if not gather
                         else "ring allreduce", finish)
        self.ring, self.buf, self.out, self.counts = ring, buf, out, counts
        self.displs = np.concatenate(([0], np.cumsum(counts[:-1]))).astype(int).tolist()
        self.tmp, self.acc, self.tag0, self.gather = tmp, acc, tag0, gather
        self.step = -1             # the step whose messages are in flight; -1: none yet
        self.pending: list[Any] = []

    # The steps: 0 .. N-2 reduce-scatter, N-1 .. 2N-3 allgather (allreduce only).
    @property
    def _last(self) -> int:
        n = self.ring.size
        return 2 * (n - 1) - 1 if self.gather else n - 2

    def _piece(self, j: int) -> tuple[int, int]:
        j %= self.ring.size
        return self.displs[j], self.displs[j] + self.counts[j]

    def _post(self, s: int) -> None:
        """Start step ``s``'s send to the next rank and receive from the previous."""
        ring, r, n = self.ring, self.ring.rank, self.ring.size
        comm, tag = ring.ring, self.tag0 + s
        if s < n - 1:          # reduce-scatter: running sum of piece r-1-s on, r-2-s in
            lo, hi = self._piece(r - 1 - s)
            # Step 0 sends its own part; an allreduce sums in place in buf.
            send = self.buf[lo:hi] if s == 0 or self.gather else self.acc[:hi - lo]
            a, b = self._piece(r - 2 - s)
            recv = self.tmp[:b - a]
        else:                  # allgather: finished piece r-t on, piece r-1-t in
            t = s - (n - 1)
            lo, hi = self._piece(r - t)
            a, b = self._piece(r - 1 - t)
            send, recv = self.buf[lo:hi], self.buf[a:b]
        self.pending = [comm.Irecv(recv, (r - 1) % n, tag),
                        comm.Isend(send, (r + 1) % n, tag)]

    def _complete(self, s: int) -> None:
        """Step ``s``'s messages have arrived: add this rank's part to the sum."""
        r, n = self.ring.rank, self.ring.size
        if s >= n - 1:
            return                              # allgather: received in place
        a, b = self._piece(r - 2 - s)
        mine = self.buf[a:b]
        got = self.tmp[:b - a]
        if self.gather:
            np.add(got, mine, out=mine)         # in place: buf's piece is the sum now
        elif s == n - 2:
            np.add(got, mine, out=self.out[:b - a])     # piece r, finished
        else:
            np.add(got, mine, out=self.acc[:b - a])

    def test(self) -> bool:
        """Advance the steps whose messages have arrived; True when all are done."""
        while True:
            if self.pending:
                if not all(h.test() for h in self.pending):
                    return False
                self.pending = []
                self._complete(self.step)
            if self.step >= self._last:
                return True
            self.step += 1
            self._post(self.step)

    def wait(self, *, timed: bool = True) -> None:
        """Complete every step (each under the group's timeout), then the finish step."""
        while not self.test():
            for h in self.pending:
                h.wait(timed=timed)
        if self.finish is not None:
            finish, self.finish = self.finish, None
            finish()

