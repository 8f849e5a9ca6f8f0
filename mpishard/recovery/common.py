"""What every in-place recovery does the same way: the survivors' configuration and
the data position at the step it goes on from."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..comm import FlatComm, ulfm
from ..config import ShardingConfiguration

__all__ = ["StepMarks", "error_text", "put_state", "survivors_config"]


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
    for name, value in (whole if whole is not None else old).items():
        if whole is not None:
            core.state[name][...] = value[core.shard.start:core.shard.stop]
        else:
            core.state[name][...] = value
            group.Bcast(core.state[name], root=root)


def error_text(exc: BaseException | None) -> str | None:
    """The MPI error string of a failure, for the ``recovered`` event."""
    return exc.Get_error_string() if hasattr(exc, "Get_error_string") else None
