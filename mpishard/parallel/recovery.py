"""Going on in place after a rank died (ULFM): the strategy rebuilt over the survivors."""

from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Any

from ..comm import FlatComm, ulfm
from ..errors import MpiShardError
from .ddp import DDPOptimizer
from .hybrid import HybridShardedModel, HybridShardedOptimizer
from .replicas import drop_replicas
from .shardcopy import ShardBuddy, zero2_candidates, zero2_rebuild
from .zero2 import ZeRO2Optimizer

__all__ = ["InexactRecoveryWarning", "ShardBuddy", "communicators", "recover_in_place",
           "recoverable", "shrink_only"]


class InexactRecoveryWarning(UserWarning):
    """A recovery that could not keep the run exact where it was (ZeRO-2 without
    the lost shard: rolled back to the newest checkpoint)."""


def communicators(strategy: Any) -> list[FlatComm]:
    """Every communicator ``strategy`` and its model wait on: the world, the data,
    tensor and pipeline groups, the step's group and a two-level reduction's. For
    :func:`mpishard.comm.ulfm.recover`'s ``also``. Local."""
    groups = strategy.config.groups
    found = [groups.world, groups.dp, groups.tp, groups.pp, getattr(strategy, "_stepper", None)]
    reducer = getattr(strategy, "reducer", None)
    for name in ("node", "cross", "gather"):
        found.append(getattr(reducer, name, None))
    return [c for c in found if isinstance(c, FlatComm)]


def recoverable(strategy: Any) -> str | None:
    """None when :func:`recover_in_place` can rebuild ``strategy`` over the
    survivors, else why not (a 3D layout with one data-parallel replica, or tensor
    or pipeline parallelism outside a hybrid strategy: the lost rank held a piece
    of the model no survivor has). Local."""
    topo = strategy.config.topology
    if isinstance(strategy, HybridShardedOptimizer):
        if topo.dp < 2 or not isinstance(strategy.model, HybridShardedModel):
            return (f"the layout has tensor_parallel_size={topo.tp}, pipeline_parallel_size="
                    f"{topo.pp} and data_parallel_size={topo.dp}: the lost rank held a piece "
                    f"of the only model replica")
        return None
    if topo.tp * topo.pp != 1:
        return (f"the layout has tensor_parallel_size={topo.tp} and "
                f"pipeline_parallel_size={topo.pp}: the lost rank held a piece of the "
                f"model that no survivor has")
    if not isinstance(strategy, (DDPOptimizer, ZeRO2Optimizer)) or strategy.model is None:
        return f"in-place recovery needs an attached DDP or ZeRO-2 strategy, got " \
               f"{type(strategy).__name__}"
    return None


def shrink_only(strategy: Any, exc: BaseException | None = None) -> ulfm.Recovery:
    """Revoke and shrink the strategy's world and agree on the last completed
    step, without rebuilding anything (for a hand-over: the survivors then
    know each other and can say so once). Collective over the survivors."""
    if exc is not None and not ulfm.is_failure(exc):
        raise exc
    return ulfm.recover(strategy.config.groups.world, strategy.step_count,
                        also=communicators(strategy))


