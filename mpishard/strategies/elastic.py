"""``ElasticOptimizer``: the worker side of elastic training.

A [`Strategy`][mpishard.strategies.base.Strategy] over a DDP, ZeRO-2 or ZeRO-3 core
(any name of [`STRATEGIES`][mpishard.strategies.registry.STRATEGIES]), running the
one training loop ([`run_training`][mpishard.train.loop.run_training]).
On start it resumes from the newest complete checkpoint in its folder, resharded
to the current world size (the agent behind ``mpishard run`` relaunches the
workers at a new size after a failure or a change of slots). While training it
checkpoints every ``checkpoint_every`` steps, and on SIGUSR1 (a planned resize,
sent by the agent) or SIGTERM (a Slurm preemption or time limit) it checkpoints
at the next step boundary and returns: ``result.stopped`` names the signal,
[`ElasticOptimizer.stop_reason`][mpishard.strategies.elastic.ElasticOptimizer.stop_reason] says
``"resize"`` or ``"preempt"``, and
[`ElasticOptimizer.exit_code`][mpishard.strategies.elastic.ElasticOptimizer.exit_code] is
`EXIT_STOPPED` (75), the status the agent expects from a worker that stopped to be relaunched
(``raise SystemExit(opt.exit_code)`` at the end of the script), so the job goes on elsewhere or at
another size from exactly there. ``optimize()`` never ends the process itself (a library call inside
a simulation must not), unless ``exit_on_signal=True`` asks for it.

A worker script written for 0.1 (whose ``optimize()`` exited the process) ends
with status 0 after such a stop unless it exits with ``exit_code``. Two things
keep that from ending a job early: rank 0 leaves a note in the launch folder
(`STOP_NOTE`), from which ``mpishard run`` tells a
stop it asked for from a finished run and relaunches (or exits 75) all the same;
and a process that never read [`exit_code`][mpishard.strategies.elastic.ElasticOptimizer.exit_code]
(or [`stop_reason`][mpishard.strategies.elastic.ElasticOptimizer.stop_reason]) after a stop prints,
at exit, one line that says what to change.

Signals reach the ranks at different moments, so the decision to stop is agreed
collectively after every step ([`StopRequest`][mpishard.train.StopRequest]: one
Allreduce of one number over the world), and every rank stops after the same step.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..checkpoint import CheckpointManager
from ..config import ShardingConfiguration
from ..errors import MpiShardError
from ..exitcodes import EXIT_STOPPED, STOP_NOTE
from ..train import Checkpointing, Sampling, StopRequest, TrainResult, run_training
from .base import Strategy
from .registry import STRATEGIES, unknown_strategy

__all__ = ["BATCH_POLICIES", "ElasticOptimizer"]

#: ``fixed-global``: the global batch stays the same at any size (each worker's
#: share adapts). ``scale-lr``: each worker keeps its batch, the global batch
#: grows with the workers and the learning rate is scaled linearly with it.
BATCH_POLICIES = ("fixed-global", "scale-lr")
#: Why the loop stopped -> `ElasticOptimizer.stop_reason`.
_REASONS = {"SIGUSR1": "resize", "SIGTERM": "preempt"}


class ElasticOptimizer(Strategy):
    """A data-parallel optimizer whose job may shrink and grow between restarts.

    Args:
        optimizer: the update rule ([`mpishard.optim`][mpishard.optim]).
        config: the layout; the data-parallel size is the number of workers.
        min_workers, max_workers: the allowed range; starting outside it is an
            error on every rank. Not given: the ``mpishard run`` agent's
            ``--min-workers``/``--max-workers`` (``MPISHARD_ELASTIC_MIN_WORKERS``
            and ``_MAX_WORKERS``), else 1 and 1024.
        strategy: the data-parallel strategy inside, a name of
            [`STRATEGIES`][mpishard.strategies.registry.STRATEGIES] (``"ddp"``,
            ``"zero2"``, ``"zero3"``).
        checkpoint_dir: where to checkpoint and resume from (needed to resume).
        checkpoint_every: steps between periodic checkpoints (None: only on a
            signal and at the end).
        keep: checkpoints kept in the folder.
        async_checkpoints: write the periodic checkpoints in the background
            (``CheckpointManager(async_=True)``: the step goes on while the file
            is written; `mpishard.checkpoint.background`; the default, as
            ``mpishard train --async-checkpoints``). A checkpoint taken at a
            stop (a resize, a preemption, the end) or by
            [`checkpoint`][mpishard.strategies.elastic.ElasticOptimizer.checkpoint]
            is complete on disk before the call returns, so a relaunch finds only
            complete files; a save in flight when a rank is lost (ULFM) is
            discarded, never committed half written.
        batch_policy: see `BATCH_POLICIES`.
        reference_workers: the worker count the base learning rate is meant for
            (``scale-lr`` only): lr = base lr x workers / reference_workers.
        exit_on_signal: True: after the checkpoint a signal asked for, exit the
            process with ``EXIT_STOPPED`` (75, what the agent expects). False
            (the default): return; the script exits with
            [`exit_code`][mpishard.strategies.elastic.ElasticOptimizer.exit_code].
        **options: passed to the inner strategy (bucket_mb, max_grad_norm, ...).
            For runs that must agree bit for bit across restarts with ZeRO-2 or -3, pin
            ``reduce_method`` ("reduce_scatter" or "allreduce"): "auto" chooses by
            timing, and the two may sum in a different order on 3 or more ranks.

    Raises:
        MpiShardError: the current number of workers is outside
            ``[min_workers, max_workers]``, on every rank.
        ValueError: an unknown strategy or batch policy.
    """

    def __init__(self, optimizer: Any, config: ShardingConfiguration | None = None,
                 min_workers: int | None = None, max_workers: int | None = None, *,
                 strategy: str = "ddp",
                 checkpoint_dir: str | None = None, checkpoint_every: int | None = None,
                 keep: int = 3, async_checkpoints: bool = True,
                 batch_policy: str = "fixed-global",
                 reference_workers: int = 1, exit_on_signal: bool = False,
                 **options: Any) -> None:
        config = config if config is not None else ShardingConfiguration()
        # Under `mpishard run` the agent's --min-workers/--max-workers are the defaults.
        if min_workers is None:
            min_workers = int(os.environ.get("MPISHARD_ELASTIC_MIN_WORKERS", "1"))
        if max_workers is None:
            max_workers = int(os.environ.get("MPISHARD_ELASTIC_MAX_WORKERS", "1024"))
        problem = unknown_strategy(strategy)
        if problem is not None:
            pass    # reported below, with the others
        elif batch_policy not in BATCH_POLICIES:
            problem = (f"batch_policy must be one of {', '.join(BATCH_POLICIES)}, "
                       f"got {batch_policy!r}")
        elif not 1 <= min_workers <= max_workers:
            problem = (f"expecting 1 <= min_workers <= max_workers, got {min_workers} "
                       f"and {max_workers}")
        elif checkpoint_every is not None and checkpoint_every < 1:
            problem = f"checkpoint_every must be a positive integer, got {checkpoint_every}"
        config.world.agree(problem, ValueError)
        workers = config.topology.dp
        if not min_workers <= workers <= max_workers:
            config.world.agree(f"{workers} workers, outside the allowed range "
                               f"[{min_workers}, {max_workers}] (min_workers, max_workers)",
                  MpiShardError)
        self.min_workers = min_workers
        self.max_workers = max_workers
        self.checkpoint_every = checkpoint_every
        self.batch_policy = batch_policy
        self.reference_workers = reference_workers
        self.exit_on_signal = exit_on_signal
        super().__init__(STRATEGIES[strategy].core_class(optimizer, config, **options))
        self.base_lr = optimizer.lr
        self.manager = (CheckpointManager(checkpoint_dir, keep=keep, async_=async_checkpoints)
                        if checkpoint_dir is not None else None)
        self.resumed_from: str | None = None
        self.recovery_seconds: float | None = None
        self._stop_reason: str | None = None
        self._stopped: _Stop | None = None   # the last stop, until exit_code is read
        self._stop = StopRequest()
        self._new_pass = False

    # --- what the issue names ------------------------------------------------------
    @property
    def current_workers(self) -> int:
        return self.config.topology.dp

    @property
    def can_scale_up(self) -> bool:
        return self.current_workers < self.max_workers

    @property
    def can_scale_down(self) -> bool:
        return self.current_workers > self.min_workers

    @property
    def inner(self) -> Any:
        """The DDP, ZeRO-2 or ZeRO-3 core (`core`; the name of 0.4)."""
        return self.core

    @property
    def exit_code(self) -> int:
        """What the worker process should exit with: `EXIT_STOPPED`
        (75: checkpointed, relaunch me) after a stop a signal or
        [`request_stop`][mpishard.strategies.elastic.ElasticOptimizer.request_stop] asked for, else
        0."""
        self._seen()
        return EXIT_STOPPED if self._stop_reason is not None else 0

    @property
    def stop_reason(self) -> str | None:
        """Why the last [`optimize`][mpishard.strategies.elastic.ElasticOptimizer.optimize] stopped
        before its end: ``"resize"`` (SIGUSR1), ``"preempt"`` (SIGTERM), the reason given to
        [`request_stop`][mpishard.strategies.elastic.ElasticOptimizer.request_stop], or None."""
        self._seen()
        return self._stop_reason

    def _seen(self) -> None:
        if self._stopped is not None:
            self._stopped.seen = True

    def new_pass(self) -> None:
        """Start a new pass over the data at the next
        [`optimize`][mpishard.strategies.elastic.ElasticOptimizer.optimize] (after it has resumed
        from the newest checkpoint): epoch 0 of all the data, the seed and shuffle it is given,
        ``epochs`` counted from there. Local."""
        self._new_pass = True

    def request_stop(self, reason: str = "resize") -> None:
        """Checkpoint and stop at the next step boundary (what SIGUSR1 does)."""
        self._stop.request(reason)

    def checkpoint(self, model: Any) -> str | None:
        """Save now, into ``checkpoint_dir``: on disk, complete, when this returns
        (before a planned change). Collective over the world."""
        if self.manager is None:
            return None
        path = self.manager.save(model, self.core)
        self.manager.wait()
        return path

    # --- training -------------------------------------------------------------------
    def global_batch(self, batch_size: int | None) -> int | None:
        """The global batch at the current size under the batch policy (None:
        a stream's, whatever its batches hold)."""
        if self.batch_policy == "fixed-global" or batch_size is None:
            return batch_size
        return batch_size * self.current_workers

    def optimize(self, model: Any, data: Any, epochs: int | None = None,
                 batch_size: int | None = None, *,
                 seed: int | None = None, callback: Callable[[int, float], Any] | None = None,
                 **options: Any) -> TrainResult:
        """Train until ``epochs`` epochs are done in total (counting from epoch 0,
        as every ``optimize()``), resuming from the newest checkpoint in
        ``checkpoint_dir`` when there is one.

        ``data``, ``seed``, ``callback(step, loss)`` and the rules for a
        restored data position are those of every strategy's ``optimize()``
        ([`optimize`][mpishard.strategies.base.Strategy.optimize]). ``batch_size``: the global
        batch (``fixed-global``) or each worker's batch (``scale-lr``, where the
        global batch follows the worker count without a warning); for a
        [`BatchStream`][mpishard.data.BatchStream], ``epochs`` and ``batch_size`` are
        None and a relaunched worker's stream is placed at the checkpoint's
        batch count (``first=``, `mpishard.data.stream`). ``options``
        go to [`run_training`][mpishard.train.run_training]. After a stop asked for by a
        signal or [`request_stop`][mpishard.strategies.elastic.ElasticOptimizer.request_stop] it
        returns (``result.stopped``,
        [`stop_reason`][mpishard.strategies.elastic.ElasticOptimizer.stop_reason];
        [`exit_code`][mpishard.strategies.elastic.ElasticOptimizer.exit_code] is 75), or exits the
        process with that code when ``exit_on_signal`` is True. Collective over the world.

        With fault tolerance on (``ShardingConfiguration(fault_tolerance=...)``
        under ``mpirun --with-ft ulfm``), a rank that dies is recovered from in
        place (``result.recoveries``; [`run_training`][mpishard.train.run_training]
        says how); fewer survivors than ``min_workers`` checkpoint and end the
        process with 75, one line saying why, for ``mpishard run`` to relaunch.
        """
        core = self.core
        if core.model is not model:
            core.attach(model)
        if self.manager is not None:
            info = self.manager.load_latest(model, core)
            self.resumed_from = info.path if info is not None else None
        if self._new_pass:
            core.data_position, self._new_pass = None, False
        if self.batch_policy == "scale-lr":
            core.optimizer.lr = self.base_lr * self.current_workers / self.reference_workers
        failed_at = os.environ.get("MPISHARD_ELASTIC_FAILED_AT")
        first_step = [True]

        def after_step(step: int, loss: float) -> Any:
            if first_step[0]:
                first_step[0] = False
                if failed_at:
                    self.recovery_seconds = time.time() - float(failed_at)
            return callback(step, loss) if callback is not None else None

        sampling = Sampling(seed=seed, batch_size_may_change=self.batch_policy == "scale-lr")
        checkpointing = Checkpointing(self.manager, self.checkpoint_every or 0, self.min_workers)
        self._note_stop(None)        # training goes on: an earlier stop's note is void
        with self._stop:
            self._announce_ready()
            result = run_training(core, model, data, epochs, self.global_batch(batch_size),
                                  sampling=sampling, callback=after_step, stop=self._stop,
                                  checkpointing=checkpointing, **options)
        self._stop.received = None   # consumed: the next optimize() trains again
        self._seen()                 # an earlier stop is over: training went on
        self._stop_reason, self._stopped = None, None
        if result.stopped not in (None, "callback", "max_steps", "exhausted"):
            self._stop_reason = _REASONS.get(result.stopped, result.stopped)
            self._stopped = _Stop(self._stop_reason, core.step_count,
                                  self.config.world.rank == 0)
            _STOPS.append(self._stopped)
            self._note_stop(result)
            if self.exit_on_signal:
                self._seen()
                sys.stdout.flush()
                sys.exit(EXIT_STOPPED)
        return result

    def _note_stop(self, result: TrainResult | None) -> None:
        """Rank 0 notes the stop of ``result`` in the launch folder for the
        agent (`STOP_NOTE`), or removes the note
        (None). Local; nothing outside ``mpishard run``."""
        folder = os.environ.get("MPISHARD_JOB_DIR")
        if not folder or self.config.world.rank != 0:
            return
        path = os.path.join(folder, STOP_NOTE)
        if result is None:
            try:
                os.remove(path)
            except OSError:
                pass
            return
        note = {"reason": self._stop_reason, "signal": result.stopped,
                "step": self.core.step_count, "checkpoint": result.checkpoint,
                "exit_code": EXIT_STOPPED}
        try:
            with open(f"{path}.tmp", "w") as f:
                json.dump(note, f)
            os.replace(f"{path}.tmp", path)
        except OSError:
            pass   # a launch folder already gone: the agent is not listening

    # --- signals ----------------------------------------------------------------------
    def _announce_ready(self) -> None:
        """Tell the agent that every rank now handles SIGUSR1 (and SIGTERM).
        Collective over the world."""
        path = os.environ.get("MPISHARD_ELASTIC_READY_FILE")
        if not path:
            return
        self.config.world.barrier()
        if self.config.world.rank == 0:
            with open(path, "w") as f:
                f.write(str(os.getpid()))


@dataclass
class _Stop:
    """A stop of
    [`ElasticOptimizer.optimize`][mpishard.strategies.elastic.ElasticOptimizer.optimize] to be
    relaunched: its reason, the step, whether this rank speaks for the job, and whether the script
    read ``exit_code`` (or ``stop_reason``) since. Kept for the exit even when the optimizer is gone
    (a script's ``main()`` returned)."""

    reason: str
    step: int
    speaker: bool
    seen: bool = False


#: The stops of this process, for `_unread_stop_at_exit`.
_STOPS: list[_Stop] = []


@atexit.register
def _unread_stop_at_exit() -> None:
    """At exit: where training stopped to be relaunched and the script never
    read ``exit_code`` (or ``stop_reason``) after it, say on the stopping
    world's rank 0 what a status of 0 does and what to change. (``atexit``
    cannot see the exit status: a script that read the stop only through
    ``result.stopped`` and exits 75 by itself sees the line too.)"""
    for stop in _STOPS:
        if not stop.seen and stop.speaker:
            sys.stderr.write(
                f"[mpishard] ElasticOptimizer stopped for a {stop.reason} after step "
                f"{stop.step} and checkpointed (opt.exit_code is {EXIT_STOPPED}), but this "
                f"script never read opt.exit_code: if it ends with status 0, `mpishard run` "
                f"and batch scripts take the training as finished. End the worker script "
                f"with `raise SystemExit(opt.exit_code)`.\n")
            sys.stderr.flush()
        stop.seen = True
