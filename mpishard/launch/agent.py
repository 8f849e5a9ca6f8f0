"""The elastic agent behind ``mpishard run``: keep a training job alive as
workers fail and slots come and go.

MPI fixes the world size when a job starts, so elasticity is restart-based: the
agent starts the workers with ``mpirun`` (or ``srun`` inside a Slurm
allocation), watches them, and relaunches them at a new size, where they resume
from the newest complete checkpoint, resharded
([`ElasticOptimizer`][mpishard.strategies.elastic.ElasticOptimizer] does that side).

The agent watches the workers themselves, not only the launcher: each rank notes
its pid and host in a per-launch folder (``MPISHARD_JOB_DIR``, see
`mpishard.comm.stuck`) and removes the note when it exits through Python. A
worker on the agent's host whose note stays while its pid is gone died (SIGKILL, a
crash, the out-of-memory killer).

* Workers die: the agent sees it within ``poll`` seconds, waits ``grace`` seconds
  for other deaths of the same event, ends the survivors on its host itself (Open
  MPI's ``mpirun`` takes about 2 s to notice) and relaunches with as many workers
  fewer as died (their slots are taken as lost), unless the slot source was
  rewritten after the death: then with what it says. At least ``min_workers`` and
  while restarts are left. A failure without a death the agent can see (an
  exception, an abort, a worker on another host) counts one lost slot.
* The slot source changes (a rewritten ``--slots-file`` or hostfile, or SIGUSR2
  or SIGHUP to the agent): the agent sends SIGUSR1 to the workers, which write a
  checkpoint at the next step boundary and exit with
  `EXIT_STOPPED`; the agent relaunches at the new size,
  within ``[min_workers, max_workers]``.
* SIGTERM or SIGINT to the agent (a Slurm preemption or time limit, Ctrl-C): the
  agent sends SIGTERM straight to the workers on its host (and SIGUSR1 through the
  launcher, which passes it on unchanged, where some run elsewhere), never to the
  launcher: Open MPI 4.1's ``mpirun`` would SIGKILL the ranks about 2 s later,
  losing a longer step. The workers checkpoint and exit with 75; the agent then
  exits with the workers' status: **75** for that clean stop, 0 if they had
  finished anyway, else the launcher's status. A second SIGTERM/SIGINT ends the
  launcher at once. (``mpirun`` runs in a session of its own, so a terminal's
  Ctrl-C reaches the agent only.)
* Workers that exit 0 after the agent asked them to stop (a resize, or SIGTERM)
  finished only if training did: their ``ElasticOptimizer`` leaves a note in the
  launch folder when it stopped for a signal and checkpointed
  (`STOP_NOTE`). With that note the agent takes the
  status 0 for 75 (a worker script that ignores ``opt.exit_code``, as scripts
  written for 0.1 do): it relaunches at the new size, or exits 75 after SIGTERM,
  and says in one line (an ``unfinished`` event) that the script should end with
  ``raise SystemExit(opt.exit_code)``. Without the note (the workers had
  finished before the signal reached them) 0 means done.

The workers see these variables (all set by the agent):

=================================  ==========================================
``MPISHARD_ELASTIC``               ``1``: started by the agent
``MPISHARD_ELASTIC_WORKERS``       this launch's world size
``MPISHARD_ELASTIC_RESTARTS``      relaunches after failures so far (0 first)
``MPISHARD_ELASTIC_MIN_WORKERS``   ``--min-workers`` (ElasticOptimizer's default)
``MPISHARD_ELASTIC_MAX_WORKERS``   ``--max-workers`` (ElasticOptimizer's default)
``MPISHARD_ELASTIC_FAILED_AT``     after a failure: the last moment (epoch
                                   seconds) the dead worker was seen alive, at
                                   most ``poll`` s before its death (else when
                                   the launcher exited); ``recovery_seconds``
                                   counts from it to the first step after
``MPISHARD_ELASTIC_LOST``          after a failure: workers lost
``MPISHARD_SPARES``                 ``--spares`` (ShardingConfiguration's default)
``MPISHARD_ELASTIC_READY_FILE``    rank 0 creates it once every rank handles
                                   SIGUSR1 and SIGTERM
``MPISHARD_JOB_DIR``               this launch's folder of rank notes
=================================  ==========================================

The agent never initialises MPI itself: it is the parent of ``mpirun``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TextIO

from ..exitcodes import EXIT_STOPPED, STOP_NOTE
from .slots import SlotSource, next_size

__all__ = ["ElasticAgent", "ElasticFailure", "WorkerWatch", "last_checkpoint"]


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


def _alive(pid: int) -> bool:
    """``pid`` is a running (or stopped) process, not gone and not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
        return text[text.rindex(")") + 2:][:1] not in "ZX"
    except FileNotFoundError:
        return False
    except OSError:       # no /proc: ask the kernel (a zombie then counts as alive)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


