"""Naming a stuck rank: each rank's pid and host, the call it waits in, its Python stack.

A timed call ([`FlatComm.wait_request`][mpishard.comm.FlatComm.wait_request])
that runs out knows only that *some* rank of its group did not arrive. To say which,
and why, the ranks keep an out-of-band record in a per-job directory:

* ``rank-R.json`` (R: the ``MPI.COMM_WORLD`` rank): pid and host, written when a
  [`ShardingConfiguration`][mpishard.config.ShardingConfiguration] is built (`register`,
  collective), and removed when the process exits through Python (``atexit``): a rank whose
  file stays while its pid is gone died (the elastic agent reads this too);
* ``wait-R.json``: the call and group this rank has been waiting in for longer than
  `note_after` seconds (written only for such slow waits, so the step loop
  pays nothing; removed when the wait ends);
* ``stack-R.txt``: where ``faulthandler`` writes this rank's Python stack (every
  thread) when it receives `STACK_SIGNAL`, and where the rank's own
  watchdog writes it when the rank makes no progress (`watch`: a rank that
  another host cannot signal shows its stack itself).

At the timeout the waiting rank reads its group's records (`diagnose`): a
member with no ``wait`` record over the same group did not arrive. A member on this
host is then examined: ``/proc/PID/stat`` state ``T`` means stopped (SIGSTOP or a
debugger; a stopped process cannot dump its stack), ``Z`` or no process means it
died; otherwise it is sent `STACK_SIGNAL` and its stack is read back. The
directory is ``MPISHARD_JOB_DIR`` when set (the elastic agent sets it per launch),
else a folder under the temporary directory named by world rank 0's host and pid.
Members on another host are named from the pid and host gathered at registration;
their records are read where the directory is shared (a cluster's shared file
system, ``MPISHARD_JOB_DIR``): there a running member's stack is the one its own
watchdog wrote (``Timeout (0:00:03)!`` then the stack), since no signal reaches
it; where the directory is not shared the message says on which host to read it.
"""

from __future__ import annotations

import atexit
import faulthandler
import json
import os
import re
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from mpi4py import MPI

__all__ = ["STACK_SIGNAL", "JobRecord", "describe_members", "diagnose", "evict", "job",
           "forget", "note_abort", "note_after", "note_training", "note_wait", "process_state",
           "reading_data_source", "register", "unnote_wait", "watch", "watch_after"]

#: The signal that makes a registered rank write its Python stack. A real-time
#: signal where there is one: SIGUSR1 is the elastic agent's "checkpoint and stop"
#: and SIGUSR2 a common user choice (Slurm ``--signal``), and ``faulthandler``'s
#: handler would replace theirs.
STACK_SIGNAL: int = (signal.SIGRTMIN + 5) if hasattr(signal, "SIGRTMIN") else signal.SIGUSR2

_STACK_WAIT = 1.0   # seconds to wait for a signalled rank's stack to appear


@dataclass
class JobRecord:
    """What this process knows of its job: the directory, and each rank's pid and host
    by ``MPI.COMM_WORLD`` rank (the ranks of every configuration built so far)."""

    directory: str
    me: int
    host: str
    members: dict[int, tuple[int, str]] = field(default_factory=dict)
    stack_file: Any = None

    def path(self, kind: str, rank: int) -> str:
        return os.path.join(self.directory, f"{kind}-{rank}.{'txt' if kind == 'stack' else 'json'}")


_job: JobRecord | None = None   # one per process: a process belongs to one MPI job


def job() -> JobRecord | None:
    """This process's record, or None before the first `register`."""
    return _job


