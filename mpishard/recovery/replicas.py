"""Going on in place after a rank of a 3D layout died (ULFM): whole replicas dropped.

A *replica* is the ``tp * pp`` ranks with one data-parallel coordinate: together
they hold the whole model once. A lost rank held a tensor slice of one pipeline
stage that only its own replica has, so the replicas that lost a member cannot
go on; every other replica is whole. Dropping the broken ones leaves a layout
with ``dp'`` = the whole replicas and the same ``tp`` and ``pp``, and every rank
that stays keeps its own tensor coordinate and pipeline stage: its parameters
are its own. Worked example, 8 ranks, tp=2, dp=2, pp=2 (``rank = (pp_rank * dp +
dp_rank) * tp + tp_rank``): replica 0 is ranks {0, 1, 4, 5}, replica 1 is
{2, 3, 6, 7}. World rank 6 dies: replica 1 is dropped (ranks 2, 3 and 7 leave,
after helping), replica 0 goes on as a 4-rank job with dp=1, its ranks 0, 1, 4,
5 renumbered 0, 1, 2, 3 (the split keeps the old order, so the ``tp-dp-pp``
order of :mod:`mpishard.topology` still holds).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterable
from typing import Any

from ..comm import FlatComm, ulfm, world_rank
from ..errors import HandOver
from ..exitcodes import EXIT_STOPPED
from ..parallel import HybridCore, HybridShardedModel, HybridZeRO2Core, ZeRO2Core
from ..topology import Topology
from .common import StepMarks, survivors_config
from .shardcopy import ShardBuddy, zero2_candidates, zero2_rebuild

__all__ = ["drop_replicas", "whole_replicas"]


def whole_replicas(topology: Topology, alive: Iterable[int]
                   ) -> tuple[list[int], dict[int, list[int]]]:
    """Which replicas of ``topology`` are whole when only the world ranks ``alive``
    are left: ``(kept, lost)``, the whole replicas' data-parallel coordinates in
    order (their new coordinates are their places in it) and, for each other
    replica, its lost world ranks. Pure.

    Example, 8 ranks, tp=2, dp=2, pp=2, rank 6 lost: ``([0], {1: [6]})``.
    """
    left = set(alive)
    lost: dict[int, list[int]] = {}
    for r in range(topology.world):
        if r not in left:
            lost.setdefault(topology.coordinates(r).dp, []).append(r)
    return [d for d in range(topology.dp) if d not in lost], lost


def drop_replicas(strategy: HybridCore, rec: ulfm.Recovery, *,
                  buddy: ShardBuddy | None = None, marks: StepMarks | None = None,
                  exc: BaseException | None = None) -> dict[str, Any]:
    """After a rank failure in a 3D layout: drop every replica that lost a rank
    and set ``strategy`` (and its :class:`~mpishard.parallel.hybrid.HybridShardedModel`)
    up again in place over the ranks of the whole replicas; the ``recovered``
    event. Collective over ``rec.world`` (every survivor calls it).

    ``rec``: what :func:`mpishard.comm.ulfm.recover` agreed, over the old world,
    with every communicator of the strategy and model revoked too (``also=``:
    a rank waiting on a group without the dead rank must leave it). ``buddy``:
    ZeRO-2's :class:`~mpishard.recovery.ShardBuddy`. ``marks``: this rank's
    :class:`~mpishard.recovery.common.StepMarks` (the training loop's). ``exc``:
    the failure, for the event's ``error``.

    * The survivors of the whole replicas form a new world (a split of
      ``rec.world`` in the old rank order), a new
      :class:`~mpishard.ShardingConfiguration` over it (the old options,
      ``data_parallel_size`` = the whole replicas, errors returned), the model
      built again over it (same object) with each rank's own parameters, and
      ``strategy`` itself rebuilt over it (same object and options).
    * **Hybrid DDP**: every data-parallel rank holds parameters and optimizer
      state whole; the run goes on from the newest step that a kept rank of
      every (tensor, stage) coordinate completed (the survivors may differ by
      one: the update after the step's ``Allreduce`` is local), each coordinate
      taking them from its lowest kept rank at that step.
    * **Hybrid ZeRO-2**: each (tensor, stage) data-parallel group (its alive
      ranks in dropped replicas included) puts its parameters and state together
      at the newest step every group can rebuild exactly (its survivors' shards
      and the buddy copies of the lost ones), resharded over the kept ranks.
    * ``step_count``, ``skipped_steps`` and the data position: that step's (a
      survivor's ``marks``; without them, a survivor at that step).

    The alive ranks of dropped replicas, once they have helped, raise
    :class:`~mpishard.errors.HandOver` with exit code 0 (each says its own line):
    the training loop ends their process.

    Returns:
        ``{"event": "recovered", "lost_ranks", "step", "world_size", "seconds",
        "shrink_seconds", "survivor_steps", "rolled_back_from": None, "from":
        "replica", "error", "dropped_ranks", "data_parallel_size"}`` (ranks of
        ``MPI.COMM_WORLD``).

    Raises:
        HandOver: on every survivor (exit 75, rank 0 of ``rec.world`` speaks): no
            replica is whole; hybrid DDP with no step held at every (tensor,
            stage) coordinate of the kept replicas; ZeRO-2 without a step every
            data group can rebuild exactly. On a dropped replica's alive ranks
            (exit 0), after they helped.
        TypeError: ``strategy`` is not an attached hybrid strategy (on every rank).
    """
    t0 = time.perf_counter()
    world = rec.world
    model = strategy.model
    world.agree(None if isinstance(strategy, HybridCore)
                and isinstance(model, HybridShardedModel) else
                f"drop_replicas needs a hybrid core attached to a "
                f"HybridShardedModel, got {type(strategy).__name__} with "
                f"{type(model).__name__}", TypeError)
    old = strategy.config
    topo = old.topology
    me = old.groups.coordinates
    # One allgather decides everything: who is left where, and at which step.
    every = world.allgather((old.groups.world.rank, me.dp, me.tp, me.pp, strategy.step_count))
    kept, broken = whole_replicas(topo, [r for r, *_ in every])
    # Strategy._who[r] = (dp rank, MPI.COMM_WORLD rank) of old world rank r, gathered
    # at attach over the world (a hybrid strategy's step group), while all were alive.
    to_comm_world = [w for _, w in strategy._who]
    lost_by_replica = {d: [to_comm_world[r] for r in lost] for d, lost in broken.items()}
    zero2 = isinstance(strategy, ZeRO2Core)     # ZeRO-3's shards too

    def hand_over(why: str) -> HandOver:
        return HandOver(f"cannot recover in place: {why}; restart from a checkpoint",
                        exit_code=EXIT_STOPPED, speaker=world.rank == 0)

    if not kept:
        what = "; ".join(f"replica {d} lost world rank(s) {lost}"
                         for d, lost in sorted(lost_by_replica.items()))
        raise hand_over(f"no model replica is whole ({what}) in a layout with "
                        f"tensor_parallel_size={topo.tp} and pipeline_parallel_size={topo.pp}")
    full = None
    if not zero2:
        # The newest step at which every (tensor, stage) coordinate has a kept rank
        # (the step's update is local: the survivors may differ by one step); each
        # coordinate's new data group takes parameters and state from that rank.
        counts: dict[tuple[int, int], dict[int, int]] = {}   # (tp, pp) -> step -> new dp
        for _, d, t, p, count in sorted(every, key=lambda e: e[1]):
            if d in kept:
                counts.setdefault((t, p), {}).setdefault(count, kept.index(d))
        common = set.intersection(*(set(c) for c in counts.values()))
        if not common:
            raise hand_over(
                f"the survivors of the whole replicas {kept} disagree on the last completed "
                f"step and no step is held at every (tensor, stage) coordinate "
                f"({', '.join(f'{k}: {sorted(v)}' for k, v in sorted(counts.items()))})")
        step = max(common)
        root = counts[(me.tp, me.pp)][step] if me.dp in kept else 0
    else:
        step, full = _zero2_rebuild(strategy, buddy, world, me, hand_over)
    # Skipped steps and the data position at that step: a survivor's mark of it,
    # else the own ones of a survivor that is at that step (of rec.source otherwise).
    marks = marks if marks is not None else StepMarks(
        strategy.step_count, strategy.skipped_steps, strategy.data_position)
    skipped, position = marks.agreed(world, strategy, step, [e[4] for e in every], rec.source)
    mine_kept = me.dp in kept
    # The old rank order as key: the tp-dp-pp order holds over the kept ranks.
    child = world.split(0 if mine_kept else 1, old.groups.world.rank, "world")
    if not mine_kept:
        raise HandOver(f"world rank {world_rank()} (host {socket.gethostname()}): dropped "
                       f"with replica {me.dp}, which lost world rank(s) "
                       f"{lost_by_replica[me.dp]}; {len(kept) * topo.tp * topo.pp} ranks go on",
                       exit_code=0, speaker=True)
    dropped = sorted(to_comm_world[r] for r, d, *_ in every if d not in kept)

    config = survivors_config(old, child.comm)
    groups = config.groups
    state = strategy.state
    model.rebuild(config)          # the same object, this rank's parameters kept
    if zero2:
        params_full, state_full = full
        model.params[...] = params_full
    else:
        groups.dp.Bcast(model.params, root=root)
    # The same object, set up again over the kept ranks (attach: buckets, state).
    strategy.rebuild(config)
    if zero2:
        for name, value in state_full.items():
            strategy.state[name][...] = value[strategy.shard.start:strategy.shard.stop]
    else:
        for name, value in state.items():
            strategy.state[name][...] = value
            groups.dp.Bcast(strategy.state[name], root=root)
    strategy.step_count = step
    strategy.skipped_steps, strategy.data_position = skipped, position
    return {"event": "recovered", "lost_ranks": rec.lost, "step": step,
            "world_size": groups.world.size, "seconds": rec.seconds + time.perf_counter() - t0,
            "shrink_seconds": rec.seconds, "survivor_steps": rec.steps,
            "rolled_back_from": None, "from": "replica",
            "error": exc.Get_error_string() if hasattr(exc, "Get_error_string") else None,
            "dropped_ranks": dropped, "data_parallel_size": config.topology.dp}


def _zero2_rebuild(strategy: HybridZeRO2Core, buddy: ShardBuddy | None, world: FlatComm,
                   me: Any, hand_over: Callable[[str], HandOver]
                   ) -> tuple[int, tuple[Any, dict[str, Any]]]:
    """ZeRO-2: the newest step every (tensor, stage) data-parallel group can put
    together exactly, and this rank's group's ``(params, state)`` at it (whole
    stage vectors). Collective over ``world`` (every survivor, dropped or kept)."""
    topo = strategy.config.topology
    # The survivors of this rank's old data-parallel group, in the old dp order.
    group = world.split(me.pp * topo.tp + me.tp, me.dp, "data-parallel survivors")
    try:
        mine = zero2_candidates(strategy, buddy, group)
        common = set.intersection(*map(set, world.allgather(sorted(mine))))
        if not common:
            raise hand_over("ZeRO-2 lost optimizer-state shards: there is no step at which "
                            "every data-parallel group can put its state together from its "
                            "survivors' shards and buddy copies")
        step = max(common)
        return step, zero2_rebuild(strategy, buddy, group, step)
    finally:
        group.free()
