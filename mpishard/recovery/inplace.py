"""Going on in place after a rank died (ULFM): the strategy core rebuilt over the survivors."""

from __future__ import annotations

import time
import warnings
from typing import Any

from ..checkpoint import CheckpointManager
from ..comm import FlatComm, ulfm
from ..errors import HandOver, InexactRecoveryWarning
from ..exitcodes import EXIT_STOPPED
from ..protocols import RecoverableCore, StrategyCore
from .common import Recovered, StepMarks, error_text, put_state, survivors_config
from .replicas import drop_replicas
from .shardcopy import ShardBuddy, zero2_candidates, zero2_rebuild

__all__ = ["communicators", "recover_in_place", "recoverable", "shrink_only"]


def communicators(core: StrategyCore) -> list[FlatComm]:
    """Every communicator ``core`` and its model wait on, as the core names them
    ([`communicators`][mpishard.parallel.base.DataParallelCore.communicators]):
    for [`ulfm.recover`][mpishard.comm.ulfm.recover]'s ``also``. Local."""
    return core.communicators() if isinstance(core, RecoverableCore) else \
        [core.config.groups.world, core.dp]


def recoverable(core: StrategyCore) -> str | None:
    """None when ``recover_in_place`` can rebuild ``core`` over the
    survivors, else why not (as the core says: a 3D layout with one
    data-parallel replica, tensor or pipeline parallelism outside a hybrid
    core, no model). Local."""
    if not isinstance(core, RecoverableCore):
        return (f"in-place recovery needs a core that names its parts (DDP, ZeRO-2, "
                f"ZeRO-3, hybrid), got {type(core).__name__}")
    return core.recovery_problem()


def shrink_only(core: StrategyCore, exc: BaseException | None = None) -> ulfm.Survivors:
    """Revoke and shrink the core's world and agree on the last completed step,
    without rebuilding anything. Collective over the survivors."""
    if exc is not None and not ulfm.is_failure(exc):
        raise exc
    return ulfm.recover(core.config.groups.world, core.step_count, also=communicators(core))


def recover_in_place(core: StrategyCore, exc: BaseException | None = None, *,
                     checkpoints: CheckpointManager | None = None,
                     buddy: ShardBuddy | None = None, marks: StepMarks | None = None
                     ) -> tuple[StrategyCore, Recovered]:
    """After a rank failure, ``core`` itself rebuilt over the survivors
    ([`rebuild`][mpishard.parallel.DataParallelCore.rebuild]: same object, same
    options), and the ``recovered`` event; how each strategy goes on is on the
    docs site's faults page. ``exc``: the failure (raised again if it is not
    one); ``buddy``: ZeRO-2's copies; ``marks``: the loop's data positions of
    the last two steps. Returns ``(core, event)``. Collective over the survivors.

    Raises:
        HandOver: on every survivor (exit 75, the lowest survivor speaks): a layout
            that cannot go on in place (``recoverable``; a 3D layout where no
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
    if core.drops_replicas:   # whole replicas go on
        return core, drop_replicas(core, rec, buddy=buddy, marks=marks, exc=exc)
    # How the placement's state is put back: sent by a survivor (replicated), or
    # put together from the survivors' shards and the buddy copies (sharded).
    sharded = core.placement.recovery == "sharded"
    step, model, full = rec.step, core.model, None
    if sharded:
        step, full = _sharded_state(core, buddy, rec, checkpoints)
    config = survivors_config(old, rec.world.comm)
    world = config.groups.world
    state = core.state
    marks = marks if marks is not None else StepMarks(core.step_count, core.skipped_steps,
                                                       core.data_position)
    skipped, position = marks.agreed(world, core, step, world.allgather(core.step_count),
                                     rec.source)
    if not sharded:
        world.Bcast(model.params, root=rec.source)
    core.rebuild(config)
    rolled_back = None
    if sharded and full is None:
        rolled_back = _roll_back(core, checkpoints, rec, world)
    else:
        put_state(core, full, state, world, rec.source)
    if rolled_back is None:
        core.set_progress(step_count=step, skipped_steps=skipped, data_position=position)
    # The shrunk communicator stays allocated: it is the new configuration's ``comm``.
    event = Recovered(lost_ranks=rec.lost, step=core.step_count, world_size=world.size,
                      seconds=time.perf_counter() - t0, shrink_seconds=rec.seconds,
                      survivor_steps=rec.steps, rolled_back_from=rolled_back,
                      source=("checkpoint" if rolled_back else "buddy" if full is not None
                              else "survivor"),
                      error=error_text(exc))
    return core, event


def _sharded_state(core: RecoverableCore, buddy: ShardBuddy | None, rec: ulfm.Survivors,
                   checkpoints: CheckpointManager | None) -> tuple[int, Any]:
    """``(step, whole state)`` of a sharded placement, put together from the
    survivors' shards and buddy copies (None: it cannot be, and a roll-back to
    ``checkpoints`` follows); the model given its whole vector for ``rebuild()``
    to shard again without gathering over the broken group. Collective over
    ``rec.world``.

    Raises:
        HandOver: on every survivor, no buddy copy of a lost shard and no checkpoints.
    """
    found = zero2_candidates(core, buddy, rec.world)
    if found:
        step = max(found)
        params, full = zero2_rebuild(core, buddy, rec.world, step)
        core.whole_parameters(params)
        return step, full
    if checkpoints is None:
        raise HandOver("cannot recover ZeRO-2 in place: the lost rank's shard of the "
                       "optimizer state is gone (no buddy copy of it) and there is no "
                       "checkpoint folder; restart from a checkpoint",
                       exit_code=EXIT_STOPPED, speaker=rec.world.rank == 0)
    if core.model.params is None:     # the roll-back overwrites it from the checkpoint
        core.whole_parameters(core.xp.zeros(core.layout.size, dtype=core.dtype))
    return rec.step, None


def _roll_back(core: RecoverableCore, checkpoints: CheckpointManager, rec: ulfm.Survivors,
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

