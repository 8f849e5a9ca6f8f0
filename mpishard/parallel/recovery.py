"""Going on in place after a rank died (ULFM): the DDP strategy rebuilt over the survivors."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from ..comm import ulfm
from ..errors import MpiShardError
from .ddp import DDPOptimizer

__all__ = ["recover_in_place"]


def recover_in_place(strategy: DDPOptimizer, exc: BaseException | None = None
                     ) -> tuple[DDPOptimizer, dict[str, Any]]:
    """After a rank failure, the same strategy over the survivors, and the
    ``recovered`` event (a dict for the metrics file).

    Call it where a step raised :class:`mpi4py.MPI.Exception` with
    :func:`ulfm.is_failure <mpishard.comm.ulfm.is_failure>` true (``exc``: that
    exception, which is raised again if it is not a failure). The survivors
    revoke and shrink the world, agree on the last completed step
    (:func:`~mpishard.comm.ulfm.recover`), build a new
    :class:`~mpishard.ShardingConfiguration` over themselves (same options,
    ``dp`` = the survivors, errors returned) and a new strategy of the same
    class and options. Parameters, optimizer state, ``step_count``,
    ``skipped_steps`` and the data position come from the survivor that
    completed the newest step (under DDP every replica holds them whole), so
    the run goes on from there: redo step ``new.step_count`` with the global
    batch re-split over the survivors. Collective over the survivors.

    Raises:
        MpiShardError: a strategy other than DDP (ZeRO-2's lost shard of the
            optimizer state needs a buddy copy, not built yet; tensor or
            pipeline layouts are not handled), on every survivor.
    """
    if exc is not None and not ulfm.is_failure(exc):
        raise exc
    t0 = time.perf_counter()
    if not isinstance(strategy, DDPOptimizer) or strategy.model is None:
        raise MpiShardError(f"in-place recovery needs an attached DDPOptimizer, got "
                            f"{type(strategy).__name__}: ZeRO-2's lost optimizer-state shard "
                            f"needs a buddy copy (not built yet); restart from a checkpoint")
    old = strategy.config
    rec = ulfm.recover(old.groups.world, strategy.step_count)
    config = dataclasses.replace(old, comm=rec.world.comm, data_parallel_size=-1)
    groups = config.groups
    ulfm.enable([groups.world, groups.dp, groups.tp, groups.pp],
                evict_stuck=old.groups.dp.evict_stuck)
    world = groups.world
    model = strategy.model
    world.Bcast(model.params, root=rec.source)
    new = type(strategy)(strategy.optimizer, config, model=model, bucket_mb=strategy.bucket_mb,
                         accumulation_steps=strategy.accumulation_steps,
                         max_grad_norm=strategy.max_grad_norm, schedule=strategy.schedule,
                         overlap=strategy.overlap, nonfinite=strategy.nonfinite)
    for name, state in strategy.state.items():
        new.state[name][...] = state
        world.Bcast(new.state[name], root=rec.source)
    new.step_count = rec.step
    new.skipped_steps, new.data_position = world.bcast(
        (strategy.skipped_steps, strategy.data_position), root=rec.source)
    # The shrunk communicator stays allocated: it is the new configuration's ``comm``.
    event = {"event": "recovered", "lost_ranks": rec.lost, "step": rec.step,
             "world_size": world.size, "seconds": time.perf_counter() - t0,
             "shrink_seconds": rec.seconds, "survivor_steps": rec.steps,
             "error": exc.Get_error_string() if hasattr(exc, "Get_error_string") else None}
    return new, event