def register(world: Any) -> JobRecord:
    """Record every rank's pid and host, pick the job directory and arm the stack
    dump. Collective over ``world`` (a [`FlatComm`][mpishard.comm.FlatComm]): one
    allgather and one broadcast, at configuration time, never in the step loop."""
    global _job
    me = MPI.COMM_WORLD.Get_rank()
    host = socket.gethostname()
    rows = world.allgather((me, os.getpid(), host))
    directory = os.environ.get("MPISHARD_JOB_DIR")
    if not directory:
        first = min(rows)
        directory = world.bcast(os.path.join(
            tempfile.gettempdir(), f"mpishard-{os.getuid()}-job-{first[2]}-{first[1]}"), root=0)
        if _job is None and me == first[0]:
            _sweep(os.path.dirname(directory), host)
    if _job is None or _job.directory != directory:
        os.makedirs(directory, exist_ok=True)
        record = JobRecord(directory, me, host)
        # Held open for the process's life: faulthandler writes to the descriptor from C.
        record.stack_file = open(record.path("stack", me), "w")  # noqa: SIM115
        faulthandler.register(STACK_SIGNAL, file=record.stack_file, all_threads=True,
                              chain=False)
        if _job is not None:
            _job.stack_file.close()
        else:
            atexit.register(_forget)
        _job = record
    _job.members.update({rank: (pid, h) for rank, pid, h in rows})
    unnote_wait()              # a note left by an earlier job whose rank 0 had our pid
    _write(_job.path("rank", me), {"rank": me, "pid": os.getpid(), "host": host})
    return _job


def _sweep(folder: str, host: str) -> None:
    """Remove the folders of earlier jobs on this host whose rank 0 is gone (a job
    that ended in MPI_Abort, where no rank removes its notes)."""
    prefix = f"mpishard-{os.getuid()}-job-{host}-"
    try:
        names = [n for n in os.listdir(folder) if n.startswith(prefix)]
    except OSError:
        return
    for name in names:
        pid = name[len(prefix):]
        if pid.isdigit() and process_state(int(pid)) in (None, "Z", "X"):
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)


def note_abort(message: str) -> None:
    """Note that this rank is about to abort the job (``abort-R.json``): the elastic
    agent then counts the failure as one lost slot, not every rank MPI_Abort ends."""
    if _job is not None:
        try:
            _write(_job.path("abort", _job.me), {"message": message[:500], "time": time.time()})
        except OSError:
            pass


def note_training(active: bool) -> None:
    """Note that this rank trains (``train-R.json``), or remove the note when its
    training ends: notes left at the end of a launch tell the elastic agent that
    training was cut short, whatever the launcher's status (a lost node ends an
    Open MPI 5.0 job with status 0). An exit does not remove it. Only under the
    agent (``MPISHARD_JOB_DIR`` set): nobody else reads it. Local."""
    if _job is None or not os.environ.get("MPISHARD_JOB_DIR"):
        return
    path = _job.path("train", _job.me)
    try:
        if active:
            _write(path, {"pid": os.getpid(), "time": time.time()})
        else:
            os.remove(path)
    except OSError:
        pass


def forget() -> None:
    """Remove this rank's records now (an exit that skips ``atexit``:
    [`mpishard.comm.ulfm.exit_now`][mpishard.comm.ulfm.exit_now]). Local."""
    _forget()


def _forget() -> None:
    """At a normal exit: remove this rank's records (a record left behind with its
    pid gone tells the elastic agent that this rank died)."""
    if _job is None:
        return
    for kind in ("rank", "wait", "stack"):
        try:
            os.remove(_job.path(kind, _job.me))
        except OSError:
            pass
    try:
        os.rmdir(_job.directory)   # the last rank out removes the folder
    except OSError:
        pass


