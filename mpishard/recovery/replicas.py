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
order of [`mpishard.topology`][mpishard.topology] still holds).

The survivors of the whole replicas form a new world (a split in the old rank
order) and configuration (the old options, errors returned); the model and the
core are rebuilt over it as the same objects, each rank keeping its parameters.
**Hybrid DDP** goes on from the newest step a kept rank of every (tensor, stage)
coordinate completed (the update after the step's ``Allreduce`` is local: the
survivors may differ by one), each coordinate taking parameters and state from
its lowest kept rank at that step. **Hybrid ZeRO-2 and ZeRO-3**: each (tensor,
stage) data-parallel group, its alive ranks in dropped replicas included, goes
on from the newest step every group can rebuild exactly (its survivors' shards
and the buddy copies of the lost ones); nothing of the state is put together:
the survivors move the state shards they hold (their own, the buddy copies of
the lost ones) straight to the kept ranks' new shards
([`resplit`][mpishard.recovery.resplit.resplit]). ZeRO-3's parameter shards go
the same way, the stage built again in shards; ZeRO-2's parameters, whole on
every rank anyway, go from the same shards to each kept rank's whole vector.
The step count, skipped steps and data position are that step's. The alive
ranks of dropped replicas, once they have helped, raise
[`HandOver`][mpishard.errors.HandOver] with exit code 0 (each says its own line).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterable
from typing import Any

from ..comm import FlatComm, ulfm, world_rank
from ..errors import HandOver
from ..exitcodes import EXIT_STOPPED
from ..flat import Range, shard_ranges
from ..protocols import RecoverableCore
from ..topology import Topology
from .common import Recovered, StepMarks, error_text, put_state, survivors_config
from .resplit import Moved, resplit
from .shardcopy import ShardBuddy, sharded_pieces, zero2_candidates

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


def drop_replicas(strategy: RecoverableCore, rec: ulfm.Survivors, *,
                  buddy: ShardBuddy | None = None, marks: StepMarks | None = None,
                  exc: BaseException | None = None) -> Recovered:
    """After a rank failure in a 3D layout: drop every replica that lost a rank
    and rebuild ``strategy`` and its model in place over the whole replicas (the
    module docstring says how); the ``recovered`` event (``"from": "replica"``,
    with ``dropped_ranks`` and ``data_parallel_size``). ``rec``: what
    [`ulfm.recover`][mpishard.comm.ulfm.recover] agreed; ``buddy``, ``marks``, ``exc``: as
    [`recover_in_place`][mpishard.recovery.recover_in_place]'s. Collective over ``rec.world``.

    Raises:
        HandOver: on every survivor (exit 75, rank 0 of ``rec.world`` speaks): no
            replica is whole; hybrid DDP with no step held at every (tensor,
            stage) coordinate of the kept replicas; ZeRO-2 without a step every
            data group can rebuild exactly. On a dropped replica's alive ranks
            (exit 0), after they helped.
        TypeError: ``strategy`` is not an attached hybrid core (on every rank).
    """
    t0 = time.perf_counter()
    world = rec.world
    _check_attached(strategy, world)
    old = strategy.config
    topo = old.topology
    me = old.groups.coordinates
    # One allgather decides everything: who is left where, and at which step.
    every = world.allgather((old.groups.world.rank, me.dp, me.tp, me.pp, strategy.step_count))
    kept, broken = whole_replicas(topo, [r for r, *_ in every])
    # totals.who[r] = (dp rank, MPI.COMM_WORLD rank) of old world rank r, gathered
    # at attach over the world (a hybrid strategy's step group), while all were alive.
    to_comm_world = [w for _, w in strategy.totals.who]
    lost_by_replica = {d: [to_comm_world[r] for r in lost] for d, lost in broken.items()}

    def hand_over(why: str) -> HandOver:
        return HandOver(f"cannot recover in place: {why}; restart from a checkpoint",
                        exit_code=EXIT_STOPPED, speaker=world.rank == 0)

    if not kept:
        what = "; ".join(f"replica {d} lost world rank(s) {lost}"
                         for d, lost in sorted(lost_by_replica.items()))
        raise hand_over(f"no model replica is whole ({what}) in a layout with "
                        f"tensor_parallel_size={topo.tp} and pipeline_parallel_size={topo.pp}")
    step, root, group = _step_to_go_on(strategy, buddy, world, every, kept, hand_over)
    # Skipped steps and the data position at that step: a survivor's mark of it,
    # else the own ones of a survivor that is at that step (of rec.source otherwise).
    marks = marks if marks is not None else StepMarks(
        strategy.step_count, strategy.skipped_steps, strategy.data_position)
    skipped, position = marks.agreed(world, strategy, step, [e[4] for e in every], rec.source)
    mine_kept = me.dp in kept
    # The old rank order as key: the tp-dp-pp order holds over the kept ranks.
    child = world.split(0 if mine_kept else 1, old.groups.world.rank, "world")
    moved = Moved()
    if group is not None:
        config = survivors_config(old, child.comm) if mine_kept else None
        try:
            _resplit_kept(strategy, config, group, buddy, step, moved)
        finally:
            group.free()
    if not mine_kept:
        raise _dropped(me.dp, lost_by_replica[me.dp], len(kept) * topo.tp * topo.pp)
    dropped = sorted(to_comm_world[r] for r, d, *_ in every if d not in kept)

    if group is None:
        config = survivors_config(old, child.comm)
        _rebuild_kept(strategy, config, root)
    strategy.set_progress(step_count=step, skipped_steps=skipped, data_position=position)
    groups = config.groups
    return Recovered(lost_ranks=rec.lost, step=step, world_size=groups.world.size,
                     seconds=rec.seconds + time.perf_counter() - t0,
                     shrink_seconds=rec.seconds, survivor_steps=rec.steps, source="replica",
                     error=error_text(exc), dropped_ranks=dropped,
                     data_parallel_size=config.topology.dp,
                     moved_bytes=moved.bytes if group is not None else None)