def recover_in_place(strategy: Any, exc: BaseException | None = None, *,
                     checkpoints: Any = None, buddy: ShardBuddy | None = None,
                     marks: dict[int, tuple[int, Any]] | None = None
                     ) -> tuple[Any, dict[str, Any]]:
    """After a rank failure, ``strategy`` itself rebuilt over the survivors, and
    the ``recovered`` event (a dict for the metrics file).

    Call it where a step raised :class:`mpi4py.MPI.Exception` with
    :func:`ulfm.is_failure <mpishard.comm.ulfm.is_failure>` true (``exc``: that
    exception, which is raised again if it is not a failure). The survivors
    revoke every communicator of the strategy (:func:`communicators`), shrink
    the world, agree on the step to go on from
    (:func:`~mpishard.comm.ulfm.recover`), build a new
    :class:`~mpishard.ShardingConfiguration` over themselves (same options,
    ``dp`` = the survivors, errors returned; ``strategy.config`` is then that
    one) and set the same strategy object up again over it (same class and
    options; the model attached again; gradients of the interrupted step dropped).

    * **DDP**: parameters, optimizer state, ``step_count``, ``skipped_steps`` and
      the data position come from the survivor that completed the newest step
      (every replica holds them whole): nothing is lost, the run goes on from
      ``strategy.step_count`` exactly as one that dropped the rank there.
    * **ZeRO-2 with a** :class:`ShardBuddy` (``buddy``, refreshed after every
      step): the whole parameters and optimizer state are put together at the
      newest step the survivors can rebuild exactly (:mod:`~mpishard.parallel.shardcopy`):
      the step every survivor completed when the death came after the copies were
      refreshed (a forward, a backward, a reduction, the stop agreement, a save),
      else the step before it (a death in the step's ``Allreduce``, the parameter
      ``Allgatherv`` or the copies' exchange: survivors that had updated take back
      their shard from before the update), and resharded over the survivors; the
      interrupted step is trained again over them. Exact, nothing lost, nothing
      read from disk (``event["from"] == "buddy"``).
    * **3D layouts** (:class:`~mpishard.parallel.hybrid.HybridShardedOptimizer`
      with ``data_parallel_size`` of 2 or more): every replica that lost a rank
      is dropped (its alive ranks help, then end with status 0) and the whole
      ones go on in place with the same tensor and pipeline sizes
      (:func:`~mpishard.parallel.replicas.drop_replicas`, ``event["from"] ==
      "replica"``); no replica whole: the error below.
    * **ZeRO-2 otherwise** (no buddy, two neighbours lost): the whole state
      (parameters, optimizer state, step, data position) is rolled back to the
      newest checkpoint of ``checkpoints`` (a
      :class:`~mpishard.checkpoint.CheckpointManager`), resharded over the
      survivors: exact from that checkpoint on, the steps since it are done
      again, with an :class:`InexactRecoveryWarning` on the lowest survivor
      (``event["from"] == "checkpoint"``).

    ``marks``: this rank's data positions by step (``{step: (skipped_steps,
    position)}``, the training loop's, for the last two steps), so that a step
    rolled back also puts the data back; without them the position of the
    survivor that completed the newest step is taken.

    Returns ``(strategy, event)``: the same object, and ``{"event":
    "recovered", "lost_ranks", "step", "world_size", "seconds",
    "shrink_seconds", "survivor_steps", "rolled_back_from", "from", "error"}``.
    Collective over the survivors.

    Raises:
        MpiShardError: on every survivor: a layout that cannot go on in place
            (:func:`recoverable`; a 3D layout where no replica is whole), or
            ZeRO-2 without a checkpoint to roll back to.
    """
    if exc is not None and not ulfm.is_failure(exc):
        raise exc
    t0 = time.perf_counter()
    why = recoverable(strategy)
    old = strategy.config
    rec = ulfm.recover(old.groups.world, strategy.step_count, also=communicators(strategy))
    if why is not None:
        raise MpiShardError(f"cannot recover in place: {why}; restart from a checkpoint")
    if isinstance(strategy, HybridShardedOptimizer):   # whole replicas go on
        return strategy, drop_replicas(strategy, rec, buddy=buddy, marks=marks, exc=exc)
    zero2 = isinstance(strategy, ZeRO2Optimizer)
    step, source = rec.step, rec.source
    full = None
    if zero2:
        found = zero2_candidates(strategy, buddy, rec.world)
        if found:
            step = max(found)
            params, full = zero2_rebuild(strategy, buddy, rec.world, step)
            strategy.model.params[...] = params
    if zero2 and full is None and checkpoints is None:
        error = MpiShardError("cannot recover ZeRO-2 in place: the lost rank's shard of the "
                              "optimizer state is gone (no buddy copy of it) and there is "
                              "no checkpoint folder; restart from a checkpoint")
        error.first_survivor = rec.world.rank == 0   # who says it, for a hand-over
        raise error
    config = dataclasses.replace(old, comm=rec.world.comm, data_parallel_size=-1)
    groups = config.groups
    ulfm.enable([groups.world, groups.dp, groups.tp, groups.pp],
                evict_stuck=old.groups.dp.evict_stuck)
    world = groups.world
    model = strategy.model
    state = strategy.state
    # The data position at that step: the loop's mark, else a survivor's own.
    mark = marks.get(step) if marks else None
    offers = world.allgather(mark)
    chosen = next((m for m in offers if m is not None), None)
    if chosen is None:   # no marks: a survivor at that step (the newest one's otherwise)
        at = world.allgather(strategy.step_count)
        chosen = world.bcast((strategy.skipped_steps, strategy.data_position),
                             root=at.index(step) if step in at else source)
    skipped, position = chosen[0], (None if chosen[1] is None else dict(chosen[1]))
    options = dict(bucket_mb=strategy.bucket_mb, accumulation_steps=strategy.accumulation_steps,
                   max_grad_norm=strategy.max_grad_norm, schedule=strategy.schedule,
                   overlap=strategy.overlap, nonfinite=strategy.nonfinite)
    if zero2:
        options["reduce_method"] = strategy.reduce_method   # chosen before: no probing again
    rolled_back = None
    if not zero2:
        world.Bcast(model.params, root=source)
    # The same object, set up again over the survivors (attach: buckets, state).
    type(strategy).__init__(strategy, strategy.optimizer, config, model=model, **options)
    if full is not None:
        for name, value in full.items():
            strategy.state[name][...] = value[strategy.shard.start:strategy.shard.stop]
        strategy.step_count = step
        strategy.skipped_steps, strategy.data_position = skipped, position
    elif zero2:
        info = checkpoints.load_latest(model, strategy)
        if info is None:
            world.agree("cannot recover ZeRO-2 in place: the checkpoint folder "
                        f"{checkpoints.folder} holds no checkpoint to roll back to",
                        MpiShardError)
        rolled_back = info.path
        if world.rank == 0:
            warnings.warn(f"ZeRO-2 lost the optimizer-state shard of world rank(s) "
                          f"{rec.lost}: rolled back from step {rec.step} to the checkpoint "
                          f"{info.path} (step {strategy.step_count}); the steps since are "
                          f"trained again over {world.size} ranks", InexactRecoveryWarning,
                          stacklevel=2)
    else:
        for name, value in state.items():
            strategy.state[name][...] = value
            world.Bcast(strategy.state[name], root=source)
        strategy.step_count = step
        strategy.skipped_steps, strategy.data_position = skipped, position
    # The shrunk communicator stays allocated: it is the new configuration's ``comm``.
    event = {"event": "recovered", "lost_ranks": rec.lost, "step": strategy.step_count,
             "world_size": world.size, "seconds": time.perf_counter() - t0,
             "shrink_seconds": rec.seconds, "survivor_steps": rec.steps,
             "rolled_back_from": rolled_back,
             "from": ("checkpoint" if rolled_back else "buddy" if full is not None
                      else "survivor"),
             "error": exc.Get_error_string() if hasattr(exc, "Get_error_string") else None}
    return strategy, event
