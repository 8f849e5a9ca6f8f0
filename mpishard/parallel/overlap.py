"""``overlap="auto"``: reduce gradient buckets during the backward or after it.

Starting each bucket's non-blocking reduction as soon as the backward has
written it hides communication behind the rest of the backward, but it is not
free: Open MPI 4.1's non-blocking collectives (libnbc) measured up to 2x slower
than the blocking ones, they only move when the backward's hooks poke them, and
on one node the reduction's copies compete with the backward's matrix products
for the same cores. On one node reducing after the backward measured faster
(2 ranks: 6-22 %, up to 2.3x); across rate-capped links reducing during it was
5-20 % faster.

`decide_overlap` (``overlap="auto"``) decides from what is known first,
and measures only where nothing is, within a budget:

1. recorded: a decision this process made for the same layout (a second
   strategy built on it, ``rebuild`` after a recovery or resize that kept it),
   or one an earlier launch of the same elastic job wrote in the agent's folder
   (``MPISHARD_OVERLAP_RECORD`` names another file);
2. modelled, "after": one gradient bucket (complete only when the backward
   ends: nothing to overlap); a model too small to gain, where the most overlap
   could hide (the cost model's reduction time of every bucket but the last,
   [`mpishard.costmodel`][mpishard.costmodel], on links as slow as 10 Gbit/s) is under
   `WORTH_MEASURING` a step; one node with host arrays (there the probe's
   two ways measured within the machine's noise, and it picked the faster way of
   the real steps 5 times in 8: not worth seconds per attach);
3. measured by `choose_overlap` within `PROBE_BUDGET` seconds,
   agreed over the group so that every rank stops together; the decision is
   then recorded (1).

``overlap="measure"`` always runs the probe, without a budget (0.5's ``"auto"``).
``overlap_timings["source"]`` says which: ``"recorded"``, ``"modelled"`` or
``"measured"``, with its ``"reason"`` and the ``"seconds"`` the decision took.

`choose_overlap` runs a stand-in backward: the strategy's first buckets (at
most `PROBE_BUCKETS`), each preceded by matrix products in the parameters'
dtype lasting, over all of them, as long as their blocking reduction (the regime
where overlap matters: compute and communication alike), through the very
`GradientBuckets` machinery the strategy uses
(hooks, polling, slots). Once with the non-blocking reductions launched from the
hooks ("during"), once with blocking reductions after the compute ("after").
Each way's time is the slowest rank's best of ``repeats`` alternating rounds
(after one warm-up), so every rank picks the same; "during" must be faster by
``margin`` to be chosen (a tie stays with the simpler blocking path, so noise
does not flip it from run to run).

It is a model of the backward, not the backward: the real compute per bucket
and its mix (memory-bound element-wise layers, small GEMMs) differ. The choice
and the times are reported (``overlap_timings`` of the strategy). The stand-in
reduces with the data group's own calls; whether the buckets then go in two
levels across nodes ([`mpishard.comm.hierarchical.choose`][mpishard.comm.hierarchical.choose]) is
measured after, for the way chosen here (blocking or not). ZeRO-2 with
``reduce_method="auto"`` measures its reduce-scatter here, its method after.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..backend import synchronize
from ..comm import FlatComm, Handle, NodeMap
from ..comm.buckets import GradientBuckets
from ..comm.timing import time_alternatives, within_budget
from ..costmodel import Machine, reduction_time
from ..flat import Range, shard_ranges

__all__ = ["OVERLAP_CHOICES", "PROBE_BUCKETS", "PROBE_BUDGET", "RECORD_FILE", "WORTH_MEASURING",
           "choose_overlap", "decide_overlap", "describe_attach", "forget_decisions",
           "known_decisions", "learn_decisions",
           "gain_bound", "layout_key", "modelled_overlap", "record_path"]

#: What ``overlap=`` accepts.
OVERLAP_CHOICES = (True, False, "auto", "measure")

#: Buckets of the stand-in backward (the first ones in backward order).
PROBE_BUCKETS = 4

#: Seconds ``overlap="auto"``'s stand-in backward may take (read at each decision).
PROBE_BUDGET = 0.5

#: Below this many seconds a step that overlap could hide at most, it is not measured.
WORTH_MEASURING = 1e-3

# Side of the stand-in backward's square matrix product.
_KERNEL = 128

# Links slow for a cluster (10 Gbit/s, 50 us; PCIe-like inside a node): the most
# overlap could hide is bounded from above with them, so "too small to gain" holds
# on faster links too.
_SLOW_LINKS = Machine(latency_inside=5e-6, bandwidth_inside=10e9, latency_across=50e-6,
                      bandwidth_across=1.25e9, reduce_scatter_cost=1.0)

# Decisions of this process by layout (layout_key): a strategy built again on the
# same layout, or rebuilt over it, takes the decision instead of measuring again.
_DECIDED: dict[str, bool] = {}

# The file a launch of the elastic agent leaves its decisions in, for the next one.
RECORD_FILE = "overlap-decisions.json"


def decide_overlap(dp: FlatComm, agree: FlatComm, ranges: list[Range], dtype: Any, xp: Any,
                   kind: str = "allreduce", slots: int = 0,
                   record: dict[str, Any] | None = None, *, nodes: NodeMap | None = None,
                   measure: bool = False, budget: float | None = None) -> bool:
    """``overlap="auto"`` (``measure=False``) or ``"measure"``: True to reduce the
    buckets during the backward. Recorded, modelled or measured within ``budget``
    seconds (`PROBE_BUDGET` when None), in that order (the module's
    docstring); ``measure`` runs `choose_overlap` without a budget.

    The arguments are `choose_overlap`'s, with ``nodes`` the world's
    [`NodeMap`][mpishard.comm.NodeMap] (None: unknown). ``record`` receives
    `choose_overlap`'s keys (None where not measured) and ``"source"``,
    ``"reason"`` and ``"seconds"``. Every rank of ``agree`` gets the same
    decision, from one reduction of what each knows. Collective over ``agree``.
    """
    started = time.perf_counter()
    key = layout_key(dp.size, agree.size, ranges, dtype, xp, kind, slots, nodes)
    known = -1.0 if key not in _DECIDED else float(_DECIDED[key])
    # Without a node map, every rank on a node of its own (the slowest case).
    per_node = 1 if nodes is None else max(1, round(dp.size / nodes.nodes))
    path = record_path()
    # One reduction (max) of what each rank knows: min(known) is -max(-known).
    facts = np.array([dp.size, known, -known, len(ranges),
                      gain_bound([len(r) for r in ranges], np.dtype(dtype).itemsize, dp.size,
                                 per_node, kind),
                      float(xp is not np), float(path is not None)])
    agree.Allreduce(facts, slot="overlap facts", op="max")
    info: dict[str, Any] = {"choice": False, "during": None, "after": None,
                            "reduction": None, "compute": None, "buckets": 0}
    if facts[0] == 1:
        source, info["reason"] = "modelled", "one rank per data group: nothing to reduce"
    elif measure:
        source = "measured"
        info["choice"] = choose_overlap(dp, agree, ranges, dtype, xp, kind, slots, info)
    elif facts[1] == -facts[2] >= 0:
        source, info["reason"] = "recorded", "an earlier attach of this process, same layout"
        info["choice"] = bool(facts[1])
    elif facts[6] and (found := _launch_record(agree, key, path)) is not None:
        source, info["reason"] = "recorded", "an earlier launch of this job, same layout"
        info["choice"] = found
    elif (why := modelled_overlap(int(facts[3]), facts[4],
                                  None if nodes is None else nodes.nodes, bool(facts[5]))):
        source, info["reason"] = "modelled", why
    else:
        source = "measured"
        info["choice"] = choose_overlap(dp, agree, ranges, dtype, xp, kind, slots, info,
                                        budget=PROBE_BUDGET if budget is None else budget)
    if source == "measured":
        _DECIDED[key] = info["choice"]
        if facts[6]:
            _write_record(agree, key, info, path)
        info.setdefault("reason", f"during {_ms(info['during'])}, after {_ms(info['after'])}")
    info.update(source=source, seconds=time.perf_counter() - started)
    if record is not None:
        record.update(info)
    return info["choice"]


def modelled_overlap(buckets: int, gain: float, nodes: int | None, device: bool,
                     worth: float | None = None) -> str | None:
    """Why reducing after the backward is decided without measuring, or None
    (measure): ``buckets`` the most gradient buckets of a data group, ``gain``
    the most overlap could hide a step (`gain_bound`, seconds), ``nodes``
    the job's node count (None: unknown), ``device`` whether the arrays are a
    device's. ``worth``: `WORTH_MEASURING` when None. Pure."""
    worth = WORTH_MEASURING if worth is None else worth
    if buckets <= 1:
        return "one gradient bucket, complete when the backward ends: nothing to overlap"
    if gain < worth:
        return f"too small to gain: overlap could hide at most {gain * 1e3:.2g} ms a step"
    if nodes == 1 and not device:
        return "one node, host arrays: the two ways within the noise here"
    return None