def _check_attached(strategy: Any, world: FlatComm) -> None:
    """A TypeError on every rank of ``world`` unless ``strategy`` is a hybrid core
    attached to a ``HybridShardedModel``. Collective over ``world``."""
    world.agree(None if isinstance(strategy, RecoverableCore) and strategy.drops_replicas
                and strategy.recovery_problem() is None else
                f"drop_replicas needs a hybrid core attached to a "
                f"HybridShardedModel, got {type(strategy).__name__} with "
                f"{type(strategy.model).__name__}", TypeError)


def _step_to_go_on(strategy: RecoverableCore, buddy: ShardBuddy | None, world: FlatComm,
                   every: list[tuple[int, ...]], kept: list[int],
                   hand_over: Callable[[str], HandOver]
                   ) -> tuple[int, int, FlatComm | None]:
    """The step the kept replicas go on from, and what brings them there:
    ``(step, root, group)``: hybrid DDP's source rank (``root``), ZeRO-2's and
    ZeRO-3's group of survivors moving shards (``group``). Collective over
    ``world``."""
    me = strategy.config.groups.coordinates
    if strategy.placement.recovery != "sharded":
        step, root = _ddp_step(every, kept, me, hand_over)
        return step, root, None
    # ZeRO-2's and ZeRO-3's shards: moved shard to shard.
    step, group = _sharded_step(strategy, buddy, world, me, hand_over)
    return step, 0, group


def _dropped(replica: int, lost: list[int], going_on: int) -> HandOver:
    """What a dropped replica's alive rank raises (exit 0, it speaks for itself)."""
    return HandOver(f"world rank {world_rank()} (host {socket.gethostname()}): dropped "
                    f"with replica {replica}, which lost world rank(s) {lost}; "
                    f"{going_on} ranks go on", exit_code=0, speaker=True)


def _rebuild_kept(strategy: RecoverableCore, config: Any, root: int) -> None:
    """Hybrid DDP: the model and ``strategy`` rebuilt over ``config`` (the kept
    ranks), the same objects, with the parameters and state of rank ``root`` of
    the new data group. Collective over ``config.world``."""
    model, state = strategy.model, strategy.state
    model.rebuild(config)          # the same object, this rank's parameters kept
    config.groups.dp.Bcast(model.params, root=root)
    strategy.rebuild(config)       # the same object and options, over the kept ranks
    put_state(strategy, None, state, config.groups.dp, root)


