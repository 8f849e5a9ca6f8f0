"""What every in-place recovery does the same way: the survivors' configuration, the
data position at the step it goes on from, and the ``Recovered`` event."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..comm import FlatComm, ulfm
from ..config import ShardingConfiguration

__all__ = ["Recovered", "StepMarks", "error_text", "put_state", "survivors_config"]


@dataclass
class Recovered:
    """What a recovery from a lost rank did: the training loop's ``recovered``
    record ([`record`][mpishard.recovery.common.Recovered.record]; its fields are
    listed on the docs site's training-loop page).

    Attributes:
        lost_ranks: the ``MPI.COMM_WORLD`` ranks that are gone.
        step: the step the run goes on from.
        world_size: the survivors that go on.
        seconds: the whole recovery; shrink_seconds: its revoke, shrink and agree.
        survivor_steps: each survivor's step count when it failed.
        source: where the state came from: ``"survivor"`` (replicated state),
            ``"buddy"`` (sharded state, from the copies), ``"checkpoint"`` (rolled
            back), ``"replica"`` (a 3D layout that dropped replicas).
        rolled_back_from: the checkpoint's path, or None.
        error: MPI's error string of the failure.
        dropped_ranks, data_parallel_size: ``"replica"`` only.
        buddy_bytes, buddy_seconds: with buddy copies, what they cost so far.
        moved_bytes: ``"buddy"``: the bytes this rank sent to others to re-split
            the sharded state over the survivors.
    """

    lost_ranks: list[int]
    step: int
    world_size: int
    seconds: float
    shrink_seconds: float
    survivor_steps: list[int]
    source: str
    rolled_back_from: str | None = None
    error: str | None = None
    dropped_ranks: list[int] | None = None
    data_parallel_size: int | None = None
    buddy_bytes: int | None = None
    buddy_seconds: float | None = None
    moved_bytes: int | None = None

    def record(self) -> dict[str, Any]:
        """The event as a JSON-ready dict (``"event": "recovered"``, ``"from"``:
        ``source``), as ``TrainResult.recoveries`` and the metrics file hold it."""
        out = {"event": "recovered", "lost_ranks": self.lost_ranks, "step": self.step,
               "world_size": self.world_size, "seconds": self.seconds,
               "shrink_seconds": self.shrink_seconds, "survivor_steps": self.survivor_steps,
               "rolled_back_from": self.rolled_back_from, "from": self.source,
               "error": self.error}
        for name in ("dropped_ranks", "data_parallel_size", "buddy_bytes", "buddy_seconds",
                     "moved_bytes"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out


class StepMarks:
    """This rank's ``(skipped_steps, data position)`` after each of its last two
    steps, by step count, so that a recovery that goes back one step also puts
    the data back. Local."""

    def __init__(self, step: int, skipped: int, position: dict[str, int] | None) -> None:
        self.marks: dict[int, tuple[int, dict[str, int] | None]] = {}
        self.record(step, skipped, position)

    def record(self, step: int, skipped: int, position: dict[str, int] | None) -> None:
        """Remember the position after ``step`` (forgetting all but the one before)."""
        self.marks[step] = (skipped, None if position is None else dict(position))
        for old in [s for s in self.marks if s < step - 1]:
            del self.marks[old]

    def agreed(self, world: FlatComm, core: Any, step: int, steps: list[int],
               fallback: int) -> tuple[int, dict[str, int] | None]:
        """``(skipped_steps, data position)`` at ``step``: a survivor's mark of it,
        else the own ones of a survivor at that step (``steps``: each survivor's
        step count, in ``world`` order; rank ``fallback`` when none is). Collective
        over ``world``."""
        offers = world.allgather(self.marks.get(step))
        chosen = next((m for m in offers if m is not None), None)
        if chosen is None:
            root = steps.index(step) if step in steps else fallback
            chosen = world.bcast((core.skipped_steps, core.data_position), root=root)
        return chosen[0], None if chosen[1] is None else dict(chosen[1])


def survivors_config(old: ShardingConfiguration, comm: Any) -> ShardingConfiguration:
    """``old``'s options over ``comm`` (the survivors), data parallel over what is
    left, with errors returned (ULFM on) as before. Collective over ``comm``."""
    config = dataclasses.replace(old, comm=comm, data_parallel_size=-1)
    groups = config.groups
    ulfm.enable([groups.world, groups.dp, groups.tp, groups.pp],
                evict_stuck=old.groups.dp.evict_stuck)
    return config


def put_state(core: Any, whole: dict[str, Any] | None, old: dict[str, Any], group: FlatComm,
              root: int) -> None:
    """Fill a rebuilt core's optimizer state: this rank's shard of the ``whole``
    vectors (ZeRO-2, put together from shards and copies), or else ``old``, the
    state the core held before, as held by rank ``root`` of ``group`` (every
    replica holds it whole). Collective over ``group`` (the second case)."""
    owned = core.placement.owned()
    for name, value in (whole if whole is not None else old).items():
        if whole is not None:
            core.state[name][...] = value[owned.start:owned.stop]
        else:
            core.state[name][...] = value
            group.Bcast(core.state[name], root=root)


def error_text(exc: BaseException | None) -> str | None:
    """The MPI error string of a failure, for the ``recovered`` event."""
    return exc.Get_error_string() if hasattr(exc, "Get_error_string") else None