def gain_bound(lengths: list[int], itemsize: int, dp: int, per_node: int, kind: str) -> float:
    """The most overlap could hide a step, in seconds: the cost model's time to
    reduce every bucket but the last of the backward (``lengths``, in backward
    order, elements of ``itemsize`` bytes; the last completes with the backward),
    over ``dp`` ranks, ``per_node`` on a node, on slow links (10 Gbit/s across
    nodes). Pure."""
    half = kind == "reduce_scatter"
    return sum(reduction_time(n * itemsize, dp, per_node, _SLOW_LINKS, "flat", half=half)
               for n in lengths[:-1])


def layout_key(dp: int, world: int, ranges: list[Range], dtype: Any, xp: Any, kind: str,
               slots: int, nodes: NodeMap | None) -> str:
    """What a decision holds for: the group sizes, the ranks on each node, the
    buckets (count, and a digest of their sizes), dtype, array library and
    reduction. Pure."""
    sizes = ",".join(str(len(r)) for r in ranges)
    digest = hashlib.sha1(sizes.encode()).hexdigest()[:12]
    placed = "?" if nodes is None else "-".join(map(str, nodes.ranks_per_node))
    return (f"{kind} dp {dp} of {world}, nodes {placed}, {np.dtype(dtype).name} "
            f"{getattr(xp, '__name__', xp)}, slots {slots}, {len(ranges)} buckets {digest}")