def _sharded_step(strategy: RecoverableCore, buddy: ShardBuddy | None, world: FlatComm,
                  me: Any, hand_over: Callable[[str], HandOver]) -> tuple[int, FlatComm]:
    """ZeRO-2 and ZeRO-3: the newest step every (tensor, stage) data-parallel group
    can rebuild exactly from its survivors' shards and buddy copies, and this
    rank's group of survivors (the old data group's, dropped replicas' alive
    ranks included; the caller frees it). Collective over ``world``."""
    topo = strategy.config.topology
    group = world.split(me.pp * topo.tp + me.tp, me.dp, "data-parallel survivors")
    mine = zero2_candidates(strategy, buddy, group)
    common = set.intersection(*map(set, world.allgather(sorted(mine))))
    if not common:
        group.free()
        what = ("parameter and optimizer-state" if strategy.model.params is None
                else "optimizer-state")
        raise hand_over(f"{strategy.strategy} lost {what} shards: there is no step at which "
                        f"every data-parallel group can put them together from its "
                        f"survivors' shards and buddy copies")
    return max(common), group


def _resplit_kept(strategy: RecoverableCore, config: Any, group: FlatComm,
                  buddy: ShardBuddy | None, step: int, moved: Moved) -> None:
    """ZeRO-2 and ZeRO-3: this rank's group of survivors moves the stage's
    parameters and state at ``step`` shard to shard
    ([`resplit`][mpishard.recovery.resplit.resplit]): each kept rank gets its
    state shard under ``config`` (None: a dropped replica's rank, which only
    sends) and the model and ``strategy`` are rebuilt over it, the state moved
    straight into the rebuilt core's. ZeRO-3's parameters are kept as the new
    shard (nothing whole on any rank but a shard of one data-parallel rank);
    ZeRO-2's go from the shards into the rebuilt model's whole vector (whole on
    every rank anyway). Collective over ``group`` (and ``config.world`` on the
    kept ranks)."""
    pieces = sharded_pieces(strategy, buddy, group, step)
    xp, size = strategy.xp, strategy.layout.size
    model = strategy.model
    whole = model.params is not None        # ZeRO-2: the parameters are whole
    want = Range(0, 0)
    if config is not None:
        dp = config.groups.dp
        want = shard_ranges(size, dp.size)[dp.rank]
    dtypes = {name: value.dtype for name, value in pieces[0][1].items()}
    params = {"params": dtypes.pop("params")}
    if config is None:
        resplit(group, pieces, want, params, xp, moved)
        resplit(group, pieces, want, dtypes, xp, moved)
        return
    model.rebuild(config)      # ZeRO-3 in shards over the kept data group: nothing whole
    if whole:
        # Every kept rank the whole vector, from the shards: the same bits on each.
        resplit(group, pieces, Range(0, size), params, xp, moved, out={"params": model.params})
        strategy.rebuild(config, agreed=True)
        resplit(group, pieces, want, dtypes, xp, moved, out=strategy.state)
        return
    built = model.built_shard()
    # Straight into the rebuilt stage's new shard, kept as the strategy's store.
    out = {"params": built[1]} if built is not None and built[0] == want else None
    store = resplit(group, pieces, want, params, xp, moved, out=out)["params"]
    strategy.rebuild(config, shard=store)
    resplit(group, pieces, want, dtypes, xp, moved, out=strategy.state)


def _ddp_step(every: list[tuple[int, ...]], kept: list[int], me: Any,
              hand_over: Callable[[str], HandOver]) -> tuple[int, int]:
    """Hybrid DDP: the newest step at which every (tensor, stage) coordinate has
    a kept rank (the step's update is local: the survivors may differ by one
    step), and the rank of this rank's new data group that holds it (each
    coordinate takes parameters and state from its lowest kept rank there)."""
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
    return step, counts[(me.tp, me.pp)][step] if me.dp in kept else 0
