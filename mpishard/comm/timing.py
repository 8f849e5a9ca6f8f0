"""Choosing between ways of communicating by measuring them, the same on every rank.

``reduce_scatter`` or ``allreduce`` for ZeRO-2's buckets, flat or in two levels
across nodes, reducing during the backward or after it: each is decided by
`time_alternatives`, one rule for all, so that every rank picks the same
way and a transient slowdown of the machine hits every way alike.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from .communicator import FlatComm

__all__ = ["agree_on_fastest", "agree_on_faster", "reduce_once", "time_alternatives",
           "within_budget"]


def time_alternatives(group: FlatComm, ways: dict[str, Callable[[], Any]],
                      repeats: int, budget: float | None = None) -> dict[str, float]:
    """Seconds of each way: the slowest rank's best of ``repeats`` rounds.

    The rounds alternate the ways (each behind a barrier) after one warm-up round
    that is not counted, and the result is the maximum over ranks, so every rank
    returns the same numbers. ``budget``: the seconds the rounds may take, the
    warm-up's included; after each round the ranks agree on the time spent (the
    slowest rank's) and all stop before a round that would pass it (the rounds
    so far, on average, as the estimate). A way never timed then is ``inf``.
    Collective over ``group``.
    """
    best = {way: float("inf") for way in ways}
    started = time.perf_counter()
    for round_ in range(repeats + 1):
        for way, run in ways.items():
            group.barrier()
            t0 = time.perf_counter()
            run()
            if round_:
                best[way] = min(best[way], time.perf_counter() - t0)
        if budget is not None and round_ < repeats and not within_budget(
                group, started, budget, round_ + 1):
            break
    return {way: group.allreduce_scalar(best[way], op="max") for way in ways}


def within_budget(group: FlatComm, started: float, budget: float, rounds: int) -> bool:
    """Whether one more of ``rounds`` alike rounds, begun at ``started``
    (``time.perf_counter()``), fits in ``budget`` seconds: the same answer on
    every rank, from the slowest rank's time so far. Collective over ``group``.
    """
    spent = group.allreduce_scalar(time.perf_counter() - started, op="max")
    return spent * (rounds + 1) / rounds <= budget


def agree_on_fastest(group: FlatComm, times: dict[str, Any], ways: tuple[str, ...],
                     default: str) -> str:
    """The way that is fastest by the slowest of ``group``'s measurements, the same
    on every rank, or ``default`` where no rank measured any (a way that no rank
    measured is never chosen).

    For a choice that several groups measure separately but must make alike (the
    data-parallel groups of a 3D layout hold copies of the replicated tensors: a
    different order of addition on another tensor rank would let the copies
    drift). A rank that measured nothing passes an empty ``times``. Collective
    over ``group``.
    """
    slowest = {way: group.allreduce_scalar(float(times.get(way) or 0.0), op="max")
               for way in ways}
    # A way no rank measured (ZeRO-2's ring on device arrays or small buckets) is
    # not a candidate: its 0 is no time.
    measured = [way for way in ways if slowest[way] > 0.0]
    if not measured:
        return default
    return min(measured, key=lambda way: (slowest[way], way))



def agree_on_faster(group: FlatComm, times: dict[str, Any], default: str,
                    alternatives: tuple[str, ...], margin: float) -> str:
    """``default``, or the alternative whose slowest time over ``group`` beats the
    slowest ``default`` by ``margin``; the same on every rank.

    For [`mpishard.comm.hierarchical.choose`][mpishard.comm.hierarchical.choose] in a 3D layout,
    whose data groups measure flat against two levels separately but must choose alike. A
    rank that measured nothing (a stage without parameters) passes an empty
    ``times`` and does not count; an alternative is a candidate only where every
    rank that measured had it (the choice is made on every rank). Collective over
    ``group``.
    """
    measured = group.allreduce_scalar(1.0 if times else 0.0, op="sum")
    base = group.allreduce_scalar(float(times.get(default) or 0.0), op="max")
    best, best_time = default, float("inf")
    for way in alternatives:
        held = group.allreduce_scalar(1.0 if way in times else 0.0, op="sum")
        slowest = group.allreduce_scalar(float(times.get(way) or 0.0), op="max")
        if measured and held == measured and (slowest, way) < (best_time, best):
            best, best_time = way, slowest
    return best if best != default and best_time < (1 - margin) * base else default


def reduce_once(comm: Any, kind: str, blocking: bool, buf: Any, recv: Any,
                counts: list[int]) -> None:
    """One gradient reduction of ``buf`` as the strategies make it, for timing:
    ``kind`` ``"allreduce"`` (in place) or ``"reduce_scatter"`` (into ``recv``, this
    rank's ``counts`` entry), blocking or non-blocking and waited for. ``comm`` is a
    [`FlatComm`][mpishard.comm.FlatComm] or anything with its buffer calls. Collective over
    ``comm``.
    """
    if kind == "allreduce":
        if blocking:
            comm.Allreduce(buf, slot="probe")
        else:
            comm.Iallreduce(buf, slot="probe").wait()
    elif blocking:
        comm.Reduce_scatter(buf, recv, counts, slot="probe")
    else:
        comm.Ireduce_scatter(buf, recv, counts, slot="probe").wait()
