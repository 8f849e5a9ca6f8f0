"""Going on in place after a rank died (ULFM): the strategy core rebuilt over the survivors."""

from __future__ import annotations

import time
import warnings
from typing import Any

from ..checkpoint import CheckpointManager
from ..comm import FlatComm, ulfm
from ..config import ShardingConfiguration
from ..errors import HandOver, InexactRecoveryWarning
from ..exitcodes import EXIT_STOPPED
from ..flat import Range, shard_ranges
from ..parallel.reduction import recalling_reducers
from ..protocols import RecoverableCore, StrategyCore
from .common import Recovered, StepMarks, error_text, put_state, survivors_config
from .replicas import drop_replicas
from .resplit import Moved, resplit
from .shardcopy import ShardBuddy, sharded_pieces, zero2_candidates

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
    # moved shard to shard from the survivors' shards and the buddy copies (sharded).
    sharded = core.placement.recovery == "sharded"
    step, model, pieces = rec.step, core.model, None
    if sharded:
        step, pieces = _sharded_pieces(core, buddy, rec, checkpoints)
    config = survivors_config(old, rec.world.comm)
    world = config.groups.world
    marks = marks if marks is not None else StepMarks(core.step_count, core.skipped_steps,
                                                       core.data_position)
    skipped, position = marks.agreed(world, core, step, world.allgather(core.step_count),
                                     rec.source)
    moved = Moved()
    rolled_back = None
    if not sharded:
        state = core.state
        world.Bcast(model.params, root=rec.source)
        with recalling_reducers():     # every rank holds the parameters: not sent again
            core.rebuild(config, agreed=True)
        put_state(core, None, state, world, rec.source)
    elif pieces is not None:
        _resplit_rebuild(core, config, pieces, moved)
    else:
        _rebuild_empty(core, config)
        rolled_back = _roll_back(core, checkpoints, rec, world)
    if rolled_back is None:
        core.set_progress(step_count=step, skipped_steps=skipped, data_position=position)
    # The shrunk communicator stays allocated: it is the new configuration's ``comm``.
    event = Recovered(lost_ranks=rec.lost, step=core.step_count, world_size=world.size,
                      seconds=time.perf_counter() - t0, shrink_seconds=rec.seconds,
                      survivor_steps=rec.steps, rolled_back_from=rolled_back,
                      source=("checkpoint" if rolled_back else "buddy" if pieces is not None
                              else "survivor"),
                      error=error_text(exc),
                      moved_bytes=moved.bytes if pieces is not None else None)
    return core, event


def _sharded_pieces(core: RecoverableCore, buddy: ShardBuddy | None, rec: ulfm.Survivors,
                    checkpoints: CheckpointManager | None
                    ) -> tuple[int, list[tuple[Range, dict[str, Any]]] | None]:
    """``(step, pieces)`` of a sharded placement: the newest step the survivors'
    shards and buddy copies rebuild exactly, and what this rank holds of it
    ([`sharded_pieces`][mpishard.recovery.shardcopy.sharded_pieces]); None: it
    cannot be rebuilt, and a roll-back to ``checkpoints`` follows. Collective
    over ``rec.world``.

    Raises:
        HandOver: on every survivor, no buddy copy of a lost shard and no checkpoints.
    """
    found = zero2_candidates(core, buddy, rec.world)
    if found:
        step = max(found)
        return step, sharded_pieces(core, buddy, rec.world, step)
    if checkpoints is None:
        raise HandOver("cannot recover ZeRO-2 in place: the lost rank's shard of the "
                       "optimizer state is gone (no buddy copy of it) and there is no "
                       "checkpoint folder; restart from a checkpoint",
                       exit_code=EXIT_STOPPED, speaker=rec.world.rank == 0)
    return rec.step, None


def _resplit_rebuild(core: RecoverableCore, config: ShardingConfiguration,
                     pieces: list[tuple[Range, dict[str, Any]]], moved: Moved) -> None:
    """``core`` rebuilt over ``config`` and its sharded parameters and state moved
    from ``pieces`` to the new shards ([`resplit`][mpishard.recovery.resplit.resplit],
    straight into the rebuilt core's arrays): ZeRO-3's parameters stay sharded
    (nothing whole on any rank); ZeRO-2's, which every rank holds whole, are put
    together from the new shards with its ``Allgatherv`` first. Collective over
    ``config.world``."""
    dp, xp, model = config.groups.dp, core.xp, core.model
    shards = shard_ranges(core.layout.size, dp.size)
    new = shards[dp.rank]
    dtypes = {name: value.dtype for name, value in pieces[0][1].items()}
    if model.params is None:           # sharded parameters: rebuilt sharded
        params = resplit(dp, pieces, new, {"params": dtypes.pop("params")}, xp, moved)
        # The old parameter shards are moved: dropped before the new layout is
        # made (``rebuild`` drops the old layout's own buffers).
        pieces[:] = [(r, {k: v for k, v in arrays.items() if k != "params"})
                     for r, arrays in pieces]
        with recalling_reducers():
            core.rebuild(config, shard=params.pop("params"))    # kept as the new shard
        resplit(dp, pieces, new, dtypes, xp, moved, out=core.state)
        pieces.clear()                 # the old state shards, moved too
        return
    resplit(dp, pieces, new, {"params": dtypes.pop("params")}, xp, moved,
            out={"params": model.params[new.start:new.stop]})
    if dp.size > 1:
        dp.Allgatherv(model.params, [len(s) for s in shards], slot="recovery")
    with recalling_reducers():         # every rank holds the parameters: not sent again
        core.rebuild(config, agreed=True)
    resplit(dp, pieces, new, dtypes, xp, moved, out=core.state)


def _rebuild_empty(core: RecoverableCore, config: ShardingConfiguration) -> None:
    """``core`` rebuilt over ``config`` for a roll-back to overwrite: ZeRO-3's
    parameters sharded (zeros, nothing whole). Collective over ``config.world``."""
    if core.model.params is None:
        dp = config.groups.dp
        shard = shard_ranges(core.layout.size, dp.size)[dp.rank]
        core.rebuild(config, shard=core.xp.zeros(len(shard), dtype=core.dtype))
    else:
        core.rebuild(config)


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

