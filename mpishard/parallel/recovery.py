"""Going on in place after a rank died (ULFM): the strategy rebuilt over the survivors."""

from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Any

import numpy as np

from ..comm import ulfm
from ..errors import MpiShardError
from .ddp import DDPOptimizer
from .hybrid import HybridShardedOptimizer
from .zero2 import ZeRO2Optimizer

__all__ = ["InexactRecoveryWarning", "ShardBuddy", "recover_in_place", "recoverable",
           "shrink_only"]

#: The tag of the buddy copies' messages over the data-parallel group.
_BUDDY_TAG = 0x4255


class InexactRecoveryWarning(UserWarning):
    """A recovery that could not keep the run exact where it was (ZeRO-2 without
    the lost shard: rolled back to the newest checkpoint)."""


class ShardBuddy:
    """ZeRO-2's buddy copy: each data-parallel rank also keeps the optimizer-state
    shard of the next rank (``(r + 1) % n``), refreshed after every step, so a
    lost rank's shard survives with its left neighbour and
    :func:`recover_in_place` goes on exactly, with nothing read from disk.

    Costs: memory, one more shard of the optimizer state per rank (Adam: two
    arrays of ``params / n`` elements); time, one exchange of that shard with
    each neighbour per step (:attr:`seconds`: the total so far). NumPy state
    only (a device array: no copy is kept; the recovery rolls back to a checkpoint).
    """

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self.dp = strategy.dp
        n, r = self.dp.size, self.dp.rank
        self.rank, self.size = r, n
        self.holds = (r + 1) % n          # whose shard the copy is
        length = len(strategy.shards[self.holds])
        self.copy = {name: np.zeros(length, dtype=value.dtype)
                     for name, value in strategy.state.items()}
        self.active = n > 1 and all(isinstance(v, np.ndarray) for v in strategy.state.values())
        self.step = -1            # the step the copy holds
        self.completed = strategy.step_count   # the last step() that returned here
        self.seconds = 0.0

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in self.copy.values())

    def exchange(self) -> None:
        """After a step: send my shard to the left neighbour, receive the right
        one's. Collective over the data-parallel group (neighbours only)."""
        self.completed = self.strategy.step_count
        if not self.active:
            return
        t0 = time.perf_counter()
        left = (self.rank - 1) % self.size
        handles = []
        for k, (name, value) in enumerate(self.strategy.state.items()):
            handles.append(self.dp.Irecv(self.copy[name], self.holds, _BUDDY_TAG + k))
            handles.append(self.dp.Isend(value, left, _BUDDY_TAG + k, slot=("buddy", k)))
        for handle in handles:
            handle.wait()
        self.step = self.completed
        self.seconds += time.perf_counter() - t0


def recoverable(strategy: Any) -> str | None:
    """None when :func:`recover_in_place` can rebuild ``strategy`` over the
    survivors, else why not (a layout with tensor or pipeline parallelism: the
    lost rank held a piece of the model no survivor has). Local."""
    topo = strategy.config.topology
    if isinstance(strategy, HybridShardedOptimizer) or topo.tp * topo.pp != 1:
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
    return ulfm.recover(strategy.config.groups.world, strategy.step_count)