def known_decisions() -> dict[str, bool]:
    """This process's decisions, by layout key (to give a newcomer: a promoted
    spare decides as the survivors, who remember theirs). Local."""
    return dict(_DECIDED)


def learn_decisions(decisions: dict[str, bool]) -> None:
    """Take ``decisions`` (another process's ``known_decisions``) as this process's. Local."""
    _DECIDED.update(decisions)


def forget_decisions() -> None:
    """Forget this process's decisions: the next ``overlap="auto"`` decides afresh. Local."""
    _DECIDED.clear()


def describe_attach(core: Any) -> str:
    """One line for a run's header: the core's attach time on this rank and how its
    buckets are reduced, and why (``overlap_timings``). Local."""
    seconds = getattr(core, "attach_seconds", None)
    head = "attached" if seconds is None else f"attached in {seconds:.2f} s"
    way = "during the backward" if getattr(core, "bucketed", False) else "after the backward"
    timings = getattr(core, "overlap_timings", None) or {}
    how = f"overlap={getattr(core, 'overlap', None)!r}"
    if "source" in timings:
        how += f", {timings['source']} in {timings['seconds']:.2f} s: {timings['reason']}"
    elif "reason" in timings:
        how += f": {timings['reason']}"
    return f"{head}; buckets reduced {way} ({how})"


def record_path() -> str | None:
    """The file of decisions recorded for later launches: ``MPISHARD_OVERLAP_RECORD``,
    or under the elastic agent (``MPISHARD_ELASTIC=1``) `RECORD_FILE` in the
    agent's folder, which holds each launch's folder (``MPISHARD_JOB_DIR``) and
    outlives them; otherwise None. Local."""
    path = os.environ.get("MPISHARD_OVERLAP_RECORD")
    if path:
        return path
    job = os.environ.get("MPISHARD_JOB_DIR")
    if job and os.environ.get("MPISHARD_ELASTIC") == "1":
        return os.path.join(os.path.dirname(os.path.abspath(job)), RECORD_FILE)
    return None


