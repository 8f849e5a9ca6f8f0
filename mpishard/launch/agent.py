"""The elastic agent behind ``mpishard run``: keep a training job alive as
workers fail and slots come and go.

MPI fixes the world size when a job starts, so elasticity is restart-based: the
agent starts the workers with ``mpirun`` (or ``srun`` inside a Slurm
allocation), watches them, and relaunches them at a new size, where they resume
from the newest complete checkpoint, resharded
(:class:`~mpishard.strategies.ElasticOptimizer` does that side).

* A worker dies (killed, crashed, node lost): the launcher ends the job; the
  agent relaunches with one worker fewer (its slot is taken as lost), if that
  is still at least ``min_workers`` and restarts are left.
* The slot source changes (a rewritten ``--slots-file`` or hostfile, or SIGUSR2
  or SIGHUP to the agent): the agent sends SIGUSR1 to the workers, which write a
  checkpoint at the next step boundary and exit with
  :data:`~mpishard.exitcodes.EXIT_STOPPED`; the agent relaunches at the new size,
  within ``[min_workers, max_workers]``.
* SIGTERM or SIGINT to the agent (a Slurm preemption or time limit) is passed
  on to the workers, which checkpoint and stop; the agent then stops too.

The agent never initialises MPI itself: it is the parent of ``mpirun``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TextIO

from ..exitcodes import EXIT_STOPPED
from .slots import SlotSource, next_size

__all__ = ["ElasticAgent", "ElasticFailure", "last_checkpoint"]


class ElasticFailure(Exception):
    """The job cannot go on: too few workers, or no restarts left."""


def last_checkpoint(folder: str | None) -> str | None:
    """The newest complete checkpoint file in ``folder`` (by the step in its name)."""
    if not folder or not os.path.isdir(folder):
        return None
    best = None
    for name in os.listdir(folder):
        match = re.search(r"-(\d+)\.h5$", name)   # temporaries end otherwise
        if match and (best is None or int(match.group(1)) > best[0]):
            best = (int(match.group(1)), os.path.join(folder, name))
    return best[1] if best else None


@dataclass
class ElasticAgent:
    """Runs ``command`` on between ``min_workers`` and ``max_workers`` ranks.

    Args:
        command: the worker command (``python train.py ...``), unchanged between sizes.
        min_workers, max_workers: the allowed range of the world size.
        slots: where the number of available slots comes from.
        max_restarts: relaunches after failures (planned resizes do not count).
        launcher: ``"mpirun"``, ``"srun"`` or ``"auto"`` (srun inside Slurm).
        launcher_args: extra arguments for the launcher (e.g. ``--oversubscribe``).
        checkpoint_dir: where the workers checkpoint, to name the last good one.
        log: a file receiving one JSON object per event.
        poll: seconds between looks at the workers and the slot source.
    """

    command: Sequence[str]
    min_workers: int = 1
    max_workers: int = 1024
    slots: SlotSource = field(default_factory=SlotSource)
    max_restarts: int = 3
    launcher: str = "auto"
    launcher_args: Sequence[str] = ()
    checkpoint_dir: str | None = None
    log: str | None = None
    poll: float = 0.2
    out: TextIO = sys.stderr

    def __post_init__(self) -> None:
        if not self.command:
            raise ValueError("expecting a worker command after --, got none")
        if not 1 <= self.min_workers <= self.max_workers:
            raise ValueError(f"expecting 1 <= --min-workers <= --max-workers, got "
                             f"{self.min_workers} and {self.max_workers}")
        if self.launcher == "auto":
            self.launcher = "srun" if os.environ.get("SLURM_JOB_ID") else "mpirun"
        if self.launcher not in ("mpirun", "srun"):
            raise ValueError(f"launcher must be mpirun, srun or auto, got {self.launcher!r}")
        self._rescan = False
        self._stop_signal: int | None = None
        # Held open for the agent's life (closed in run()): every event is appended.
        self._log_file = open(self.log, "a") if self.log else None  # noqa: SIM115
        import tempfile

        self._ready_file = os.path.join(tempfile.gettempdir(),
                                        f"mpishard-ready-{os.getpid()}-{id(self)}")

    # --- events --------------------------------------------------------------
    def _event(self, kind: str, **fields) -> None:
        record = {"time": time.time(), "event": kind, **fields}
        text = " ".join(f"{k}={v}" for k, v in fields.items())
        self.out.write(f"[mpishard run] {kind} {text}\n")
        self.out.flush()
        if self._log_file is not None:
            self._log_file.write(json.dumps(record) + "\n")
            self._log_file.flush()

    def _fail(self, why: str) -> ElasticFailure:
        ckpt = last_checkpoint(self.checkpoint_dir)
        where = (f"the last good checkpoint is {ckpt}" if ckpt else
                 "no checkpoint was found" + ("" if self.checkpoint_dir else
                                              " (pass --checkpoint-dir to have it named)"))
        self._event("stop", reason=why, checkpoint=ckpt)
        return ElasticFailure(f"{why}; {where}")

    # --- launching -------------------------------------------------------------
    def launch_command(self, workers: int) -> list[str]:
        if self.launcher == "srun":
            base = ["srun", "-n", str(workers), "--kill-on-bad-exit=1"]
        else:
            base = ["mpirun", "-n", str(workers)]
        return base + list(self.launcher_args) + list(self.command)

    def _start(self, workers: int, restarts: int, reason: str,
               died_at: float | None) -> subprocess.Popen:
        env = dict(os.environ)
        env.update(MPISHARD_ELASTIC="1", MPISHARD_ELASTIC_WORKERS=str(workers),
                   MPISHARD_ELASTIC_RESTARTS=str(restarts),
                   MPISHARD_ELASTIC_MIN_WORKERS=str(self.min_workers),
                   MPISHARD_ELASTIC_MAX_WORKERS=str(self.max_workers))
        if died_at is not None:
            env["MPISHARD_ELASTIC_FAILED_AT"] = repr(died_at)
        # The workers create this file once every rank handles SIGUSR1: a signal
        # sent before that would kill a worker that is still starting up.
        env["MPISHARD_ELASTIC_READY_FILE"] = self._ready_file
        try:
            os.remove(self._ready_file)
        except FileNotFoundError:
            pass
        cmd = self.launch_command(workers)
        self._event("launch", workers=workers, restarts=restarts, reason=reason,
                    command=shlex.join(cmd))
        return subprocess.Popen(cmd, env=env)

    def _signal(self, proc: subprocess.Popen, signum: int) -> None:
        try:
            proc.send_signal(signum)   # mpirun and srun forward it to every worker
        except ProcessLookupError:
            pass

    # --- the loop ---------------------------------------------------------------
    def run(self) -> int:
        """Run until the workers finish (returns 0), the agent is told to stop
        (returns the workers' status), or the job cannot go on (raises).

        Raises:
            ElasticFailure: fewer than ``min_workers`` slots, or restarts used up;
                the message names the last good checkpoint.
        """
        previous = {s: signal.getsignal(s) for s in (signal.SIGUSR2, signal.SIGHUP,
                                                      signal.SIGTERM, signal.SIGINT)}
        signal.signal(signal.SIGUSR2, self._on_rescan)
        signal.signal(signal.SIGHUP, self._on_rescan)
        signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGINT, self._on_stop)
        try:
            return self._loop()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            if self._log_file is not None:
                self._log_file.close()

    def _on_rescan(self, signum, frame) -> None:
        self._rescan = True

    def _on_stop(self, signum, frame) -> None:
        self._stop_signal = signum

    def _available(self) -> int:
        try:
            return self.slots.available()
        except (OSError, ValueError) as exc:
            raise self._fail(f"cannot read {self.slots.describe()}: {exc}") from None

    def _loop(self) -> int:
        workers = next_size("start", 0, self._available(), self.min_workers, self.max_workers)
        if workers < self.min_workers:
            raise self._fail(f"{workers} slot(s) available in {self.slots.describe()}, "
                             f"fewer than --min-workers {self.min_workers}")
        restarts, reason, died_at = 0, "start", None
        while True:
            stamp = self.slots.stamp()
            proc = self._start(workers, restarts, reason, died_at)
            resize_to = None
            forwarded = False
            while proc.poll() is None:
                time.sleep(self.poll)
                ready = os.path.exists(self._ready_file)
                if self._stop_signal is not None and not forwarded and ready:
                    self._event("forward", signal=signal.Signals(self._stop_signal).name)
                    self._signal(proc, signal.SIGTERM)
                    forwarded = True
                new_stamp = self.slots.stamp()
                if ((new_stamp != stamp or self._rescan) and resize_to is None
                        and not forwarded and ready):
                    stamp, self._rescan = new_stamp, False
                    target = next_size("slots", workers, self._available(),
                                       self.min_workers, self.max_workers)
                    if target != workers and target >= self.min_workers:
                        resize_to = target
                        self._event("resize", workers=workers, to=target)
                        self._signal(proc, signal.SIGUSR1)
            code = proc.returncode
            try:
                os.remove(self._ready_file)
            except FileNotFoundError:
                pass
            if code == 0:
                self._event("done", workers=workers, restarts=restarts)
                return 0
            if forwarded:
                self._event("stopped", code=code, checkpoint=last_checkpoint(self.checkpoint_dir))
                return 0 if code == EXIT_STOPPED else code
            if code == EXIT_STOPPED:
                # The workers checkpointed for a resize (ours, or their own decision).
                target = resize_to if resize_to is not None else next_size(
                    "slots", workers, self._available(), self.min_workers, self.max_workers)
                if target < self.min_workers:
                    raise self._fail(f"resize to {target} worker(s) is below --min-workers "
                                     f"{self.min_workers}")
                workers, reason, died_at = target, "resize", None
                continue
            died_at = time.time()
            restarts += 1
            self._event("failure", workers=workers, code=code, restarts=restarts)
            if restarts > self.max_restarts:
                raise self._fail(f"a worker failed (exit status {code}) and the "
                                 f"{self.max_restarts} restart(s) allowed are used up")
            target = next_size("failure", workers, self._available(), self.min_workers,
                               self.max_workers)
            if target < self.min_workers:
                raise self._fail(f"a worker failed (exit status {code}): {target} worker(s) "
                                 f"left, fewer than --min-workers {self.min_workers}")
            workers, reason = target, "failure"