class WorkerWatch:
    """The workers of one launch, from the notes they leave in ``directory``
    (``rank-R.json``: pid and host; ``abort-R.json``: the rank aborted the job).

    `look` returns the ranks on this host that died: note present, pid
    gone. A note that disappears is a rank that exited through Python (normally,
    or with an exception); such an exit, or an abort, marks the failure as the
    software's (`software`), and deaths after it (the launcher ending the
    others) are not counted.
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.host = socket.gethostname()
        self.workers: dict[int, tuple[int, str]] = {}
        self.dead: set[int] = set()
        self.software = False
        #: Ranks seen training (a ``train-R.json`` note), and those whose note is there now.
        self.training: set[int] = set()
        self.train_now: set[int] = set()

    def _notes(self) -> dict[int, tuple[int, str]]:
        found = {}
        try:
            names = os.listdir(self.directory)
        except OSError:
            return found
        self.train_now = {int(m.group(1)) for m in map(re.compile(r"train-(\d+)\.json").fullmatch,
                                                       names) if m}
        self.training |= self.train_now
        for name in names:
            if name.startswith("abort-"):
                self.software = True
            match = re.fullmatch(r"rank-(\d+)\.json", name)
            if not match:
                continue
            try:
                with open(os.path.join(self.directory, name)) as f:
                    note = json.load(f)
                found[int(match.group(1))] = (int(note["pid"]), str(note["host"]))
            except (OSError, ValueError, KeyError):
                continue      # being written (it is replaced atomically) or removed
        return found

    def look(self) -> set[int]:
        """Ranks found dead by this look (not before)."""
        notes = self._notes()
        if any(rank not in notes and rank not in self.dead for rank in self.workers):
            self.software = True                 # a rank left through Python
        self.workers.update(notes)
        new = {rank for rank, (pid, host) in notes.items()
               if host == self.host and rank not in self.dead and not _alive(pid)}
        self.dead |= new
        return new

    def cut_short(self) -> bool:
        """After the launch: ranks noted that they train (``train-R.json``) and
        not one of them noted the end of its training (each note is still
        there): the job was ended from outside, whatever the launcher's status."""
        self._notes()
        return bool(self.training) and self.training <= self.train_now

    def local(self) -> list[int]:
        """Pids of the live workers on this host."""
        return [pid for rank, (pid, host) in self.workers.items()
                if host == self.host and rank not in self.dead and _alive(pid)]

    def remote(self) -> bool:
        """Some worker runs on another host."""
        return any(host != self.host for _, host in self.workers.values())

    def signal_local(self, signum: int) -> int:
        """Send ``signum`` to the live workers on this host; how many got it."""
        sent = 0
        for pid in self.local():
            try:
                os.kill(pid, signum)
                sent += 1
            except (ProcessLookupError, PermissionError):
                pass
        return sent


