"""Spare ranks promoted in place after a lost rank (ULFM): the job goes on at full size.

``ShardingConfiguration(spares=K)`` sets the last ``K`` ranks apart
([`SparePool`][mpishard.comm.spares.SparePool]); their ``optimize()`` waits in
[`wait_as_spare`][mpishard.recovery.spares.wait_as_spare]. When training ranks
die, the survivors ([`promote_spares`][mpishard.recovery.spares.promote_spares]):

1. revoke and shrink the training world (the job's communicator is revoked with
   it: that wakes the spares) and agree, among themselves, on the step they go on
   from and its state, as [`recover_in_place`][mpishard.recovery.recover_in_place]
   does (replicated state: the lowest survivor at the newest step; sharded state:
   put together from their shards and the buddy copies);
2. shrink the job's communicator with the spares alive and gather who is who; the
   lowest survivor sends what was agreed;
3. *take seats*: the ``i``-th lost training rank's place goes to the ``i``-th
   spare alive (in rank order); the new training world is split from the job's
   communicator with each rank's old training rank (a spare: the lost one's) as
   key, so every rank keeps its place and every group is rebuilt at the same size
   with the same layout and rank order;
4. build the configuration over it (the same options), send the newcomers the
   parameters and the optimizer state (a ``Bcast`` from that survivor; sharded
   state whole, each rank keeping its shard), rebuild the core on every rank and
   set the step count, skipped steps and data position of the agreed step.

The run then trains exactly the steps of the run that lost nothing, on the same
layout. In a 3D layout the newcomer takes the lost rank's tensor and pipeline
coordinates too, and its slice's state comes from its data-parallel group
([`mpishard.recovery.spares3d`][mpishard.recovery.spares3d]). Fewer spares than
lost ranks: every spare is promoted and the data-parallel size shrinks to what
is left (``data_parallel_size=-1``; a 3D layout hands over). No spare left:
today's shrink. A rank lost during steps 3-4 revokes everything and every rank ends with
one line ([`HandOver`][mpishard.errors.HandOver], exit 75) naming the ranks.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..comm import FlatComm, ulfm
from ..comm.spares import SparePool
from ..config import ShardingConfiguration
from ..errors import HandOver
from ..exitcodes import EXIT_STOPPED
from ..parallel.options import REDUCE_METHODS
from ..parallel.overlap import known_decisions, learn_decisions
from ..protocols import StrategyCore
from .common import Recovered, StepMarks, error_text, put_state
from .inplace import communicators, recoverable
from .shardcopy import ShardBuddy, zero2_candidates, zero2_rebuild
from .spares3d import agree_3d, send_state_3d, short_of_spares

__all__ = ["Promoted", "promote_spares", "seats", "wait_as_spare"]


@dataclass
class Promoted(Recovered):
    """A recovery that promoted spares: the ``recovered`` record, ``"from": "spares"``,
    and ``promoted`` (the ``MPI.COMM_WORLD`` ranks of the spares, in the order of
    ``lost_ranks`` whose places they took), ``spares_left``, ``sent_bytes`` (what
    each newcomer received) and ``state_seconds`` (the send)."""

    promoted: list[int] = field(default_factory=list)
    spares_left: int = 0
    sent_bytes: int = 0
    state_seconds: float = 0.0

    def record(self) -> dict[str, Any]:
        out = super().record()
        out.update(promoted=self.promoted, spares_left=self.spares_left,
                   sent_bytes=self.sent_bytes, state_seconds=self.state_seconds)
        return out


def seats(every: list[int], size: int) -> tuple[list[int], dict[int, int]]:
    """``(lost, seats)`` after a shrink of the job's communicator: ``every`` is each
    rank's old training rank (-1: a spare), ``size`` the old training world's size;
    ``lost`` the old training ranks gone, ``seats`` job rank -> the lost rank it
    takes (the ``i``-th lost rank to the ``i``-th spare). Pure.

    Example: ``every = [0, 2, 3, -1, -1]``, ``size = 4``: ``([1], {3: 1})``.
    """
    present = {r for r in every if r >= 0}
    lost = [r for r in range(size) if r not in present]
    waiting = [j for j, r in enumerate(every) if r < 0]
    return lost, dict(zip(waiting, lost))


def promote_spares(core: StrategyCore, exc: BaseException | None = None, *,
                   buddy: ShardBuddy | None = None, marks: StepMarks | None = None
                   ) -> tuple[StrategyCore, Promoted]:
    """After a lost training rank, with spares waiting: ``core`` rebuilt at full
    size over the survivors and the promoted spares (the module docstring says
    how), and the event. Collective over the survivors and the spares alive.

    Raises:
        HandOver: on every rank (exit 75): a core that cannot be rebuilt so
            (a 3D layout with one data-parallel replica), sharded state with no
            copy of a lost shard, or a rank lost during the promotion.
    """
    if exc is not None and not ulfm.is_failure(exc):
        raise exc
    t0 = time.perf_counter()
    old = core.config
    pool = old.spare_pool
    rec = ulfm.recover(old.groups.world, core.step_count,
                       also=[*communicators(core), pool.job])
    problem = recoverable(core)
    step, full, layout = rec.step, None, None
    if problem is None and core.drops_replicas:     # a 3D layout: spares3d.py
        step, full, problem, layout = agree_3d(core, buddy, rec.world)
    elif problem is None and core.placement.recovery == "sharded":
        found = zero2_candidates(core, buddy, rec.world)
        if found:
            step = max(found)
            params, state = zero2_rebuild(core, buddy, rec.world, step)
            core.whole_parameters(params)
            full = {"params": params, **state}
        else:
            problem = ("the optimizer-state shard of a lost rank is gone (no buddy copy): "
                       "restart from a checkpoint")
    info: dict[str, Any] = {"size": old.world.size, "dp": old.topology.dp, "step": step,
                            "lost": rec.lost, "steps": rec.steps, "problem": problem,
                            "shrink_seconds": rec.seconds, "error": error_text(exc),
                            "layout3d": layout}
    if problem is None:
        marks = marks if marks is not None else StepMarks(core.step_count, core.skipped_steps,
                                                           core.data_position)
        info["skipped"], info["position"] = marks.agreed(
            rec.world, core, step, rec.world.allgather(core.step_count), rec.source)
        info["source"] = rec.world.bcast(old.world.rank, root=rec.source)
        info["names"] = ([(k, v.dtype.str) for k, v in full.items()] if full is not None
                         else None)
        # reduce_method="auto" was measured at the first attach, and a rebuild keeps
        # it: a newcomer takes it instead of measuring alone.
        info["reduce_method"] = getattr(core.reduction, "method", None)
        info["overlap"] = known_decisions()   # overlap="auto": decided as before
    job, every = pool.shrink(old.world.rank)
    info = job.bcast(info, root=_first_trainer(every))
    rec.world.free()
    event = _take_seats(core, old, pool, job, every, info, t0, full)
    assert event is not None   # a training rank always has a seat
    return core, event


def wait_as_spare(core: StrategyCore, model: Any) -> Promoted | None:
    """A spare's ``optimize()``: wait (sleeping) until released (None: training
    ended without it) or promoted (``core`` is then attached to ``model`` over the
    new training world, with the lost rank's state and place; the event). Point-
    to-point on the job's communicator while waiting; then collective over the
    survivors and the spares alive.

    Raises:
        HandOver: as [`promote_spares`][mpishard.recovery.spares.promote_spares].
    """
    config = core.config
    pool = config.spare_pool
    core.model = model if core.model is None else core.model
    while True:
        if pool.wait() == "release":
            return None
        t0 = time.perf_counter()
        job, every = pool.shrink(-1)
        if all(r < 0 for r in every):
            raise HandOver("spare rank woken, but every training rank is gone",
                           exit_code=EXIT_STOPPED, speaker=job.rank == 0)
        info = job.bcast(None, root=_first_trainer(every))
        event = _take_seats(core, config, pool, job, every, info, t0, None)
        if event is not None:
            return event


def _first_trainer(every: list[int]) -> int:
    """The lowest rank of the job's communicator that trained (it speaks)."""
    return next(j for j, r in enumerate(every) if r >= 0)


def _take_seats(core: StrategyCore, template: ShardingConfiguration, pool: SparePool,
                job: FlatComm, every: list[int], info: dict[str, Any], t0: float,
                full: dict[str, Any] | None) -> Promoted | None:
    """Step 3-4 of the module docstring on every rank of ``job``; None on a spare
    left waiting (``pool`` over ``job`` now). Collective over ``job``."""
    lost, seated = seats(every, info["size"])
    mine = every[job.rank] if every[job.rank] >= 0 else seated.get(job.rank)
    if info.get("layout3d") is not None and info["problem"] is None:
        info["problem"] = short_of_spares(len(lost), len(seated))
    speaker = job.rank == _first_trainer(every)
    if info["problem"] is not None:
        raise HandOver(f"lost world rank(s) {info['lost']} after step {info['step']}, "
                       f"spares not promoted: {info['problem']}",
                       exit_code=EXIT_STOPPED, speaker=speaker)
    pool.job = job
    pool.spares = [j for j, r in enumerate(every) if r < 0 and j not in seated]
    child = job.split(0 if mine is not None else 1, mine if mine is not None else 0, "training")
    if mine is None:       # not needed this time: wait again
        child.free()
        return None
    world_ranks = job.world_ranks()
    promoted = [world_ranks[j] for j in seated]
    config = None
    try:
        config = dataclasses.replace(
            template, comm=child.comm,
            data_parallel_size=info["dp"] if len(seated) == len(lost) else -1)
        config.spare_pool = pool
        groups = config.groups
        ulfm.enable([groups.world, groups.dp, groups.tp, groups.pp],
                    evict_stuck=template.evict_stuck)
        sent, seconds = _send_state(core, config, info, mine == info["source"], full)
    except Exception as exc:
        if not ulfm.is_failure(exc):
            raise
        comms = [job, child, *(communicators(core) if core.model is not None else [])]
        if config is not None and config._groups is not None:
            g = config.groups
            comms += [g.world, g.dp, g.tp, g.pp]
        SparePool.revoke(comms)
        raise HandOver(f"a rank was lost while spare world rank(s) {promoted} took the "
                       f"place(s) of lost training rank(s) {lost} (world rank(s) "
                       f"{info['lost']}): {error_text(exc)}; restart from a checkpoint",
                       exit_code=EXIT_STOPPED, speaker=speaker) from None
    core.set_progress(step_count=info["step"], skipped_steps=info["skipped"],
                      data_position=info["position"])
    return Promoted(lost_ranks=info["lost"], step=info["step"],
                    world_size=config.world.size, seconds=time.perf_counter() - t0,
                    shrink_seconds=info["shrink_seconds"], survivor_steps=info["steps"],
                    source="spares", error=info["error"], promoted=promoted,
                    spares_left=pool.count, sent_bytes=sent, state_seconds=seconds)


def _send_state(core: StrategyCore, config: ShardingConfiguration, info: dict[str, Any],
                source: bool, full: dict[str, Any] | None) -> tuple[int, float]:
    """The agreed state from the survivor ``source`` to every rank of ``config``'s
    world, ``core`` rebuilt over it; ``(bytes each newcomer received, seconds)``.
    ``full``: the whole sharded state (params and optimizer state) on a survivor,
    None on a newcomer or for replicated state. Collective over ``config.world``."""
    if info.get("layout3d") is not None:   # a 3D layout: by data-parallel group
        t0 = time.perf_counter()
        return send_state_3d(core, config, info, full), time.perf_counter() - t0
    t0 = time.perf_counter()
    world = config.world
    root = world.allgather(bool(source)).index(True)
    model = core.model
    if core.reduction is None:   # a newcomer decides as the survivors did
        learn_decisions(info["overlap"])
        if info["reduce_method"] in REDUCE_METHODS and hasattr(core.options, "reduce_method"):
            core.replace_options(reduce_method=info["reduce_method"])
    sent = 0
    if info["names"] is not None:       # sharded: the whole vectors, each keeps its shard
        if full is None:
            full = {name: np.empty(model.layout.size, dtype=np.dtype(dtype))
                    for name, dtype in info["names"]}
        for name, _ in info["names"]:
            world.Bcast(full[name], root=root, slot=("spares", name))
            sent += full[name].nbytes
        if model.params is not None:   # a newcomer's own vector, or whole_parameters' one
            model.params[...] = full["params"]
        core.rebuild(config)
        put_state(core, {k: v for k, v in full.items() if k != "params"}, {}, world, root)
        return sent, time.perf_counter() - t0
    world.Bcast(model.params, root=root, slot=("spares", "params"))
    sent += model.params.nbytes
    old_state = dict(core.state) if core.placement is not None else None
    core.rebuild(config)
    put_state(core, None, old_state if old_state is not None else dict(core.state), world, root)
    sent += sum(v.nbytes for v in core.state.values())
    return sent, time.perf_counter() - t0
