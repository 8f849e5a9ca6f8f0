"""Spare ranks promoted in place after a lost rank (ULFM): the job goes on at full size.

``ShardingConfiguration(spares=K)`` sets the last ``K`` ranks apart
([`SparePool`][mpishard.comm.spares.SparePool]); their ``optimize()`` waits in
[`wait_as_spare`][mpishard.recovery.spares.wait_as_spare]. When training ranks
die, the survivors ([`promote_spares`][mpishard.recovery.spares.promote_spares]):

1. revoke and shrink the training world (the job's communicator is revoked with
   it: that wakes the spares), then shrink the job's communicator with the spares
   alive and gather who is who;
2. agree, among themselves, on the step they go on from and its state, as
   [`recover_in_place`][mpishard.recovery.recover_in_place] does (replicated
   state: the survivors at the newest step; sharded state: each survivor's own
   shard and the buddy copies of the lost ones, nothing whole); the lowest
   survivor sends what was agreed (a few small values) over the job's communicator;
3. *take seats*: the ``i``-th lost training rank's place goes to the ``i``-th
   spare alive (in rank order); the new training world is split from the job's
   communicator with each rank's old training rank (a spare: the lost one's) as
   key, so every rank keeps its place and every group is rebuilt at the same size
   with the same layout and rank order;
4. build the configuration over it (the same options), send the newcomers the
   parameters and the optimizer state point to point (replicated: each vector in
   pieces, one from every survivor at once; sharded: only the lost shards, from
   the buddy copies, by [`resplit`][mpishard.recovery.resplit.resplit]'s moves,
   and ZeRO-2's whole parameters by its ``Allgatherv``), rebuild the core on every
   rank without measuring again what was measured (the reducer, the overlap
   decision), and set the step count, skipped steps and data position.

Each ``Promoted`` event carries the seconds of each part on its rank
(``phases``: ``shrink``, ``job_shrink``, ``agree``, ``info``, ``split``,
``groups``, ``send``, ``rebuild``) and when it started (``started``,
``time.time()``), for ``benchmarks/bench_spares.py``. A spare serves every
``optimize()`` call of the script: a release ends one call, not its waiting.

The run then trains exactly the steps of the run that lost nothing, on the same
layout. In a 3D layout the newcomer takes the lost rank's tensor and pipeline
coordinates too, and its slice's state comes from its data-parallel group
([`mpishard.recovery.spares3d`][mpishard.recovery.spares3d]). Fewer spares than
lost ranks: every spare is promoted and the data-parallel size shrinks to what
is left (``data_parallel_size=-1``). A 3D layout with fewer spares alive than
lost ranks goes on as without spares: its broken replicas are dropped
([`drop_replicas`][mpishard.recovery.replicas.drop_replicas]; the spares alive
wait on for a later loss), or, no replica whole, it hands over. No spare left:
today's shrink. A rank lost during steps 3-4 revokes everything and every rank ends with
one line ([`HandOver`][mpishard.errors.HandOver], exit 75) naming the ranks.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..backend import array_namespace
from ..comm import FlatComm, ulfm
from ..comm.spares import SparePool
from ..config import ShardingConfiguration
from ..errors import HandOver
from ..exitcodes import EXIT_STOPPED
from ..flat import Range, shard_ranges
from ..parallel.options import REDUCE_METHODS
from ..parallel.overlap import known_decisions, learn_decisions
from ..parallel.reduction import known_reducers, learn_reducers, recalling_reducers
from ..protocols import StrategyCore
from ..topology import Topology
from .common import Recovered, StepMarks, error_text
from .inplace import communicators, recoverable
from .replicas import drop_replicas, whole_replicas
from .resplit import Moved, resplit
from .shardcopy import ShardBuddy, sharded_pieces, zero2_candidates
from .spares3d import agree_3d, send_state_3d, short_of_spares

__all__ = ["Promoted", "promote_spares", "seats", "staying_ranks", "wait_as_spare"]

#: The tag of the state's point-to-point messages to the newcomers.
_STATE_TAG = 0x5351


@dataclass
class Promoted(Recovered):
    """A recovery that promoted spares: the ``recovered`` record, ``"from": "spares"``,
    and ``promoted`` (the ``MPI.COMM_WORLD`` ranks of the spares, in the order of
    ``lost_ranks`` whose places they took), ``spares_left``, ``sent_bytes`` (what
    the newcomers received, together), ``state_seconds`` (the send and the
    rebuild), ``phases`` (seconds by part, on this rank) and ``started``
    (``time.time()`` at its start)."""

    promoted: list[int] = field(default_factory=list)
    spares_left: int = 0
    sent_bytes: int = 0
    state_seconds: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)
    started: float = 0.0

    def record(self) -> dict[str, Any]:
        out = super().record()
        out.update(promoted=self.promoted, spares_left=self.spares_left,
                   sent_bytes=self.sent_bytes, state_seconds=self.state_seconds,
                   phases=self.phases, started=self.started)
        return out


class _Clock:
    """The seconds of each part of a promotion on this rank (``phases``), and when
    it started (``time.time()``, to set against the kill's). Local."""

    def __init__(self) -> None:
        self.started = time.time()
        self.last = time.perf_counter()
        self.phases: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - self.last
        self.last = now


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
            (a 3D layout with one data-parallel replica, or too few spares and no
            whole replica), sharded state with no copy of a lost shard, or a rank
            lost during the promotion; on a dropped replica's alive ranks (exit 0),
            a 3D layout with too few spares going on without that replica.
    """
    if exc is not None and not ulfm.is_failure(exc):
        raise exc
    t0 = time.perf_counter()
    clock = _Clock()
    old = core.config
    pool = old.spare_pool
    rec = ulfm.recover(old.groups.world, core.step_count,
                       also=[*communicators(core), pool.job])
    clock.lap("shrink")
    job, every = pool.shrink(old.world.rank)       # who is alive: spares too
    clock.lap("job_shrink")
    problem = recoverable(core)
    stays = None
    if problem is None and core.drops_replicas:     # a 3D layout: spares3d.py
        lost, seated = seats(every, old.world.size)
        if len(seated) < len(lost):   # too few spares: as without them, if a replica is whole
            stays = staying_ranks(old.topology, every)
            if stays is None:
                problem = short_of_spares(len(lost), len(seated))
    info: dict[str, Any] = {"size": old.world.size, "dp": old.topology.dp, "step": rec.step,
                            "lost": rec.lost, "steps": rec.steps, "problem": problem,
                            "shrink_seconds": rec.seconds, "error": error_text(exc),
                            "layout3d": None, "stays": stays}
    held = None
    if problem is None and stays is None:
        held = _agree(core, buddy, marks, rec, info)
    clock.lap("agree")
    info = job.bcast(info, root=_first_trainer(every))
    clock.lap("info")
    if stays is not None:          # the broken replicas dropped, the spares kept waiting
        _keep_waiting(pool, job, every, stays)
        event = drop_replicas(core, rec, buddy=buddy, marks=marks, exc=exc)
        core.config.spare_pool = pool
        return core, event
    rec.world.free()
    event = _take_seats(core, old, pool, job, every, info, t0, held, clock)
    assert event is not None   # a training rank always has a seat
    return core, event


def _agree(core: StrategyCore, buddy: ShardBuddy | None, marks: StepMarks | None,
           rec: ulfm.Survivors, info: dict[str, Any]) -> Any:
    """Step 2 of the module docstring on the survivors ``rec.world``: the step they
    go on from and its state, into ``info`` (its ``problem`` where none can be
    agreed); what this rank holds of sharded state (or, in a 3D layout,
    [`agree_3d`][mpishard.recovery.spares3d.agree_3d]'s pieces), else None.
    Collective over ``rec.world``."""
    held, layout, step, problem = None, None, rec.step, None
    if core.drops_replicas:     # a 3D layout: spares3d.py
        step, held, problem, layout = agree_3d(core, buddy, rec.world)
    elif core.placement.recovery == "sharded":
        found = zero2_candidates(core, buddy, rec.world)
        if found:   # each survivor's own shard and the lost ones' copies, nothing whole
            step = max(found)
            held = sharded_pieces(core, buddy, rec.world, step)
        else:
            problem = ("the optimizer-state shard of a lost rank is gone (no buddy copy): "
                       "restart from a checkpoint")
    info.update(step=step, problem=problem, layout3d=layout)
    if problem is not None:
        return held
    marks = marks if marks is not None else StepMarks(core.step_count, core.skipped_steps,
                                                       core.data_position)
    info["skipped"], info["position"] = marks.agreed(
        rec.world, core, step, rec.world.allgather(core.step_count), rec.source)
    info["source"] = rec.world.bcast(core.config.world.rank, root=rec.source)
    info["names"] = ([(k, v.dtype.str) for k, v in held[0][1].items()]
                     if held is not None and layout is None else None)
    info["sharded_params"] = core.model.params is None    # ZeRO-3's
    # reduce_method="auto" was measured at the first attach, and a rebuild keeps
    # it: a newcomer takes it instead of measuring alone.
    info["reduce_method"] = getattr(core.reduction, "method", None)
    info["overlap"] = known_decisions()   # overlap="auto": decided as before
    info["reducers"] = known_reducers()   # and the reducers measured: not again
    return held


def staying_ranks(topology: Topology, every: list[int]) -> list[bool] | None:
    """A 3D layout with too few spares alive goes on as without spares: its broken
    replicas dropped ([`drop_replicas`][mpishard.recovery.replicas.drop_replicas]).
    Which ranks of the job's communicator stay (``every``: each one's old training
    rank, -1 on a spare): the whole replicas' and the spares; None when no
    replica is whole. Pure.

    Example, tp 2 x dp 2 x pp 2, rank 1 lost, no spare alive: ``every = [0, 2, 3,
    4, 5, 6, 7]`` gives replica 1's ranks 2, 3, 6, 7: ``[False, True, True, False,
    False, True, True]``.
    """
    kept, _ = whole_replicas(topology, [r for r in every if r >= 0])
    if not kept:
        return None
    return [r < 0 or topology.coordinates(r).dp in kept for r in every]


def _keep_waiting(pool: SparePool, job: FlatComm, every: list[int], stays: list[bool]) -> None:
    """After a shrink of ``job`` that promotes nobody (``stays``: which of its ranks
    go on, a dropped replica's leave): ``pool`` over the ranks that stay, its
    spares waiting again. Collective over ``job``."""
    child = job.split(0 if stays[job.rank] else 1, job.rank, "job")
    if not stays[job.rank]:
        child.free()
        return
    kept = [j for j, s in enumerate(stays) if s]
    pool.job = child
    pool.spares = [i for i, j in enumerate(kept) if every[j] < 0]


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
        clock = _Clock()
        job, every = pool.shrink(-1)
        clock.lap("job_shrink")
        if all(r < 0 for r in every):
            raise HandOver("spare rank woken, but every training rank is gone",
                           exit_code=EXIT_STOPPED, speaker=job.rank == 0)
        info = job.bcast(None, root=_first_trainer(every))
        clock.lap("info")
        event = _take_seats(core, config, pool, job, every, info, t0, None, clock)
        if event is not None:
            return event


def _first_trainer(every: list[int]) -> int:
    """The lowest rank of the job's communicator that trained (it speaks)."""
    return next(j for j, r in enumerate(every) if r >= 0)


def _take_seats(core: StrategyCore, template: ShardingConfiguration, pool: SparePool,
                job: FlatComm, every: list[int], info: dict[str, Any], t0: float,
                held: Any, clock: _Clock) -> Promoted | None:
    """Step 3-4 of the module docstring on every rank of ``job``; None on a spare
    left waiting (``pool`` over ``job`` now). ``held``: what a survivor holds of
    sharded state (``sharded_pieces``), or in a 3D layout ``agree_3d``'s state;
    None on a newcomer. Collective over ``job``."""
    if info.get("stays") is not None:    # nobody promoted: a spare waits again
        _keep_waiting(pool, job, every, info["stays"])
        return None
    lost, seated = seats(every, info["size"])
    mine = every[job.rank] if every[job.rank] >= 0 else seated.get(job.rank)
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
    clock.lap("split")
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
        clock.lap("groups")
        sent, seconds = _send_state(core, config, info, held, clock)
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
                    spares_left=pool.count, sent_bytes=sent, state_seconds=seconds,
                    phases=clock.phases, started=clock.started)