@dataclass
class ElasticAgent:
    """Runs ``command`` on between ``min_workers`` and ``max_workers`` ranks.

    Args:
        command: the worker command (``python train.py ...``), unchanged between sizes.
        min_workers, max_workers: the allowed range of the world size (passed to
            the workers, where [`ElasticOptimizer`][mpishard.strategies.elastic.ElasticOptimizer]
            takes them as its defaults).
        slots: where the number of available slots comes from.
        max_restarts: relaunches after failures (planned resizes do not count).
        launcher: ``"mpirun"``, ``"srun"`` or ``"auto"`` (srun inside Slurm).
        launcher_args: extra arguments for the launcher (e.g. ``--oversubscribe``).
        checkpoint_dir: where the workers checkpoint, to name the last good one.
        log: a file receiving one JSON object per event.
        poll: seconds between looks at the workers and the slot source.
        grace: seconds after a first death during which further deaths count as
            the same event (two workers killed at once), before the agent ends
            the survivors on its host.
        fault_tolerance: ``"ulfm"``: start ``mpirun --with-ft ulfm --mca coll ^han``
            (Open MPI 5, the ``mpirun`` first on ``PATH``; without ``han``, whose
            collectives have swallowed failures, unless ``launcher_args`` choose
            the collective components) and leave the survivors of a death
            running: they go on in place ([`run_training`][mpishard.train.run_training]);
            the agent only records a ``lost`` event, and relaunches when they
            exit 75 (fewer than ``min_workers`` left, or a layout that cannot go
            on in place) at ``min(n - lost, available)`` workers, or what the
            slot source says if it was rewritten since. ``"off"`` (default):
            a death ends the launch and the agent relaunches.
        spares: with ``"ulfm"``, the last ``spares`` ranks of each launch are spare
            ranks (``MPISHARD_SPARES``, the default of
            [`ShardingConfiguration`][mpishard.config.ShardingConfiguration]'s
            ``spares``): a death is then healed in place, at full size.
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
    poll: float = 0.1
    grace: float = 0.3
    out: TextIO = sys.stderr
    fault_tolerance: str = "off"
    spares: int = 0

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
        if self.fault_tolerance not in ("off", "ulfm"):
            raise ValueError(f"fault_tolerance must be off or ulfm, got "
                             f"{self.fault_tolerance!r}")
        if self.fault_tolerance == "ulfm" and self.launcher != "mpirun":
            raise ValueError("fault_tolerance 'ulfm' needs the mpirun launcher (Open MPI 5): "
                             "fault tolerance is not supported under srun")
        if self.spares and (self.fault_tolerance != "ulfm" or
                            not 0 < self.spares < self.min_workers):
            raise ValueError(f"--spares {self.spares} needs --fault-tolerance ulfm and fewer "
                             f"spares than --min-workers ({self.min_workers}), got "
                             f"--fault-tolerance {self.fault_tolerance}")
        self._rescan = False
        self._stop_signal: int | None = None
        self._stops = 0
        # Held open for the agent's life (closed in run()): every event is appended.
        self._log_file = open(self.log, "a") if self.log else None  # noqa: SIM115
        self._folder = tempfile.mkdtemp(prefix=f"mpishard-agent-{os.getpid()}-")
        self._ready_file = os.path.join(self._folder, "ready")
        self._launches = 0

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
            if self.fault_tolerance == "ulfm":
                base += ["--with-ft", "ulfm"]
                if not any("coll" in arg for arg in self.launcher_args):
                    # The han collectives have swallowed failures (open-mpi/ompi#11794)
                    # and hung in MPIX_Comm_agree across nodes (#13915).
                    base += ["--mca", "coll", "^han"]
        return base + list(self.launcher_args) + list(self.command)

    def _start(self, workers: int, restarts: int, reason: str, died_at: float | None,
               lost: int, job_dir: str) -> subprocess.Popen:
        env = dict(os.environ)
        env.update(MPISHARD_ELASTIC="1", MPISHARD_ELASTIC_WORKERS=str(workers),
                   MPISHARD_ELASTIC_RESTARTS=str(restarts),
                   MPISHARD_ELASTIC_MIN_WORKERS=str(self.min_workers),
                   MPISHARD_ELASTIC_MAX_WORKERS=str(self.max_workers),
                   MPISHARD_JOB_DIR=job_dir, MPISHARD_SPARES=str(self.spares))
        for key in ("MPISHARD_ELASTIC_FAILED_AT", "MPISHARD_ELASTIC_LOST"):
            env.pop(key, None)
        if died_at is not None:
            env["MPISHARD_ELASTIC_FAILED_AT"] = repr(died_at)
            env["MPISHARD_ELASTIC_LOST"] = str(lost)
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
        # A session of its own: a terminal's Ctrl-C (SIGINT to the foreground
        # group) reaches the agent, which stops the workers cleanly, and not mpirun.
        return subprocess.Popen(cmd, env=env, start_new_session=True)

    def _signal(self, proc: subprocess.Popen, signum: int) -> None:
        try:
            proc.send_signal(signum)   # mpirun and srun forward SIGUSR1 to every worker
        except ProcessLookupError:
            pass

    # --- the loop ---------------------------------------------------------------
    def run(self) -> int:
        """Run until the workers finish (returns 0), the agent is told to stop
        (returns the workers' status: 75 when they checkpointed and stopped), or
        the job cannot go on (raises).

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
            shutil.rmtree(self._folder, ignore_errors=True)

    def _on_rescan(self, signum, frame) -> None:
        self._rescan = True

    def _on_stop(self, signum, frame) -> None:
        self._stop_signal = signum
        self._stops += 1

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
        restarts, reason, died_at, lost = 0, "start", None, 0
        while True:
            self._launches += 1
            job_dir = os.path.join(self._folder, f"launch-{self._launches}")
            os.makedirs(job_dir)
            stamp = self.slots.stamp()
            proc = self._start(workers, restarts, reason, died_at, lost, job_dir)
            watch = WorkerWatch(job_dir)
            try:
                code, outcome = self._watch(proc, workers, stamp, watch)
            finally:
                if proc.poll() is None:      # the agent itself is failing: take mpirun along
                    proc.kill()
                    proc.wait()
            why = f"exit status {code}"
            if code == 0 and self.fault_tolerance == "ulfm" and watch.cut_short():
                # A lost node: Open MPI 5.0's PRRTE ends the whole job and exits 0.
                code, why = 1, ("the launcher exited 0, but no worker finished its "
                                "training: a lost node ends an Open MPI 5.0 job")
            if code == 0 and (outcome["resize_to"] is not None or outcome["stopped"]):
                code = self._unfinished(job_dir, outcome)
            shutil.rmtree(job_dir, ignore_errors=True)
            try:
                os.remove(self._ready_file)
            except FileNotFoundError:
                pass
            if code == 0:
                self._event("done", workers=workers, restarts=restarts)
                return 0
            if outcome["stopped"]:
                self._event("stopped", code=code, checkpoint=last_checkpoint(self.checkpoint_dir))
                return code if code >= 0 else 128 - code
            if code == EXIT_STOPPED:
                # The workers checkpointed for a resize (ours, or their own decision:
                # under ULFM, survivors of a death that cannot go on in place).
                resize_to = outcome["resize_to"]
                lost = outcome["lost"]
                if resize_to is not None:
                    target = resize_to
                elif lost and not self.slots.modified_since(outcome["died_at"]):
                    target = next_size("failure", workers, self._available(),
                                       self.min_workers, self.max_workers, lost=lost)
                else:
                    target = next_size("slots", workers, self._available(),
                                       self.min_workers, self.max_workers)
                if target < self.min_workers:
                    raise self._fail(f"resize to {target} worker(s) is below --min-workers "
                                     f"{self.min_workers}")
                workers, reason, died_at, lost = target, "resize", None, 0
                continue
            died_at = outcome["died_at"] or time.time()
            lost = outcome["lost"] or 1
            restarts += 1
            spoke = self.slots.modified_since(died_at)
            self._event("failure", workers=workers, code=code, why=why, restarts=restarts,
                        lost=lost,
                        died_at=died_at, noticed=outcome["noticed"],
                        seconds_to_exit=round(time.time() - died_at, 3),
                        slots_rewritten=spoke)
            if restarts > self.max_restarts:
                raise self._fail(f"a worker failed ({why}) and the "
                                 f"{self.max_restarts} restart(s) allowed are used up")
            available = self._available()
            target = (next_size("slots", workers, available, self.min_workers, self.max_workers)
                      if spoke else next_size("failure", workers, available, self.min_workers,
                                              self.max_workers, lost=lost))
            if target < self.min_workers:
                raise self._fail(f"a worker failed ({why}): {target} worker(s) "
                                 f"left, fewer than --min-workers {self.min_workers}")
            workers, reason = target, "failure"

    def _unfinished(self, job_dir: str, outcome: dict) -> int:
        """The status to act on when the workers exited 0 after the agent asked
        them to stop: 75 when their note says that training stopped for it and
        checkpointed (a worker script that ignores ``opt.exit_code``), else 0."""
        try:
            with open(os.path.join(job_dir, STOP_NOTE)) as f:
                note = json.load(f)
        except (OSError, ValueError):
            return 0                          # no note: they had finished
        then = ("relaunches them at the new size" if outcome["resize_to"] is not None
                else f"exits {EXIT_STOPPED}")
        self._event("unfinished", reason=note.get("reason"), step=note.get("step"),
                    checkpoint=note.get("checkpoint"))
        self.out.write(f"[mpishard run] the workers exited with status 0 after stopping for "
                       f"a {note.get('reason')} at step {note.get('step')} (checkpointed): "
                       f"training is not finished, so the agent {then} as for status "
                       f"{EXIT_STOPPED}; end the worker script with "
                       f"`raise SystemExit(opt.exit_code)`\n")
        self.out.flush()
        return EXIT_STOPPED

    def _watch(self, proc: subprocess.Popen, workers: int, stamp: tuple,
               watch: WorkerWatch) -> tuple[int, dict]:
        """Follow one launch to its end: deaths, slot changes, stop signals.
        Returns the launcher's status and what happened."""
        outcome = {"stopped": False, "resize_to": None, "died_at": None, "lost": 0,
                   "noticed": None}
        seen_alive = time.time()
        noticed = None          # monotonic time of the look that first saw a death
        finished_off = False
        while proc.poll() is None:
            time.sleep(self.poll)
            now = time.time()
            dead = watch.look()
            if dead and self.fault_tolerance == "ulfm":
                # The survivors go on in place: note the death, end nothing.
                if outcome["died_at"] is None:
                    outcome["died_at"] = seen_alive
                outcome["lost"] = len(watch.dead)
                self._event("lost", dead=sorted(dead), lost=outcome["lost"], in_place=True)
                dead = set()
            if dead and noticed is None and not watch.software:
                noticed = time.monotonic()
                # The last look that saw every worker alive: the death came after it.
                outcome["died_at"] = seen_alive
                outcome["noticed"] = now
            if noticed is not None:
                if time.monotonic() - noticed <= self.grace:
                    outcome["lost"] = len(watch.dead)
                elif not finished_off:
                    # The same event is over: end the survivors here rather than wait
                    # for the launcher to notice (about 2 s for Open MPI's mpirun).
                    finished_off = True
                    self._event("teardown", dead=sorted(watch.dead),
                                killing=watch.signal_local(signal.SIGKILL))
                continue
            seen_alive = now
            ready = os.path.exists(self._ready_file)
            if self._stop_signal is not None and self._stops > 1 and outcome["stopped"]:
                self._event("kill", signal=signal.Signals(self._stop_signal).name)
                self._signal(proc, signal.SIGTERM)      # asked twice: stop now
                self._stops = 1
            if self._stop_signal is not None and not outcome["stopped"] and ready:
                direct = watch.signal_local(signal.SIGTERM)
                through = watch.remote() or direct == 0
                if through:
                    self._signal(proc, signal.SIGUSR1)   # passed on unchanged by mpirun
                self._event("forward", signal=signal.Signals(self._stop_signal).name,
                            direct=direct, through_launcher=through)
                outcome["stopped"] = True
            new_stamp = self.slots.stamp()
            if ((new_stamp != stamp or self._rescan) and outcome["resize_to"] is None
                    and not outcome["stopped"] and ready):
                stamp, self._rescan = new_stamp, False
                target = next_size("slots", workers, self._available(),
                                   self.min_workers, self.max_workers)
                if target != workers and target >= self.min_workers:
                    outcome["resize_to"] = target
                    self._event("resize", workers=workers, to=target)
                    self._signal(proc, signal.SIGUSR1)
        return proc.returncode, outcome