def _launch_record(agree: FlatComm, key: str, path: str | None) -> bool | None:
    """The recorded decision for this rank's ``key``, where every rank of ``agree``
    found the same one, else None. Rank 0 reads the file (the agent's folder may
    be on its node only). Collective over ``agree``."""
    table = agree.bcast(_read_record(path) if agree.rank == 0 else None, root=0)
    entry = table.get(key)
    known = -1.0 if not isinstance(entry, dict) else float(bool(entry.get("overlap")))
    both = np.array([known, -known])
    agree.Allreduce(both, slot="overlap facts", op="max")
    return bool(both[0]) if both[0] == -both[1] >= 0 else None


def _read_record(path: str | None) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        with open(path) as f:
            table = json.load(f)
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


def _write_record(agree: FlatComm, key: str, info: dict[str, Any], path: str | None) -> None:
    """Rank 0 adds the decision for every rank's ``key`` to the file (replaced
    whole: a reader never sees half of it). Collective over ``agree``."""
    keys = agree.gather(key, root=0)
    if agree.rank != 0 or path is None:
        return
    table = _read_record(path)
    entry = {"overlap": bool(info["choice"]), "during": info["during"], "after": info["after"]}
    table.update({k: entry for k in keys})
    try:
        with open(f"{path}.tmp", "w") as f:
            json.dump(table, f, indent=1)
        os.replace(f"{path}.tmp", path)
    except OSError:
        pass   # the agent's folder already gone: the next launch measures again


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"


def choose_overlap(dp: FlatComm, agree: FlatComm, ranges: list[Range], dtype: Any, xp: Any,
                   kind: str = "allreduce", slots: int = 0,
                   record: dict[str, Any] | None = None, repeats: int = 3,
                   margin: float = 0.05, budget: float | None = None) -> bool:
    """True when reducing buckets during the backward measured faster than after it.

    ``dp``: the group the buckets are reduced over; ``agree``: a group holding
    it whose ranks must all choose alike (the strategy's step group: the world
    for hybrid layouts, where each data group measures its own). ``ranges``:
    the strategy's bucket ranges in backward order; ``kind``: ``"allreduce"``
    (DDP) or ``"reduce_scatter"`` (ZeRO-2); ``slots``: the buffers the buckets
    take turns on (ZeRO-2: 2). ``budget``: seconds it may take, agreed over
    ``agree`` (`within_budget`): it times fewer
    rounds, or none (then False, with a ``"reason"``) where one would not fit;
    None: no limit. ``record`` receives ``{"choice", "during", "after",
    "reduction", "compute", "buckets"}`` (seconds, None where not timed;
    ``choice`` a bool). Collective over ``agree``.
    """
    started = time.perf_counter()
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
    compute = _Products(xp, dtype)
    # The sizing rounds are cheap (a reduction and 8 products): a quarter of the budget.
    product, reduction = _product_and_reduction(
        dp, agree, buckets, compute, repeats, None if budget is None else budget / 4)
    total = sum(len(r) for r in local)
    counts = [max(1, round(reduction / max(product, 1e-9) * len(r) / total)) for r in local]
    info.update(reduction=reduction, compute=product * sum(counts), buckets=len(local))
    ways = _stand_in_ways(buckets, local, counts, compute)
    if budget is None:
        info.update(time_alternatives(agree, ways, repeats))
    else:
        _time_within(agree, ways, repeats, budget, started, compute, info)
    timed = info["during"] is not None and info["after"] is not None
    info["choice"] = bool(timed and info["during"] < (1 - margin) * info["after"])
    if record is not None:
        record.update(info)
    return info["choice"]