def _send_state(core: StrategyCore, config: ShardingConfiguration, info: dict[str, Any],
                held: Any, clock: _Clock) -> tuple[int, float]:
    """The agreed state to the ranks of ``config``'s world that lack it, point to
    point, ``core`` rebuilt over the world; ``(bytes the newcomers received,
    seconds)``. Sharded state: only the lost shards move (``resplit``: from the
    buddy copies to the newcomers); replicated state: the whole vectors, in
    pieces from every survivor at once; a 3D layout: by data-parallel group
    (`send_state_3d`). ``held``: what
    this rank holds (`_take_seats`).
    Collective over ``config.world``."""
    t0 = time.perf_counter()
    if core.reduction is None:   # a newcomer decides as the survivors did
        learn_decisions(info["overlap"])
        learn_reducers(info["reducers"])
        if info["reduce_method"] in REDUCE_METHODS and hasattr(core.options, "reduce_method"):
            core.replace_options(reduce_method=info["reduce_method"])
    if info.get("layout3d") is not None:
        return send_state_3d(core, config, info, held), time.perf_counter() - t0
    if info["names"] is not None:
        sent = _move_shards(core, config, info, held or [], clock)
    else:
        sent = _send_replicated(core, config, info, clock)
    return sent, time.perf_counter() - t0


