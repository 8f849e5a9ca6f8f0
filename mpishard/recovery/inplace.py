"""Going on in place after a rank died (ULFM): the strategy core rebuilt over the survivors."""

from __future__ import annotations

import time
import warnings
from typing import Any

from ..checkpoint import CheckpointManager
from ..comm import FlatComm, ulfm
from ..errors import HandOver, InexactRecoveryWarning
from ..exitcodes import EXIT_STOPPED
from ..parallel import DDPCore, HybridCore, HybridShardedModel, ZeRO2Core, ZeRO3Core
from ..protocols import StrategyCore
from .common import StepMarks, error_text, put_state, survivors_config
from .replicas import drop_replicas
from .shardcopy import ShardBuddy, zero2_candidates, zero2_rebuild

__all__ = ["communicators", "recover_in_place", "recoverable", "shrink_only"]


def communicators(core: StrategyCore) -> list[FlatComm]:
    """Every communicator ``core`` and its model wait on: the world, the data,
    tensor and pipeline groups, the step's group, ZeRO-3's gathers' and a
    two-level reduction's. For
    :func:`mpishard.comm.ulfm.recover`'s ``also``. Local."""
    groups = core.config.groups
    found = [groups.world, groups.dp, groups.tp, groups.pp, getattr(core, "_stepper", None),
             getattr(core, "gather_comm", None)]
    reducer = getattr(core, "reducer", None)
    for name in ("node", "cross", "gather"):
        found.append(getattr(reducer, name, None))
    return [c for c in found if isinstance(c, FlatComm)]


def recoverable(core: StrategyCore) -> str | None:
    """None when :func:`recover_in_place` can rebuild ``core`` over the
    survivors, else why not (a 3D layout with one data-parallel replica, or tensor
    or pipeline parallelism outside a hybrid core: the lost rank held a piece of
    the model no survivor has). Local."""
    topo = core.config.topology
    if isinstance(core, HybridCore):
        if topo.dp < 2 or not isinstance(core.model, HybridShardedModel):
            return (f"the layout has tensor_parallel_size={topo.tp}, pipeline_parallel_size="
                    f"{topo.pp} and data_parallel_size={topo.dp}: the lost rank held a piece "
                    f"of the only model replica")
        return None
    if topo.tp * topo.pp != 1:
        return (f"the layout has tensor_parallel_size={topo.tp} and "
                f"pipeline_parallel_size={topo.pp}: the lost rank held a piece of the "
                f"model that no survivor has")
    if not isinstance(core, (DDPCore, ZeRO2Core)) or core.model is None:
        return (f"in-place recovery needs an attached DDP or ZeRO-2 core, got "
                f"{type(core).__name__}")
    return None


def shrink_only(core: StrategyCore, exc: BaseException | None = None) -> ulfm.Recovery:
    """Revoke and shrink the core's world and agree on the last completed step,
    without rebuilding anything. Collective over the survivors."""
    if exc is not None and not ulfm.is_failure(exc):
        raise exc
    return ulfm.recover(core.config.groups.world, core.step_count, also=communicators(core))


