"""Gradient buckets: which ranges of a flat gradient are ready, and reducing them as they are.

DESIGN puts "gradient buckets and their readiness" in the comm layer: this is
the mechanism every data-parallel strategy shares, and it knows nothing of what
a reduction does. A strategy says only how one bucket is reduced, as a function
``reduce(index, source, blocking) -> Handle | None`` (DDP: ``Allreduce``;
ZeRO-2: reduce to the shards and keep this rank's piece).

Buckets are world ranges of the flat vector, the one with the highest offsets
first ([`bucket_ranges`][mpishard.flat.bucket_ranges]): gradients become ready in
backward order, last layer first. A model that reports its backward progress
([`BucketedModel`][mpishard.protocols.BucketedModel]) calls `GradientBuckets.before`
and `GradientBuckets.after` around each layer's gradient writes; a bucket
is launched (non-blocking) as soon as the backward has passed its lowest offset,
so the reduction overlaps the rest of the backward. Such a backward launches
every bucket (its last ``after`` is at offset 0); for any other model
`GradientBuckets.flush` reduces them after the backward with blocking
calls. Every rank must launch each bucket the same way, blocking or not: MPI
never matches a blocking collective with a non-blocking one.

With ``slots=k`` the buckets take turns on ``k`` buffers, bucket ``j`` on slot
``j % k``: gradient storage (ZeRO-2 lets the backward write into two
bucket-sized buffers instead of a full gradient) and a strategy's per-slot
scratch. A slot is free again only when the reduction of the bucket ``k``
earlier has completed; `GradientBuckets.before` and every launch wait for
that.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..flat import ParamLayout, Range
from .communicator import Handle

__all__ = ["GradientBuckets", "Reduce"]

#: ``reduce(index, source, blocking)``: reduce bucket ``index`` whose unreduced
#: gradient is the array ``source``; return the pending handle (non-blocking) or
#: None (done, or nothing to wait for).
Reduce = Callable[[int, Any, bool], "Handle | None"]


class GradientBuckets:
    """The buckets of one flat gradient and the reductions running on them.

    It is the [`BackwardHooks`][mpishard.protocols.BackwardHooks] object a strategy gives
    a bucketed model. Not collective itself: every rank must go through the same
    calls (the reductions are collective over the strategy's group).

    Args:
        ranges: bucket world ranges, highest offsets first; none for a layout
            with no parameters (every call then reduces nothing).
        reduce: how the strategy reduces one bucket (see `Reduce`).
        slots: number of buffers the buckets rotate through (0: none; each
            bucket's source is a slice of `vector`).

    Attributes:
        ranges: the bucket ranges, in backward order.
        vector: the flat gradient the ranges index, when there are no slot
            buffers (DDP's gradient; a model's own gradient under ZeRO-2).
        buffers: the slot buffers (after `allocate`), else empty.
        seconds: time spent waiting for a slot and in blocking reductions,
            summed until the caller resets it.
    """

    def __init__(self, ranges: Sequence[Range], reduce: Reduce, slots: int = 0) -> None:
        if slots < 0:
            raise ValueError(f"expecting slots >= 0, got {slots}")
        self.ranges = list(ranges)
        self.reduce = reduce
        self.slots = slots
        self.vector: Any = None
        self.buffers: list[Any] = []
        self.seconds = 0.0
        # Negated starts ascend: bisect finds the bucket of an offset.
        self._neg_starts = [-r.start for r in self.ranges]
        self._owner: list[Handle | None] = [None] * slots
        self._handles: list[Handle] = []
        self._next = len(self.ranges)     # nothing to launch before begin()
        self._active = False

    # --- storage ------------------------------------------------------------
    def allocate(self, xp: Any, dtype: Any) -> None:
        """Make the slot buffers, each as long as the largest bucket that uses it."""
        if not self.slots:
            raise ValueError("allocate(): these buckets have no slots")
        sizes = [0] * self.slots
        for j, r in enumerate(self.ranges):
            sizes[j % self.slots] = max(sizes[j % self.slots], len(r))
        self.buffers = [xp.zeros(s, dtype=dtype) for s in sizes]

    def gradient_views(self, layout: ParamLayout) -> Callable[[str], Any]:
        """``view(name)``: where tensor ``name``'s gradient lives in the slot
        buffers (for `bind_gradients`)."""
        views = {}
        for j, r in enumerate(self.ranges):
            buf = self.buffers[j % self.slots]
            for spec in layout.tensors_in(r):
                lo = spec.offset - r.start
                views[spec.name] = buf[lo:lo + spec.size].reshape(spec.shape)
        return views.__getitem__

    def source(self, index: int) -> Any:
        """The unreduced gradient of bucket ``index``."""
        r = self.ranges[index]
        if self.buffers:
            return self.buffers[index % self.slots][:len(r)]
        return self.vector[r.start:r.stop]

    def index_of(self, offset: int) -> int:
        """The bucket holding world offset ``offset``."""
        return bisect.bisect_left(self._neg_starts, -offset)

    @property
    def largest(self) -> int:
        """Elements of the longest bucket; 0 without buckets (a layout with no
        parameters, such as a pipeline stage of activations only)."""
        return max((len(r) for r in self.ranges), default=0)

    @property
    def launched_all(self) -> bool:
        """Every bucket was launched since the last `begin`."""
        return self._next >= len(self.ranges)

    # --- one backward -------------------------------------------------------
    def begin(self, launch: bool) -> None:
        """A backward starts; with ``launch`` False its buckets are not reduced
        during it (a micro-batch that only accumulates)."""
        self._next = 0
        self._active = launch

    def before(self, r: Range) -> None:
        """Hook: the backward is about to write the gradients of world range ``r``.

        The bucket holding ``r`` reuses the slot of the bucket ``slots`` earlier:
        that reduction must be complete before the backward overwrites its buffer.
        """
        if self.slots and self._active:
            self._release(self.index_of(r.start) % self.slots)

    def after(self, r: Range) -> None:
        """Hook: the gradients of world range ``r`` are written. Every gradient
        at offsets ``>= r.start`` is final for this backward, so each bucket
        starting there or above is launched."""
        if not self._active:
            return
        ranges = self.ranges
        while self._next < len(ranges) and ranges[self._next].start >= r.start:
            self._launch(self._next, blocking=False)
            self._next += 1
        # Non-blocking collectives only move when MPI is entered: poke them.
        for handle in self._handles:
            handle.test()

    def flush(self, zero: bool = False, blocking: bool = True) -> None:
        """Reduce every bucket not launched since `begin`.

        Blocking by default: nothing is left to overlap with, and Open MPI 4.1's
        non-blocking collectives (libnbc) measured ~2x slower than the blocking
        ones at MiBs. ``zero``: fill each source with zeros first (a rank with
        no rows takes part in every reduction with a zero gradient); such a rank
        passes ``blocking=False`` where the other ranks' backward launches the
        buckets from its hooks, since a blocking collective never matches a
        non-blocking one.
        """
        while self._next < len(self.ranges):
            if zero:
                if self.slots:
                    self._release(self._next % self.slots)
                self.source(self._next).fill(0)
            self._launch(self._next, blocking=blocking)
            self._next += 1

    def wait(self) -> None:
        """Complete every pending reduction (and its finishing step)."""
        for handle in self._handles:
            handle.wait()
        self._handles.clear()
        for slot in range(self.slots):      # in place: wait() runs every step
            self._owner[slot] = None

    # --- internals ------------------------------------------------------------
    def _launch(self, index: int, blocking: bool) -> None:
        if self.slots:
            # The slot's buffer and the strategy's scratch for it must be free.
            self._release(index % self.slots)
        t0 = time.perf_counter()
        handle = self.reduce(index, self.source(index), blocking)
        if blocking:
            self.seconds += time.perf_counter() - t0
        if handle is not None:
            self._handles.append(handle)
            if self.slots:
                self._owner[index % self.slots] = handle

    def _release(self, slot: int) -> None:
        owner = self._owner[slot]
        if owner is not None:
            t0 = time.perf_counter()
            owner.wait()
            self.seconds += time.perf_counter() - t0
            self._owner[slot] = None