def _pieces_to(group: FlatComm, vector: Any, senders: list[int], receivers: list[int],
               name: str) -> None:
    """``vector`` from the ``senders`` of ``group`` (who hold it) to its
    ``receivers``: cut in ``len(senders)`` pieces, piece ``i`` from sender ``i``,
    all at once. Point-to-point over ``group`` (its members in either list)."""
    cuts = shard_ranges(len(vector), len(senders))
    me = group.rank
    if me in senders:
        piece = cuts[senders.index(me)]
        handles = [group.Isend(vector[piece.start:piece.stop], r, _STATE_TAG,
                               slot=("spares", name, r)) for r in receivers if len(piece)]
        for handle in handles:
            handle.wait()
    elif me in receivers:
        for sender, piece in zip(senders, cuts):
            if len(piece):
                group.Recv(vector[piece.start:piece.stop], sender, _STATE_TAG,
                           slot=("spares", name))


def _send_replicated(core: StrategyCore, config: ShardingConfiguration, info: dict[str, Any],
                     clock: _Clock) -> int:
    """Replicated state (DDP): the newcomers and any survivor behind the agreed
    step receive the parameters and the optimizer state from the survivors at it
    (``_pieces_to``). Collective over
    ``config.world``."""
    world, model = config.world, core.model
    behind = core.reduction is None or core.step_count != info["step"]
    wants = world.allgather(bool(behind))
    senders = [r for r, w in enumerate(wants) if not w]
    receivers = [r for r, w in enumerate(wants) if w]
    _pieces_to(world, model.params, senders, receivers, "params")
    clock.lap("send")
    old = None if behind else dict(core.state)
    with recalling_reducers():     # measured before, on the same layout
        core.rebuild(config, agreed=True)
    clock.lap("rebuild")
    for name in sorted(core.state):
        if old is not None:
            core.state[name][...] = old[name]
        _pieces_to(world, core.state[name], senders, receivers, name)
    clock.lap("send")
    per_rank = model.params.nbytes + sum(v.nbytes for v in core.state.values())
    return per_rank * len(receivers)


