"""Parameter buckets gathered as a model reads them: ZeRO-3's parameter hooks.

Each data-parallel rank holds only its shard of the flat parameter vector (a
contiguous range, [`shard_ranges`][mpishard.flat.shard_ranges]). The vector is cut into
buckets of whole units (the ranges of [`bucket_ranges`][mpishard.flat.bucket_ranges],
here in forward order, lowest offsets first).
[`ParameterGather`][mpishard.comm.gather.ParameterGather] is the
[`ParameterHooks`][mpishard.protocols.ParameterHooks] object a strategy gives a
[`ShardableModel`][mpishard.protocols.ShardableModel]: before a layer reads its parameters, the
bucket holding them is gathered from every rank's shard (``Allgatherv``, in place: each rank first
copies its own piece in) into a slot buffer, where the model's parameter views, bound once, point.

**Slots.** Bucket ``j`` always lands in slot ``j % k``, so each tensor's view
is fixed: ``k = 1`` without prefetch (one bucket gathered at a time); ``k = 2``
with prefetch (while bucket ``j`` is read, ``j + 1`` in a forward, ``j - 1`` in
a backward, is gathered into the other slot with ``Iallgatherv``); with
``keep`` every bucket has its own place in one whole-vector buffer. A gathered
bucket stays valid in its slot until the slot is needed by another bucket or
[`ParameterGather.invalidate`][mpishard.comm.gather.ParameterGather.invalidate] (the owner calls it
whenever the shard changes: an update, a loaded checkpoint). So the buckets a forward gathered
last are still there when its backward starts with them, and with ``keep``
neither a backward nor the forward of the next micro-batch gathers anything.

**Order.** Every rank must start the same collectives in the same order on
the group, blocking or not alike (MPI never matches a blocking collective with
a non-blocking one). Gathers start only from the hooks, and what starts depends
only on the sequence of hook calls, which is the same on every rank (the same
model making the same passes); a rank with no rows makes the same hook calls
without a model (its strategy replays them). The gathers have a group of their
own (a duplicate of the data group), so their order and the gradient
reductions' are each kept on their own; across the two groups the order of
the *blocking* waits matters too (a rank waiting for a reduction its peer has
not started, while the peer waits for a gather, is a deadlock): a replay
interleaves the two hook objects' calls exactly as the model's backward does.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ..flat import ParamLayout, Range
from ..protocols import BACKWARD, INFERENCE
from .communicator import FlatComm, Handle

__all__ = ["ParameterGather"]


class ParameterGather:
    """The parameter buckets of one sharded flat vector and their gathers.

    Not collective itself: every rank of ``group`` must go through the same
    calls (the gathers are collective over it).

    Args:
        ranges: bucket world ranges in forward order (lowest offsets first),
            covering the vector.
        shards: every rank's shard of the vector (contiguous, in rank order).
        rank: this rank in ``group``.
        source: this rank's shard of the parameters (``len(shards[rank])``).
        group: the gathers' communicator (a duplicate of the data group).
        prefetch: gather the next bucket while the current one is read.
        keep: a slot per bucket (a whole-vector buffer): what a forward gathered
            is still there for its backward.

    Attributes:
        seconds: time spent in blocking gathers and waiting for gathers.
        gathers: gathers started so far.
        peak: the most elements gathered at once (valid or arriving) so far.
    """

    def __init__(self, ranges: Sequence[Range], shards: Sequence[Range], rank: int,
                 source: Any, group: FlatComm, *, prefetch: bool = True,
                 keep: bool = False) -> None:
        if not ranges:
            raise ValueError("expecting at least one bucket, got none")
        self.ranges = list(ranges)
        if any(a.stop != b.start for a, b in zip(self.ranges, self.ranges[1:])):
            raise ValueError(f"expecting consecutive bucket ranges in forward order, got "
                             f"{self.ranges}")
        self.shard = shards[rank]
        if len(source) != len(self.shard):
            raise ValueError(f"expecting a shard of {len(self.shard)} elements, got "
                             f"{len(source)}")
        self.source = source
        self.group = group
        self.prefetch = bool(prefetch)
        self.keep = bool(keep)
        n = len(self.ranges)
        self.slots = n if keep else (2 if prefetch and n > 1 else 1)
        self.buffers: list[Any] = []
        self.seconds = 0.0
        self.gathers = 0
        self.peak = 0
        self._live = 0
        self._starts = [b.start for b in self.ranges]
        # Per bucket: every rank's piece of it (shards are contiguous and in rank
        # order, so the pieces follow each other and the displacements are their
        # running sum), and mine.
        self._counts = [[len(b.intersect(s)) for s in shards] for b in self.ranges]
        self._mine = [b.intersect(self.shard) for b in self.ranges]
        self._resident = [-1] * self.slots     # the bucket in each slot (-1: none)
        self._pending: list[Handle | None] = [None] * n
        self._users = [0] * n                  # layers reading it now
        self._inflight: list[int] = []         # buckets with a gather pending, oldest first
        self._stale = False                    # invalidated: start afresh at the next hook

    # --- storage ------------------------------------------------------------
    def allocate(self, xp: Any, dtype: Any) -> None:
        """Make the slot buffers (each as long as the largest bucket that uses it;
        with ``keep`` one buffer of the whole vector)."""
        if self.keep:
            self.buffers = [xp.empty(self.ranges[-1].stop - self.ranges[0].start,
                                     dtype=dtype)]
            return
        sizes = [0] * self.slots
        for j, b in enumerate(self.ranges):
            sizes[j % self.slots] = max(sizes[j % self.slots], len(b))
        self.buffers = [xp.empty(s, dtype=dtype) for s in sizes]

    @property
    def nbytes(self) -> int:
        """Bytes of the slot buffers."""
        return int(sum(b.nbytes for b in self.buffers))

    def bucket(self, j: int) -> Any:
        """Where bucket ``j``'s parameters are gathered (its slot's buffer)."""
        b = self.ranges[j]
        if self.keep:
            lo = b.start - self.ranges[0].start
            return self.buffers[0][lo:lo + len(b)]
        return self.buffers[j % self.slots][:len(b)]

    def views(self, layout: ParamLayout) -> Callable[[str], Any]:
        """``view(name)``: where tensor ``name``'s parameters are read, in the slot
        buffers (for `bind_parameters`)."""
        views = {}
        for j, b in enumerate(self.ranges):
            buf = self.bucket(j)
            for spec in layout.tensors_in(b):
                lo = spec.offset - b.start
                views[spec.name] = buf[lo:lo + spec.size].reshape(spec.shape)
        return views.__getitem__

    def index_of(self, offset: int) -> int:
        """The bucket holding world offset ``offset``."""
        return bisect.bisect_right(self._starts, offset) - 1

    # --- the hooks ------------------------------------------------------------
    def before(self, r: Range, phase: str) -> None:
        """Hook: a layer is about to read the parameters of world range ``r``.
        Its bucket is made ready (gathered, or waited for); with prefetch the next
        bucket in the pass's direction starts gathering."""
        if self._stale:
            self._refresh()
        j = self.index_of(r.start)
        self._users[j] += 1
        self._ready(j)
        if self.prefetch:
            nxt = j - 1 if phase == BACKWARD else j + 1
            if 0 <= nxt < len(self.ranges):
                self._start(nxt, blocking=False, optional=True)
        self._poke()

    def after(self, r: Range, phase: str) -> None:
        """Hook: the layer has read the parameters of ``r`` for this pass; its
        bucket may give its slot to another once no layer reads it."""
        j = self.index_of(r.start)
        if self._users[j] < 1:
            raise RuntimeError(f"after({r}, {phase!r}) without a before() of its bucket {j}")
        self._users[j] -= 1
        self._poke()

    def invalidate(self) -> None:
        """The shard changed (an update, a load): every gathered bucket is stale,
        and the next hook call starts afresh (waiting then for gathers still
        arriving; a pass left half done by an exception is over). Local; waits
        for nothing."""
        self._stale = True

    def drop(self) -> None:
        """Forget the gathers still arriving without waiting for them (the group
        is broken: a lost rank) and [`invalidate`][mpishard.comm.gather.ParameterGather.invalidate].
        Local."""
        for j in self._inflight:
            self._pending[j] = None
        self._inflight.clear()
        self._stale = True

    def each_bucket(self) -> Iterable[tuple[int, Any]]:
        """``(j, parameters of bucket j)`` for every bucket, each gathered in turn
        (an inference pass). Collective over the group."""
        for j, b in enumerate(self.ranges):
            self.before(b, INFERENCE)
            yield j, self.bucket(j)
            self.after(b, INFERENCE)

    # --- internals ---------------------------------------------------------------
    def _refresh(self) -> None:
        while self._inflight:
            self._wait(self._inflight[0])
        for j in range(len(self.ranges)):        # in place: after every step
            self._users[j] = 0
        for slot in range(self.slots):
            self._resident[slot] = -1
        self._live = 0
        self._stale = False

    def _ready(self, j: int) -> None:
        if self._resident[j % self.slots] != j:
            self._start(j, blocking=True, optional=False)
        if self._pending[j] is not None:
            self._wait(j)

    def _start(self, j: int, blocking: bool, optional: bool) -> None:
        """Gather bucket ``j`` into its slot unless it is there (or arriving)."""
        slot = j % self.slots
        held = self._resident[slot]
        if held == j:
            return
        if held >= 0:
            if self._users[held]:
                if optional:
                    return      # the slot is still read: gathered when needed instead
                raise RuntimeError(f"parameter bucket {j} needs slot {slot}, where bucket "
                                   f"{held} is still being read")
            if self._pending[held] is not None:
                if optional:
                    return
                self._wait(held)
            self._live -= len(self.ranges[held])
        self._resident[slot] = j
        self._live += len(self.ranges[j])
        self.peak = max(self.peak, self._live)
        b, mine = self.ranges[j], self._mine[j]
        buf = self.bucket(j)
        if len(mine):
            buf[mine.start - b.start:mine.stop - b.start] = \
                self.source[mine.start - self.shard.start:mine.stop - self.shard.start]
        self.gathers += 1
        if self.group.size == 1:
            return
        if blocking:
            t0 = time.perf_counter()
            self.group.Allgatherv(buf, self._counts[j], slot=("gather", slot))
            self.seconds += time.perf_counter() - t0
        else:
            self._pending[j] = self.group.Iallgatherv(buf, self._counts[j],
                                                      slot=("gather", slot))
            self._inflight.append(j)

    def _wait(self, j: int) -> None:
        handle, self._pending[j] = self._pending[j], None
        self._inflight.remove(j)
        t0 = time.perf_counter()
        handle.wait()
        self.seconds += time.perf_counter() - t0

    def _poke(self) -> None:
        # Non-blocking collectives only move when MPI is entered: poke them.
        for j in self._inflight:
            self._pending[j].test()