def recover_in_place(strategy: Any, exc: BaseException | None = None, *,
                     checkpoints: Any = None, buddy: ShardBuddy | None = None
                     ) -> tuple[Any, dict[str, Any]]:
    """After a rank failure, ``strategy`` itself rebuilt over the survivors, and
    the ``recovered`` event (a dict for the metrics file).

    Call it where a step raised :class:`mpi4py.MPI.Exception` with
    :func:`ulfm.is_failure <mpishard.comm.ulfm.is_failure>` true (``exc``: that
    exception, which is raised again if it is not a failure). The survivors
    revoke and shrink the world, agree on the last completed step
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
      step): when every survivor had completed the agreed step and the lost
      shards' copies hold it (the death came after the exchange: in a forward,
      a backward, a reduction, the step's Allreduce, the stop agreement, a save),
      the whole optimizer state is put together from the survivors' shards and
      the copies and resharded over the survivors: exact, nothing lost
      (``event["from"] == "buddy"``).
    * **ZeRO-2 otherwise** (no buddy, two neighbours lost, a death inside the
      parameter Allgatherv or the exchange): the whole state (parameters,
      optimizer state, step, data position) is rolled back to the newest
      checkpoint of ``checkpoints`` (a :class:`~mpishard.checkpoint.CheckpointManager`),
      resharded over the survivors: exact from that checkpoint on, the steps
      since it are done again, with an :class:`InexactRecoveryWarning` on the
      lowest survivor (``event["from"] == "checkpoint"``).

    Returns ``(strategy, event)``: the same object, and ``{"event":
    "recovered", "lost_ranks", "step", "world_size", "seconds",
    "shrink_seconds", "survivor_steps", "rolled_back_from", "error"}``.
    Collective over the survivors.

    Raises:
        MpiShardError: on every survivor: a layout with tensor or pipeline
            parallelism (:func:`recoverable`), or ZeRO-2 without a checkpoint
            to roll back to.
    """
    if exc is not None and not ulfm.is_failure(exc):
        raise exc
    t0 = time.perf_counter()
    why = recoverable(strategy)
    old = strategy.config
    rec = ulfm.recover(old.groups.world, strategy.step_count)
    if why is not None:
        raise MpiShardError(f"cannot recover in place: {why}; restart from a checkpoint")
    zero2 = isinstance(strategy, ZeRO2Optimizer)
    full = _from_buddies(strategy, buddy, rec) if zero2 else None
    if zero2 and full is None and checkpoints is None:
        error = MpiShardError("cannot recover ZeRO-2 in place: the lost rank's shard of the "
                              "optimizer state is gone (no buddy copy of it at the agreed "
                              "step) and there is no checkpoint folder; restart from a "
                              "checkpoint")
        error.first_survivor = rec.world.rank == 0   # who says it, for a hand-over
        raise error
    config = dataclasses.replace(old, comm=rec.world.comm, data_parallel_size=-1)
    groups = config.groups
    ulfm.enable([groups.world, groups.dp, groups.tp, groups.pp],
                evict_stuck=old.groups.dp.evict_stuck)
    world = groups.world
    model = strategy.model
    state = strategy.state
    skipped, position = world.bcast((strategy.skipped_steps, strategy.data_position),
                                    root=rec.source)
    options = dict(bucket_mb=strategy.bucket_mb, accumulation_steps=strategy.accumulation_steps,
                   max_grad_norm=strategy.max_grad_norm, schedule=strategy.schedule,
                   overlap=strategy.overlap, nonfinite=strategy.nonfinite)
    if zero2:
        options["reduce_method"] = strategy.reduce_method   # chosen before: no probing again
    rolled_back = None
    if not zero2 or full is not None:
        world.Bcast(model.params, root=rec.source)
    # The same object, set up again over the survivors (attach: buckets, state).
    type(strategy).__init__(strategy, strategy.optimizer, config, model=model, **options)
    if full is not None:
        for name, value in full.items():
            strategy.state[name][...] = value[strategy.shard.start:strategy.shard.stop]
        strategy.step_count = rec.step
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
            world.Bcast(strategy.state[name], root=rec.source)
        strategy.step_count = rec.step
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


def _from_buddies(strategy: Any, buddy: ShardBuddy | None, rec: Any) -> dict[str, Any] | None:
    """The whole ZeRO-2 optimizer state (each array full length, on every
    survivor) from the survivors' shards and the buddy copies of the lost ones,
    or None when that cannot be exact (no buddy; a survivor that had not
    completed the agreed step, or whose update ran past it; a lost shard whose
    copy is missing or older). Collective over ``rec.world``."""
    world = rec.world
    usable = (buddy is not None and buddy.active and buddy.strategy is strategy
              and buddy.size == strategy.dp.size)
    mine = ((strategy.dp.rank, buddy.completed, strategy.step_count, buddy.step)
            if usable else None)
    every = world.allgather(mine)
    if any(e is None for e in every):
        return None
    n = strategy.dp.size
    here = {r for r, _, _, _ in every}
    lost = set(range(n)) - here
    step = rec.step
    # Every survivor completed the agreed step and updated nothing beyond it.
    if any(done != step or count != step for _, done, count, _ in every):
        return None
    covered = {(r + 1) % n for r, _, _, copy in every if copy == step}
    if not lost <= covered:
        return None
    full = {}
    for name, value in strategy.state.items():
        whole = np.zeros(strategy.model.params.size, dtype=value.dtype)
        shard = strategy.shards[strategy.dp.rank]
        whole[shard.start:shard.stop] = value
        if buddy.holds in lost:
            held = strategy.shards[buddy.holds]
            whole[held.start:held.stop] = buddy.copy[name]
        # Each element comes from exactly one survivor: the sum is exact.
        world.Allreduce(whole, slot=("buddy-state", name))
        full[name] = whole
    return full