def _time_within(agree: FlatComm, ways: dict[str, Callable[[], None]], repeats: int,
                 budget: float, started: float, compute: _Products,
                 info: dict[str, Any]) -> None:
    """The ways' times into ``info`` (None where not timed), in what is left of
    ``budget`` seconds since ``started``; a ``"reason"`` where none was timed.
    Collective over ``agree``."""
    left = budget - agree.allreduce_scalar(time.perf_counter() - started, op="max")
    # A round runs both ways, each the reduction and its compute; the warm-up
    # round and one timed round must fit (agreed values: every rank alike).
    round_ = 2 * (info["reduction"] + info["compute"])
    if 2 * round_ <= left:
        # The estimate is of a product alone: ranks sharing cores (more ranks
        # than cores on a node) compute slower together. The products stop at
        # the budget's end, the reductions go on: a round cut so is not timed.
        compute.deadline = started + budget
        info.update(time_alternatives(agree, ways, repeats, left))
        if agree.allreduce_scalar(float(compute.cut), op="max"):
            info.update(during=None, after=None)
            info["reason"] = (f"the probe's {budget:g} s budget ran out during a round "
                              f"(estimated ~{_ms(round_)}): its compute was cut")
    for way in ways:
        if info[way] is not None and not math.isfinite(info[way]):
            info[way] = None
    if (info["during"] is None or info["after"] is None) and "reason" not in info:
        info["reason"] = (f"the probe's {budget:g} s budget was spent before a timed "
                          f"round (a round: ~{_ms(round_)})")


class _Products:
    """The stand-in backward's compute: ``compute(count)`` runs ``count`` square
    matrix products in the parameters' dtype and waits for them; none after
    ``deadline`` (``time.perf_counter()``; host arrays: a device's products are
    queued, not run, when it is read), which sets ``cut``. Local."""

    def __init__(self, xp: Any, dtype: Any) -> None:
        self.xp = xp
        self.a = xp.full((_KERNEL, _KERNEL), 1.0 / _KERNEL, dtype=dtype)
        self.out = xp.empty_like(self.a)
        self.deadline = math.inf
        self.cut = False

    def __call__(self, count: int) -> None:
        for _ in range(count):
            if time.perf_counter() > self.deadline:
                self.cut = True
                break
            self.xp.matmul(self.a, self.a, out=self.out)
        synchronize(self.xp)


def _stand_in_ways(buckets: GradientBuckets, local: list[Range], counts: list[int],
                   compute: Callable[[int], None]) -> dict[str, Callable[[], None]]:
    """The stand-in backward both ways: ``counts[i]`` products before bucket ``i``
    is complete, its reduction launched from the hooks ("during") or all of them
    blocking after the compute ("after")."""
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

    return {"during": during, "after": after}


def _product_and_reduction(dp: FlatComm, agree: FlatComm, buckets: GradientBuckets,
                           compute: Callable[[int], None], repeats: int,
                           budget: float | None = None) -> tuple[float, float]:
    """One stand-in matrix product's time and the stand-in buckets' blocking
    reduction's, each the best of ``repeats`` (after a warm-up; fewer where the
    next would pass ``budget`` seconds, at least one) and agreed over ``agree``
    (the max): every rank then runs the same stand-in compute. Collective over
    ``agree``."""
    product = reduction = float("inf")
    started = time.perf_counter()
    for round_ in range(repeats + 1):
        t0 = time.perf_counter()
        compute(8)
        product = min(product, (time.perf_counter() - t0) / 8)
        dp.barrier()
        t0 = time.perf_counter()
        buckets.begin(True)
        buckets.flush()
        buckets.wait()
        reduction = min(reduction, time.perf_counter() - t0)
        if (budget is not None and 0 < round_ < repeats
                and not within_budget(agree, started, budget, round_ + 1)):
            break
    return (agree.allreduce_scalar(product, op="max"),
            agree.allreduce_scalar(reduction, op="max"))


def _stand_in_buckets(dp: FlatComm, ranges: list[Range], kind: str, dtype: Any, xp: Any,
                      slots: int) -> tuple[GradientBuckets, list[Range]]:
    """The strategy's first buckets (at most `PROBE_BUCKETS`) moved to start at
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