def _move_shards(core: StrategyCore, config: ShardingConfiguration, info: dict[str, Any],
                 pieces: list[tuple[Range, dict[str, Any]]], clock: _Clock) -> int:
    """Sharded state (ZeRO-2, ZeRO-3): the same split as before the loss, so each
    survivor keeps its shard and a newcomer receives the lost one from the buddy
    copy that holds it ([`resplit`][mpishard.recovery.resplit.resplit]); ZeRO-2's
    whole parameters are then put together by its ``Allgatherv`` (a survivor's
    may be half-gathered). Collective over ``config.world`` (the data group)."""
    dp, model = config.groups.dp, core.model
    xp = core.xp if getattr(core, "xp", None) is not None else array_namespace(model.params)
    dtypes = {name: np.dtype(dtype) for name, dtype in info["names"]}
    shards = shard_ranges(model.layout.size, dp.size)
    new = shards[dp.rank]
    newcomer = core.reduction is None
    moved = Moved()
    params_type = {"params": dtypes.pop("params")}
    if info["sharded_params"]:        # ZeRO-3: kept sharded, nothing whole
        shard = resplit(dp, pieces, new, params_type, xp, moved)["params"]
        if newcomer:                  # its own whole vector, sharded by the attach
            model.params[new.start:new.stop] = shard
    else:
        resplit(dp, pieces, new, params_type, xp, moved,
                out={"params": model.params[new.start:new.stop]})
        if dp.size > 1:
            dp.Allgatherv(model.params, [len(s) for s in shards], slot="recovery")
    clock.lap("send")
    with recalling_reducers():
        core.rebuild(config, shard=None if newcomer or not info["sharded_params"] else shard,
                     agreed=True)
    clock.lap("rebuild")
    resplit(dp, pieces, new, dtypes, xp, moved, out=core.state)
    clock.lap("send")
    counts = dp.allgather(int(newcomer))
    itemsizes = {name: np.dtype(dtype).itemsize for name, dtype in info["names"]}
    received = 0
    for held, joined in zip(shards, counts):
        if joined:   # its shard of each vector, and ZeRO-2's gathered parameters
            received += len(held) * sum(itemsizes.values())
            if not info["sharded_params"]:
                received += (model.layout.size - len(held)) * itemsizes["params"]
    return received