def _write(path: str, data: dict) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def _read(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def watch_after(timeout: float) -> float:
    """Seconds without progress after which a rank's watchdog writes its own stack:
    three quarters of the timeout, so that the stack is there when the waiting
    ranks' timeout runs out."""
    return 0.75 * timeout


def watch(timeout: float | None) -> None:
    """Arm this rank's own watchdog again (the strategies call it at each
    ``backward``): unless it is armed again within `watch_after` of
    ``timeout`` seconds, ``faulthandler`` writes every thread's Python stack to
    ``stack-R.txt``, once, from a thread of its own: a rank stuck in an endless
    loop or a deadlock of its own shows where, also to ranks on another host,
    which cannot signal it. ``None``: disarm. One thread start per call, so
    never per collective. It takes over ``faulthandler.dump_traceback_later``
    for the process. Local."""
    if _job is None or _job.stack_file is None:
        return
    if timeout is None:
        faulthandler.cancel_dump_traceback_later()
        return
    faulthandler.dump_traceback_later(watch_after(timeout), repeat=False,
                                      file=_job.stack_file)


def note_after(timeout: float) -> float:
    """Seconds a wait lasts before it is noted (a quarter of the timeout, at most 1 s)."""
    return min(1.0, 0.25 * timeout)


def note_wait(group: str, rank: int, call: str) -> None:
    """Note that this rank has been waiting in ``call`` over ``group`` for a while. Local."""
    if _job is not None:
        _write(_job.path("wait", _job.me), {"group": group, "rank": rank, "call": call,
                                            "since": time.time()})


def unnote_wait() -> None:
    """The slow wait ended. Local."""
    if _job is not None:
        try:
            os.remove(_job.path("wait", _job.me))
        except OSError:
            pass


_T = TypeVar("_T")


def reading_data_source(read: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """``read(*args, **kwargs)``: the training loop reads the user's data through
    it (a dataset's ``gather``, a stream's next batch). Its frame in a rank's
    stack tells `diagnose` that a rank in no call of the library is in its data
    source. One Python call, nothing else. Local."""
    return read(*args, **kwargs)


#: A faulthandler stack line of a frame of `reading_data_source`.
_IN_DATA_SOURCE = re.compile(rf"line \d+ in {reading_data_source.__name__}$", re.MULTILINE)


def _outside_library(stack: str) -> str:
    """What a rank with no wait note is doing, from its stack."""
    if _IN_DATA_SOURCE.search(stack):
        return ("is in the user's data source (the training loop is reading its dataset "
                "or stream: see its stack)")
    return "is in no call of the library"


def process_state(pid: int) -> str | None:
    """The state letter of ``/proc/PID/stat`` (R, S, D, T, Z, ...), None when there is
    no such process (or no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.rindex(")") + 2:][:1]   # after "(comm) ", which may hold spaces


def describe_members(world_ranks: list[int]) -> list[tuple[int, int | None, str | None]]:
    """``(world rank, pid, host)`` of each member, pid and host None where unknown."""
    members = _job.members if _job is not None else {}
    return [(r, *members.get(r, (None, None))) for r in world_ranks]


def _missing(group: str, world_ranks: list[int]) -> list[tuple[int, int | None, str | None]]:
    """Members of ``world_ranks`` (not this rank) with no wait note over ``group``."""
    missing = []
    for rank, pid, host in describe_members(world_ranks):
        if _job is None or rank == _job.me:
            continue
        note = _read(_job.path("wait", rank))
        if note is not None and note.get("group") == group:
            continue                               # it waits with us
        missing.append((rank, pid, host))
    return missing


def evict(group: str, world_ranks: list[int]) -> list[str]:
    """SIGKILL the members of ``world_ranks`` on this host that did not arrive in a
    wait over ``group`` (stopped ones too: SIGKILL ends a stopped process). Under
    ULFM the survivors' wait then fails with ``ERR_PROC_FAILED`` and they recover
    in place. Returns what was done, one text per member. Local."""
    done = []
    for rank, pid, host in _missing(group, world_ranks):
        where = f"world rank {rank} (pid {pid} on {host})"
        if _job is None or pid is None or host != _job.host:
            done.append(f"{where}: on another host, not evicted")
            continue
        state = process_state(pid)
        try:
            os.kill(pid, signal.SIGKILL)
            done.append(f"{where}: evicted (SIGKILL; it was in state {state})")
        except OSError as exc:
            done.append(f"{where}: not evicted ({exc})")
    return done


def diagnose(group: str, world_ranks: list[int]) -> tuple[str, str]:
    """Who of ``world_ranks`` (a group named ``group``, this rank among them) did not
    arrive in its wait, and why: a one-line summary and the detail (stacks).
    Local: reads the job directory and signals stuck ranks on this host."""
    if _job is None:
        return "", ""
    missing = _missing(group, world_ranks)
    if not missing:
        return ("; every rank of the group is waiting in a call over it (MPI itself is "
                "slow or stuck)"), ""
    parts, details = [], []
    signalled = []
    for rank, pid, host in missing:
        where = f"world rank {rank} (pid {pid} on {host})"
        if host != _job.host or pid is None:
            parts.append(f"{where}: {_remote(rank, host, details)}")
            continue
        state = process_state(pid)
        if state is None or state in "ZX":
            parts.append(f"{where}: has exited (no such running process)")
        elif state in "Tt":
            parts.append(f"{where}: is stopped (/proc/{pid}/stat state {state}: SIGSTOP or "
                         f"a debugger), it cannot show its stack")
        elif not os.path.exists(_job.path("rank", rank)):
            # Its Python is ending (its note went at exit): its stack handler may be
            # gone, and the signal would kill it. Not signalled.
            parts.append(f"{where}: is exiting (its Python program has ended)")
        else:
            signalled.append((rank, pid, where, state, _size(_job.path("stack", rank))))
            try:
                os.kill(pid, STACK_SIGNAL)
            except OSError as exc:
                parts.append(f"{where}: cannot be signalled ({exc})")
                signalled.pop()
    deadline = time.monotonic() + _STACK_WAIT
    for rank, _pid, where, state, before in signalled:
        stack = ""
        path = _job.path("stack", rank)
        while time.monotonic() < deadline:
            stack = _tail(path, before)
            if stack.rstrip().endswith(">") or "File " in stack:
                time.sleep(0.05)                       # let it finish writing
                stack = _tail(path, before)
                break
            time.sleep(0.02)
        doing = _read(_job.path("wait", rank))
        what = f"waits in {doing['call']}" if doing else _outside_library(stack)
        parts.append(f"{where}: is running (state {state}) but {what}")
        details.append(f"[mpishard] Python stack of world rank {rank} (pid {_pid}):\n"
                       + (stack.strip() or "(no stack came back within "
                                           f"{_STACK_WAIT:g} s)") + "\n")
    summary = "; did not arrive: " + "; ".join(parts)
    return summary, "".join(details)


def _remote(rank: int, host: str | None, details: list[str]) -> str:
    """What this rank can tell of a member on another host: its own records, read
    where the job directory is shared (the stack its watchdog wrote, the call it
    waits in); appends the stack to ``details``."""
    assert _job is not None
    path = _job.path("stack", rank)
    if not os.path.exists(_job.path("rank", rank)):
        return (f"on another host, not examined (the job directory {_job.directory} is "
                f"not shared with {host}: its Python stack is in {path} there, written "
                f"by its watchdog after {_STACK_NOTE} without progress)")
    doing = _read(_job.path("wait", rank))
    if doing:
        return f"on another host, waits in {doing['call']}"
    text = _tail(path, 0)
    dump = text[text.rfind("Timeout ("):] if "Timeout (" in text else ""
    if not dump:
        return ("on another host, in no call of the library and no stack from its "
                "watchdog yet (a stopped or very slow process)")
    details.append(f"[mpishard] Python stack of world rank {rank} on {host}, written by "
                   f"its own watchdog:\n{dump.strip()}\n")
    return f"on another host, {_outside_library(dump)[3:]}: its watchdog wrote its stack"


#: How `_remote` names the watchdog's delay in its message.
_STACK_NOTE = "three quarters of the timeout"


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _tail(path: str, offset: int) -> str:
    try:
        with open(path, errors="replace") as f:
            f.seek(offset)
            return f.read()
    except OSError:
        return ""
