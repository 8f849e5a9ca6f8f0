"""``overlap="auto"``: reduce gradient buckets during the backward or after it, measured.

Starting each bucket's non-blocking reduction as soon as the backward has
written it hides communication behind the rest of the backward, but it is not
free: Open MPI 4.1's non-blocking collectives (libnbc) measured up to 2x slower
than the blocking ones, they only move when the backward's hooks poke them, and
on one node the reduction's copies compete with the backward's matrix products
for the same cores. On one node reducing after the backward measured faster
(2 ranks: 6-22 %, up to 2.3x); across rate-capped links reducing during it was
5-20 % faster. So, as for ``reduce_method="auto"``, the answer is measured.

:func:`choose_overlap` runs a stand-in backward at attach: the strategy's first
buckets (at most :data:`PROBE_BUCKETS`), each preceded by matrix products in
the parameters' dtype lasting, over all of them, as long as their blocking
reduction (the regime where overlap matters: compute and communication alike),
through the very :class:`~mpishard.comm.buckets.GradientBuckets` machinery the
strategy uses (hooks, polling, slots). Once with the non-blocking reductions
launched from the hooks ("during"), once with blocking reductions after the
compute ("after"). Each way's time is the slowest rank's best of ``repeats``
alternating rounds (after one warm-up), so every rank picks the same; "during"
must be faster by ``margin`` to be chosen (a tie stays with the simpler
blocking path, so noise does not flip it from run to run).

It is a model of the backward, not the backward: the real compute per bucket
and its mix (memory-bound element-wise layers, small GEMMs) differ. The choice
and the times are reported (``overlap_timings`` of the strategy). The stand-in
reduces with the data group's own calls; whether the buckets then go in two
levels across nodes (:func:`mpishard.comm.hierarchical.choose`) is measured
after, for the way chosen here (blocking or not). ZeRO-2 with
``reduce_method="auto"`` measures its reduce-scatter here, its method after.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..backend import synchronize
from ..comm import FlatComm, Handle
from ..comm.buckets import GradientBuckets
from ..comm.timing import time_alternatives
from ..flat import Range, shard_ranges

__all__ = ["OVERLAP_CHOICES", "PROBE_BUCKETS", "choose_overlap"]

#: What ``overlap=`` accepts.
OVERLAP_CHOICES = (True, False, "auto")

#: Buckets of the stand-in backward (the first ones in backward order).
PROBE_BUCKETS = 4

# Side of the stand-in backward's square matrix product.
_KERNEL = 128


def choose_overlap(dp: FlatComm, agree: FlatComm, ranges: list[Range], dtype: Any, xp: Any,
                   kind: str = "allreduce", slots: int = 0,
                   record: dict[str, Any] | None = None, repeats: int = 3,
                   margin: float = 0.05) -> bool:
    """True when reducing buckets during the backward measured faster than after it.

    ``dp``: the group the buckets are reduced over; ``agree``: a group holding
    it whose ranks must all choose alike (the strategy's step group: the world
    for hybrid layouts, where each data group measures its own). ``ranges``:
    the strategy's bucket ranges in backward order; ``kind``: ``"allreduce"``
    (DDP) or ``"reduce_scatter"`` (ZeRO-2); ``slots``: the buffers the buckets
    take turns on (ZeRO-2: 2). ``record`` receives ``{"choice", "during",
    "after", "reduction", "compute", "buckets"}`` (seconds; ``choice`` a bool).
    Collective over ``agree``.
    """
    if kind not in ("allreduce", "reduce_scatter"):
        raise ValueError(f"kind must be 'allreduce' or 'reduce_scatter', got {kind!r}")
    info: dict[str, Any] = {"choice": False, "during": None, "after": None,
                            "reduction": None, "compute": None, "buckets": 0}
    if agree.allreduce_scalar(float(dp.size), op="max") == 1:
        info["reason"] = "one rank per data group: nothing to reduce"
        if record is not None:
            record.update(info)
        return False
    buckets, local = _stand_in_buckets(dp, ranges, kind, dtype, xp, slots)
    a = xp.full((_KERNEL, _KERNEL), 1.0 / _KERNEL, dtype=dtype)
    out = xp.empty_like(a)

    def compute(count: int) -> None:
        for _ in range(count):
            xp.matmul(a, a, out=out)
        synchronize(xp)

    product, reduction = _product_and_reduction(dp, agree, buckets, compute, repeats)
    total = sum(len(r) for r in local)
    counts = [max(1, round(reduction / max(product, 1e-9) * len(r) / total)) for r in local]

    def during() -> None:
        buckets.begin(True)
        for r, count in zip(local, counts):
            buckets.before(r)
            compute(count)
            buckets.after(r)
        buckets.wait()

    def after() -> None:
        buckets.begin(True)
        for count in counts:
            compute(count)
        buckets.flush()
        buckets.wait()

    info.update(time_alternatives(agree, {"during": during, "after": after}, repeats))
    info.update(reduction=reduction, compute=product * sum(counts), buckets=len(local))
    info["choice"] = bool(info["during"] < (1 - margin) * info["after"])
    if record is not None:
        record.update(info)
    return info["choice"]


def _product_and_reduction(dp: FlatComm, agree: FlatComm, buckets: GradientBuckets,
                           compute: Callable[[int], None], repeats: int) -> tuple[float, float]:
    """One stand-in matrix product's time and the stand-in buckets' blocking
    reduction's, each the best of ``repeats`` (after a warm-up) and agreed over
    ``agree`` (the max): every rank then runs the same stand-in compute.
    Collective over ``agree``."""
    product = reduction = float("inf")
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        compute(8)
        product = min(product, (time.perf_counter() - t0) / 8)
        dp.barrier()
        t0 = time.perf_counter()
        buckets.begin(True)
        buckets.flush()
        buckets.wait()
        reduction = min(reduction, time.perf_counter() - t0)
    return (agree.allreduce_scalar(product, op="max"),
            agree.allreduce_scalar(reduction, op="max"))


def _stand_in_buckets(dp: FlatComm, ranges: list[Range], kind: str, dtype: Any, xp: Any,
                      slots: int) -> tuple[GradientBuckets, list[Range]]:
    """The strategy's first buckets (at most :data:`PROBE_BUCKETS`) moved to start at
    0, over buffers of their own, and their ranges. A layout without parameters (a
    pipeline stage of activations only) has none: its ranks still take part in
    every agreement, measuring nothing."""
    probe = ranges[:PROBE_BUCKETS]
    bottom = probe[-1].start if probe else 0
    local = [r.shift(bottom) for r in probe]
    buckets = GradientBuckets(local, _reducer(dp, local, kind, dtype, xp), slots=slots)
    if slots:
        buckets.allocate(xp, dtype)
    else:
        buckets.vector = xp.zeros(probe[0].stop - bottom if probe else 0, dtype=dtype)
    return buckets, local


def _reducer(dp: FlatComm, local: list[Range], kind: str, dtype: Any, xp: Any):
    """The stand-in strategy's ``reduce(index, source, blocking)``."""
    if kind == "allreduce":
        def reduce(index: int, source: Any, blocking: bool) -> Handle | None:
            if blocking:
                dp.Allreduce(source, slot=index)
                return None
            return dp.Iallreduce(source, slot=index)
        return reduce
    counts = [[len(s) for s in shard_ranges(len(r), dp.size)] for r in local]
    recvs = [xp.empty(max(c[dp.rank], 1), dtype=dtype) for c in counts]

    def reduce(index: int, source: Any, blocking: bool) -> Handle | None:
        recv = recvs[index][:counts[index][dp.rank]]
        if blocking:
            dp.Reduce_scatter(source, recv, counts[index], slot=index % 2)
            return None
        return dp.Ireduce_scatter(source, recv, counts[index], slot=index % 2)
    return reduce
