"""The one training loop, behind every ``optimize()``, ``ElasticOptimizer`` and
``mpishard train``.

Its rules (epochs are a total, the data position wins, data may grow, streams,
stops, checkpoints, callbacks, the metrics records, a lost rank) are stated once,
on the docs site's training-loop page (``docs/guide/training-loop.md``). Feeding
is [`feeding`][mpishard.train.feeding]'s, reporting [`reporting`][mpishard.train.reporting]'s,
what happens after a lost rank [`mpishard.recovery`][mpishard.recovery]'s.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from ..checkpoint import CheckpointManager
from ..checkpoint.background import discard_checkpoint
from ..comm import stuck
from ..errors import DataPositionWarning, HandOver
from ..protocols import Model, StrategyCore
from ..recovery import Recovered, RecoveryPolicy, hand_over, wait_as_spare
from ..recovery.policy import recover_between_calls
from .evaluate import evaluation_group
from .feeding import Batch, Feeder
from .options import Checkpointing, Reporting, Sampling, option_groups
from .reporting import Reporter
from .result import TrainResult
from .signals import StopRequest

__all__ = ["run_training"]


def run_training(strategy: StrategyCore, model: Model, data: Any,
                 epochs: int | None = None, batch_size: int | None = None, *,
                 sampling: Sampling | None = None,
                 callback: Callable[[int, float], Any] | None = None,
                 stop: StopRequest | None = None, max_steps: int | None = None,
                 reporting: Reporting | None = None,
                 checkpointing: Checkpointing | None = None, **flat: Any) -> TrainResult:
    """Train ``model`` with the core ``strategy`` (attached if it is not yet) until
    ``epochs`` epochs are complete in total, a stream ends, ``max_steps``, a stop
    or the callback. Collective over ``strategy.config.world``.

    ``data``, ``epochs``, ``batch_size`` and ``callback(step, loss)`` are
    ``optimize()``'s
    ([`mpishard.strategies.Strategy.optimize`][mpishard.strategies.base.Strategy.optimize]);
    ``stop`` is agreed on over the world after every step; the option groups are
    [`Sampling`][mpishard.train.Sampling], [`Reporting`][mpishard.train.Reporting] and
    [`Checkpointing`][mpishard.train.Checkpointing], or their fields given flat (``shuffle=``,
    ``progress=``, ``checkpoints=``, ``checkpoint_every=``, ...). The rules are on the docs site's
    training-loop page.

    Raises:
        ValueError: on every rank, for data, batch size or epochs that cannot be
            trained (the message says which and why).
        TypeError: an unknown option.
    """
    sampling, reporting, checkpointing = option_groups(sampling, reporting, checkpointing,
                                                       flat, strategy)
    core = strategy
    trains, joined, promoted = _joining(core, model, checkpointing, reporting)
    if not trains:
        return TrainResult(spare="unused")
    stuck.note_training(True)   # removed at the end: left, it says training was cut short
    continuing = core.data_position is not None
    feeder = Feeder(core, model, data, epochs, batch_size, sampling)
    result = TrainResult(first_step=core.step_count, last_step=core.step_count)
    report = Reporter(reporting, core.config.world.rank == 0, result, epochs,
                      _total_steps(feeder, epochs, max_steps), continuing)
    saver = _Saver(checkpointing.manager, core, model, report, result)
    recovery = RecoveryPolicy(core, checkpointing.manager, saver.save, reporting.label,
                              checkpointing.min_workers)
    steps = _Steps(core, model, feeder, report, saver, recovery, result, callback, stop,
                   max_steps, checkpointing.every)
    if joined is not None:   # as the survivors do after the recovery
        result.spare = "promoted" if promoted else None
        steps.went_on(joined)
    elif feeder.finished() and continuing and core.config.world.rank == 0:
        _warn_nothing_to_train(feeder, epochs)
    if not promoted:
        report.start(batch_size, feeder.per_epoch)
    try:
        _run_recovering(steps, saver, recovery, feeder, report, result)
        core.config.release_spares()   # training ended: spares still waiting leave
        result.epochs = feeder.epoch
        result.val_loss = report.validation_at_end(core.step_count, model,
                                                   evaluation_group(core))
        report.end(core.step_count)
        stuck.note_training(False)
    finally:
        report.close()
    return result


def _joining(core: StrategyCore, model: Model, checkpointing: Checkpointing,
             reporting: Reporting) -> tuple[bool, Any, bool]:
    """Whether this rank trains; what it joins (a promotion, or a recovery from a
    rank lost since the last call, as in a step), else None; whether it was promoted."""
    trains, joined = _take_part(core, model)
    if not trains:
        return False, None, False
    if joined is not None:
        return True, joined, True
    return True, recover_between_calls(core, model, checkpointing.manager, reporting.label,
                                       checkpointing.min_workers), False


def _take_part(core: StrategyCore, model: Model) -> tuple[bool, Any]:
    """Attach ``model``; a spare rank waits instead until it is promoted.
    ``(trains, joined)``: ``trains`` is False for a spare released unused,
    ``joined`` the recovery a promoted spare joins (None for a training rank).
    A failed promotion ends the process (one line, exit 75)."""
    if not core.config.is_spare:
        if core.model is not model:
            core.attach(model)
        return True, None
    try:
        joined = wait_as_spare(core, model)
    except HandOver as over:
        hand_over(over)
    return joined is not None, joined


def _warn_nothing_to_train(feeder: Feeder, epochs: int | None) -> None:
    """A call whose ``epochs`` total is reached already says so (rank 0)."""
    warnings.warn(f"optimize(): nothing to train: epochs={epochs} is a total and "
                  f"{feeder.epoch} epoch(s) are complete already; pass a larger total "
                  f"(epochs={feeder.epoch + epochs} for {epochs} more) or call "
                  f"new_pass() to start again at epoch 0", DataPositionWarning,
                  stacklevel=4)


def _run_recovering(steps: _Steps, saver: _Saver, recovery: RecoveryPolicy, feeder: Feeder,
                    report: Reporter, result: TrainResult) -> None:
    """The steps, and again after each recovery from a lost rank (or the hand-over:
    this rank leaves), then the final save."""
    while True:
        try:
            steps.run()
            result.seconds = report.elapsed()
            saver.save(result.stopped or "end")
            return
        except Exception as exc:
            if not recovery.handles(exc):
                raise
            failure = exc
            discard_checkpoint()   # a save in flight over the old job: never committed
        try:
            event = recovery.recover(failure)
        except HandOver as over:
            report.hand_over(over, steps.core.step_count)
            hand_over(over)
        feeder.open(may_change=True)   # the rows re-split over the survivors
        recovery.rearm()
        steps.went_on(event)


def _total_steps(feeder: Feeder, epochs: int | None, max_steps: int | None) -> int | None:
    """Steps of the whole run (a stream: unknown), for the bar and the ETA."""
    total = None if feeder.per_epoch is None else epochs * feeder.per_epoch
    if max_steps is not None:
        total = max_steps if total is None else min(total, max_steps)
    return total


class _Saver:
    """Writes a checkpoint when asked, at most once per step. Collective over the world."""

    def __init__(self, manager: CheckpointManager | None, core: StrategyCore, model: Model,
                 report: Reporter, result: TrainResult) -> None:
        self.manager, self.core, self.model = manager, core, model
        self.report, self.result = report, result
        self.saved_at = core.step_count   # a resumed run has its starting point on disk

    def save(self, reason: str) -> str | None:
        """A checkpoint at the current step, unless there is one or no manager;
        but for an ``"interval"`` save, an asynchronous one is on disk on return."""
        if self.manager is None:
            return None
        path = None
        if self.saved_at != self.core.step_count:
            path = self.manager.save(self.model, self.core)
            self.saved_at = self.core.step_count
            self.result.checkpoint = path
            self.report.checkpoint(self.saved_at, path, reason)
        if reason != "interval":
            self.manager.wait()
        return path

    def poll(self) -> None:
        """At a step boundary: commit an asynchronous save whose writes are done."""
        if self.manager is not None and self.manager.async_:
            self.manager.poll()


class _Steps:
    """The step loop: read, forward and backward per micro-batch, step, advance,
    report, then callback, checkpoint and stop, in that order."""

    def __init__(self, core: StrategyCore, model: Model, feeder: Feeder, report: Reporter,
                 saver: _Saver, recovery: RecoveryPolicy, result: TrainResult,
                 callback: Callable[[int, float], Any] | None, stop: StopRequest | None,
                 max_steps: int | None, every: int) -> None:
        self.core, self.model, self.feeder, self.report = core, model, feeder, report
        self.saver, self.recovery, self.result = saver, recovery, result
        self.callback, self.stop, self.max_steps, self.every = callback, stop, max_steps, every
        self.skipped_before = core.skipped_steps

    def run(self) -> None:
        """Steps until done (``result.stopped`` says why, None: every epoch ran)."""
        result, core = self.result, self.core
        if self.max_steps is not None and core.step_count >= self.max_steps:
            result.stopped = "max_steps"
        while result.stopped is None and not self.feeder.finished():
            batch = self.feeder.next()
            if batch is None:
                result.stopped = "exhausted"
                return
            self.step(batch)

    def step(self, batch: Batch) -> None:
        core, feeder, result = self.core, self.feeder, self.result
        n, micro = len(batch.x), core.accumulation_steps
        for k in range(micro):
            # Micro-batches as even as the ranks' shares; backward() weights each
            # by its rows, so a short, unequal last batch is still its exact mean.
            a, b = k * n // micro, (k + 1) * n // micro
            core.backward(batch.x[a:b], batch.y[a:b], batch_start=batch.start + a,
                          global_rows=batch.rows)
        loss = core.step()
        epoch_ended = feeder.advance(batch.rows)
        self.recovery.after_step(feeder.position)
        step = core.step_count
        result.losses.append(loss)
        result.steps = step - result.first_step
        result.skipped_steps = core.skipped_steps - self.skipped_before
        result.samples += batch.rows
        result.last_step = step
        self.report.step(step, feeder.epoch, loss, batch.rows, core.current_lr())
        wants_stop = self.callback is not None and bool(self.callback(step, loss))
        if self.every and step % self.every == 0:
            self.saver.save("interval")
        self.saver.poll()
        if self.stop is not None:
            result.stopped = self.stop.agree(core.config.world,
                                             "callback" if wants_stop else None)
        elif wants_stop:
            result.stopped = "callback"
        if result.stopped is None and self.max_steps is not None and step >= self.max_steps:
            result.stopped = "max_steps"
        if epoch_ended:
            self.report.epoch_end(feeder.epoch, step, self.model, evaluation_group(core))

    def went_on(self, event: Recovered) -> None:
        """After a recovery: every survivor reports the steps up to the agreed one."""
        core, result = self.core, self.result
        world, step = core.config.world, core.step_count
        # A promoted spare's call began at the recovery: the run's began before.
        result.first_step = world.allreduce(result.first_step, op="min")
        kept = max(0, step - result.first_step)
        undone = result.last_step != step   # this rank's figures include other steps
        result.losses[:] = max(world.allgather(result.losses[:kept]), key=len)
        result.samples = world.allreduce(result.samples, op="max")   # a promoted spare's: 0
        result.steps, result.last_step = step - result.first_step, step
        result.recoveries.append(event.record())
        # The oldest save of any rank (a promoted spare has made none).
        self.saver.saved_at = world.allreduce(min(self.saver.saved_at, step), op="min")
        self.report.recovered(event, world.rank == 0, world.size, undone)
        if self.every and step % self.every == 0:
            self.saver.save("interval")   # an interrupted save (or one the lost rank missed)