def recover_in_place(core: StrategyCore, exc: BaseException | None = None, *,
                     checkpoints: CheckpointManager | None = None,
                     buddy: ShardBuddy | None = None, marks: StepMarks | None = None
                     ) -> tuple[StrategyCore, dict[str, Any]]:
    """After a rank failure, ``core`` itself rebuilt over the survivors
    (:meth:`~mpishard.parallel.DataParallelCore.rebuild`: same object, same
    options), and the ``recovered`` event; how each strategy goes on is on the
    docs site's faults page. ``exc``: the failure (raised again if it is not
    one); ``buddy``: ZeRO-2's copies; ``marks``: the loop's data positions of
    the last two steps. Returns ``(core, event)``. Collective over the survivors.

    Raises:
        HandOver: on every survivor (exit 75, the lowest survivor speaks): a layout
            that cannot go on in place (:func:`recoverable`; a 3D layout where no
            replica is whole), or ZeRO-2 with neither the lost shard nor
            ``checkpoints``; on the alive ranks of a dropped 3D replica (exit 0).
    """
    if exc is not None and not ulfm.is_failure(exc):
        raise exc
    t0 = time.perf_counter()
    why = recoverable(core)
    old = core.config
    rec = ulfm.recover(old.groups.world, core.step_count, also=communicators(core))
    if why is not None:
        raise HandOver(f"lost world rank(s) {rec.lost} after step {rec.step}, cannot go on "
                       f"in place ({why})",
                       exit_code=EXIT_STOPPED, speaker=rec.world.rank == 0)
    if isinstance(core, HybridCore):   # whole replicas go on
        return core, drop_replicas(core, rec, buddy=buddy, marks=marks, exc=exc)
    zero2 = isinstance(core, ZeRO2Core)
    step, model = rec.step, core.model
    full = params = None
    if zero2:
        found = zero2_candidates(core, buddy, rec.world)
        if found:
            step = max(found)
            params, full = zero2_rebuild(core, buddy, rec.world, step)
            if not isinstance(core, ZeRO3Core):
                model.params[...] = params
    if isinstance(core, ZeRO3Core):
        # The whole vector, for rebuild() to shard again without gathering over the
        # broken group: the buddies' (a roll-back overwrites it from the checkpoint).
        core.unshard(params if full is not None else
                     core.xp.zeros(core.layout.size, dtype=core.dtype))
    if zero2 and full is None and checkpoints is None:
        raise HandOver("cannot recover ZeRO-2 in place: the lost rank's shard of the "
                       "optimizer state is gone (no buddy copy of it) and there is no "
                       "checkpoint folder; restart from a checkpoint",
                       exit_code=EXIT_STOPPED, speaker=rec.world.rank == 0)
    config = survivors_config(old, rec.world.comm)
    world = config.groups.world
    state = core.state
    marks = marks if marks is not None else StepMarks(core.step_count, core.skipped_steps,
                                                       core.data_position)
    skipped, position = marks.agreed(world, core, step, world.allgather(core.step_count),
                                     rec.source)
    if not zero2:
        world.Bcast(model.params, root=rec.source)
    core.rebuild(config)
    rolled_back = None
    if zero2 and full is None:
        rolled_back = _roll_back(core, checkpoints, rec, world)
    else:
        put_state(core, full, state, world, rec.source)
    if rolled_back is None:
        core.step_count = step
        core.skipped_steps, core.data_position = skipped, position
    # The shrunk communicator stays allocated: it is the new configuration's ``comm``.
    event = {"event": "recovered", "lost_ranks": rec.lost, "step": core.step_count,
             "world_size": world.size, "seconds": time.perf_counter() - t0,
             "shrink_seconds": rec.seconds, "survivor_steps": rec.steps,
             "rolled_back_from": rolled_back,
             "from": ("checkpoint" if rolled_back else "buddy" if full is not None
                      else "survivor"),
             "error": error_text(exc)}
    return core, event


def _roll_back(core: ZeRO2Core, checkpoints: CheckpointManager, rec: ulfm.Recovery,
               world: FlatComm) -> str:
    """ZeRO-2 without the lost shard: the whole state from the newest checkpoint,
    resharded over the survivors; its path. Collective over ``world``."""
    info = checkpoints.load_latest(core.model, core)   # the same answer on every rank
    if info is None:
        raise HandOver(f"cannot recover ZeRO-2 in place: the checkpoint folder "
                       f"{checkpoints.folder} holds no checkpoint to roll back to",
                       exit_code=EXIT_STOPPED, speaker=world.rank == 0)
    if world.rank == 0:
        warnings.warn(f"ZeRO-2 lost the optimizer-state shard of world rank(s) {rec.lost}: "
                      f"rolled back from step {rec.step} to the checkpoint {info.path} (step "
                      f"{core.step_count}); the steps since are trained again over "
                      f"{world.size} ranks", InexactRecoveryWarning, stacklevel=3)
    return info.path

