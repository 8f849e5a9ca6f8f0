"""``RecoveryPolicy``: the training loop's one object for a lost rank (fault tolerance on)."""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

from ..checkpoint import CheckpointManager
from ..comm import ulfm
from ..errors import HandOver
from ..exitcodes import EXIT_STOPPED
from ..protocols import StrategyCore
from .common import Recovered, StepMarks
from .handover import hand_over
from .inplace import recover_in_place
from .shardcopy import ShardBuddy
from .spares import promote_spares

__all__ = ["RecoveryPolicy", "recover_between_calls"]


class RecoveryPolicy:
    """What the training loop does about a lost rank: keep what a recovery needs
    after every step (``after_step``), and go on over the survivors when a
    step fails (``recover``). Inactive (costs nothing) where fault tolerance
    is off.

    Args:
        core: the strategy core being trained.
        checkpoints: where ZeRO-2 without a copy of the lost shard rolls back from.
        save: the loop's checkpoint writer (``save(reason) -> path``), used before
            a hand-over for too few workers.
        label: the run's name, first in a hand-over's line.
        min_workers: fewer survivors than this hand over (exit 75) after a
            checkpoint.
        new_buddy: make buddy copies where none are kept from the last call
            (collective over ``core.dp``); False: only a kept one (between calls,
            where a rank may be lost already).

    The buddy copies outlive the ``optimize()`` call (kept on the core): a rank
    lost between two calls finds its shard's copy in the next one.
    """

    def __init__(self, core: StrategyCore, checkpoints: CheckpointManager | None,
                 save: Callable[[str], Any], label: str = "train",
                 min_workers: int = 1, new_buddy: bool = True) -> None:
        self.core = core
        self.checkpoints = checkpoints
        self.save = save
        self.label = label
        self.min_workers = min_workers
        self.active = ulfm.is_on(core.config.world)
        self.marks = StepMarks(core.step_count, core.skipped_steps, core.data_position)
        self.buddy = self._new_buddy(new_buddy)

    def _new_buddy(self, make: bool = True) -> ShardBuddy | None:
        core = self.core
        # Sharded state has one holder: a copy keeps a lost shard (ZeRO-2 and ZeRO-3).
        keep = (self.active and core.placement.recovery == "sharded"
                and core.options.buddy_copies)
        if not keep:
            return None
        kept = getattr(core, "kept_buddy", None)
        if kept is not None and kept.strategy is core and kept.dp is core.dp:
            return kept     # the last call's: its copies are of the last step
        core.kept_buddy = ShardBuddy(core) if make else None
        return core.kept_buddy

    def after_step(self, position: dict[str, int]) -> None:
        """After a completed step whose data position is ``position``: refresh the
        buddy copies (collective over ``core.dp``, neighbours only) and remember
        the position."""
        if self.buddy is not None:
            self.buddy.exchange()   # the lost shard survives with its neighbour
        if self.active:
            self.marks.record(self.core.step_count, self.core.skipped_steps, position)

    def handles(self, exc: BaseException) -> bool:
        """Whether ``exc`` says a rank died and this run goes on without it."""
        return self.active and ulfm.is_failure(exc)

    def recover(self, exc: BaseException) -> Recovered:
        """The core rebuilt over the survivors
        ([`recover_in_place`][mpishard.recovery.recover_in_place]), and the ``recovered`` event.
        Collective over the survivors.

        Raises:
            HandOver: where the run cannot go on here (the message starts with
                the label): no way to recover in place, fewer survivors than
                ``min_workers`` (after a checkpoint), or this rank's replica was
                dropped (exit 0).
        """
        pool = self.core.config.spare_pool
        if ulfm.is_failure(exc):
            # The failed step's frames (the old layout's placement, gathers and
            # shards in their locals) would live as long as the exception: the
            # recovery frees that layout, so they go now (the message stays).
            traceback.clear_frames(exc.__traceback__)
        try:
            if pool is not None and pool.count:   # spares take the lost ranks' places
                _, event = promote_spares(self.core, exc, buddy=self.buddy, marks=self.marks)
            else:
                _, event = recover_in_place(self.core, exc, checkpoints=self.checkpoints,
                                            buddy=self.buddy, marks=self.marks)
        except HandOver as over:
            raise self._labelled(over) from None
        if self.buddy is not None:   # what the copies cost so far
            event.buddy_bytes, event.buddy_seconds = self.buddy.nbytes, self.buddy.seconds
        core = self.core
        self.buddy = core.kept_buddy = None   # new copies in rearm(), the data open again
        self.marks = StepMarks(core.step_count, core.skipped_steps, core.data_position)
        world = core.config.world
        if world.size < self.min_workers:
            path = self.save("too-few-workers")
            why = (f"{world.size} worker(s) left after losing world rank(s) "
                   f"{event.lost_ranks}, fewer than min_workers={self.min_workers}: "
                   + (f"checkpoint {path} at step {core.step_count}" if path is not None
                      else "no checkpoint folder, nothing saved"))
            raise self._labelled(HandOver(why, exit_code=EXIT_STOPPED, speaker=world.rank == 0,
                                          stopped="too-few-workers"))
        return event

    def rearm(self) -> None:
        """After a recovery, once the loop has opened the data again: the new buddy
        copies (collective over ``core.dp``), in the order a promoted spare makes
        them (its loop opens the data, then builds its policy)."""
        if self.buddy is None:
            self.buddy = self._new_buddy()

    def _labelled(self, over: HandOver) -> HandOver:
        if over.exit_code == 0:
            return over
        return HandOver(f"{self.label}: {over}; exiting with {over.exit_code} to be relaunched",
                        exit_code=over.exit_code, speaker=over.speaker, stopped=over.stopped)


def recover_between_calls(core: StrategyCore, model: Any,
                          checkpoints: CheckpointManager | None, label: str = "train",
                          min_workers: int = 1) -> Recovered | None:
    """At the start of an ``optimize()`` call of an attached training rank (fault
    tolerance on): whether a rank of the world was lost since the last call
    ([`lost_since`][mpishard.comm.ulfm.lost_since]: the same answer on every
    survivor), and if so the recovery a step would make
    ([`RecoveryPolicy.recover`][mpishard.recovery.RecoveryPolicy.recover]: spares
    promoted, or the survivors go on, with the last call's buddy copies); None
    when no rank was lost. Collective over ``core.config.world``. A run that
    cannot go on ends this process with its one line
    ([`hand_over`][mpishard.recovery.hand_over])."""
    world = core.config.world
    if not ulfm.is_on(world) or core.reduction is None:
        return None
    failure = ulfm.lost_since(world)
    if failure is None:
        return None

    def save(reason: str) -> str | None:
        return None if checkpoints is None else checkpoints.save(model, core)

    policy = RecoveryPolicy(core, checkpoints, save, label, min_workers, new_buddy=False)
    try:
        return policy.recover(failure)
    except HandOver as over:
        hand_over(over)
