"""Surviving a lost rank in place with ULFM (User-Level Failure Mitigation).

Open MPI 5 started with ``mpirun --with-ft ulfm`` keeps a job running when a rank
dies: on a communicator whose error handler is ``MPI.ERRORS_RETURN`` a call that
involves the dead rank fails with ``ERR_PROC_FAILED`` (or ``ERR_REVOKED``, once a
survivor has revoked the communicator) instead of ending the job. mpi4py raises
that as `mpi4py.MPI.Exception`, out of the library's timed calls
([`FlatComm.wait_request`][mpishard.comm.FlatComm.wait_request] tests its
request, and the test reports the error). The survivors then:

1. **revoke** the communicator, so every survivor, also one waiting in a call the
   dead rank was not part of, leaves it with ``ERR_REVOKED``;
2. **shrink** it to the survivors (``MPI_Comm_shrink``: about 10 ms for 3 ranks here);
3. **agree** on the last completed step: each survivor gives the step it completed
   last; the newest wins, and `Survivors.source` (the lowest survivor that
   completed it) hands its parameters and optimizer state to the others. (Under
   DDP a survivor that missed the end of that step only lacks the update; the
   reference that drops the rank from the next step is then reproduced exactly.)
4. build the groups again over the survivors (the caller: a new
   [`ShardingConfiguration`][mpishard.config.ShardingConfiguration] over `Survivors.world`'s
   communicator, which this layer cannot import).

[`enable`][mpishard.comm.ulfm.enable] sets ``ERRORS_RETURN`` on the library's communicators
(``ShardingConfiguration(fault_tolerance="auto")`` does it where
[`available`][mpishard.comm.ulfm.available]: the library has the ULFM calls and the job was started
with fault tolerance on); [`available`][mpishard.comm.ulfm.available] says why not elsewhere.
Collectives over a revoked or failed communicator are the only MPI calls made here.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass

from mpi4py import MPI

from ..errors import MpiShardError
from . import stuck
from .communicator import FlatComm

__all__ = ["FAILURE_CLASSES", "MODES", "Survivors", "available", "enable", "exit_now",
           "is_failure", "is_on", "lost_since", "recover", "wanted"]

#: The error classes that mean "a rank of this communicator failed" (or another
#: survivor revoked it after seeing that).
FAILURE_CLASSES = tuple(getattr(MPI, name) for name in
                        ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")
                        if hasattr(MPI, name))


def available() -> tuple[bool, str]:
    """``(True, "")`` when this job can recover in place, else ``(False, why)``."""
    if not hasattr(MPI.Comm, "Shrink"):
        return False, f"mpi4py {MPI.Get_version()} has no Comm.Shrink (no ULFM)"
    library = MPI.Get_library_version().split(",")[0].strip("\x00 \n")   # "Open MPI v4.1.4"
    if not library.startswith("Open MPI v5"):
        return False, f"the MPI library is {library!r}, not Open MPI 5 with ULFM"
    if os.environ.get("OMPI_MCA_mpi_ft_enable", "").lower() not in ("1", "true", "yes"):
        return False, ("the job was not started with fault tolerance on "
                       "(mpirun --with-ft ulfm)")
    return True, ""


#: The values of ``ShardingConfiguration(fault_tolerance=...)``.
MODES = ("auto", "ulfm", "off")


def wanted(mode: str, world: FlatComm) -> bool:
    """Whether ``fault_tolerance=mode`` turns ULFM on for this job: ``"auto"`` when
    [`available`][mpishard.comm.ulfm.available], ``"ulfm"`` always (an error where it is not
    available), ``"off"`` never. Collective over ``world`` (errors are agreed).

    Raises:
        ValueError: an unknown mode; MpiShardError: ``"ulfm"`` where it is not
            available, saying why. On every rank.
    """
    world.agree(None if mode in MODES else
                f"fault_tolerance must be one of {', '.join(MODES)}, got {mode!r}", ValueError)
    if mode == "off":
        return False
    ok, why = available()
    if mode == "ulfm":
        world.agree(None if ok else f"fault_tolerance='ulfm' but {why}", MpiShardError)
    return world.allreduce(ok, op="land")


def enable(comms: Iterable[FlatComm], *, evict_stuck: bool = False) -> None:
    """Make calls over ``comms`` return errors (raised by mpi4py as
    `mpi4py.MPI.Exception`) instead of ending the job. Local.
    Communicators made from them later (dup, split, shrink) inherit it. (mpi4py
    sets ``ERRORS_RETURN`` on ``COMM_WORLD`` already unless
    ``mpi4py.rc.errors`` says otherwise; this makes it hold either way.)

    ``evict_stuck``: a timed call that runs out SIGKILLs the ranks of its group
    that did not arrive (on this host: a SIGSTOPped rank, an endless loop, a
    deadlock; `mpishard.comm.stuck.evict`) instead of aborting the job, so
    the call fails with ``ERR_PROC_FAILED`` and the survivors recover in place.
    A second timeout in the same call aborts as usual."""
    for comm in comms:
        comm.comm.Set_errhandler(MPI.ERRORS_RETURN)
        comm.evict_stuck = evict_stuck
        comm.fault_tolerant = True   # the training loop recovers in place (is_on)


def is_on(comm: FlatComm) -> bool:
    """Whether [`enable`][mpishard.comm.ulfm.enable] turned ULFM error handling on for ``comm``.
    Local."""
    return bool(getattr(comm, "fault_tolerant", False))


def is_failure(exc: BaseException) -> bool:
    """``exc`` says that a rank failed (or a survivor revoked the communicator)."""
    return isinstance(exc, MPI.Exception) and exc.Get_error_class() in FAILURE_CLASSES


@dataclass
class Survivors:
    """What the survivors of a lost rank agreed on ([`recover`][mpishard.comm.ulfm.recover]).

    Attributes:
        world: a [`FlatComm`][mpishard.comm.FlatComm] over the survivors (errors return).
        step: the newest step any survivor completed.
        source: the lowest rank in `world` that completed `step`.
        steps: each survivor's last completed step, by rank in `world`.
        lost: the ``MPI.COMM_WORLD`` ranks that are gone.
        seconds: from the call to the agreement.
    """

    world: FlatComm
    step: int
    source: int
    steps: list[int]
    lost: list[int]
    seconds: float


def recover(world: FlatComm, step: int, *, name: str | None = None,
            also: Iterable[FlatComm | None] = ()) -> Survivors:
    """Revoke ``world``, shrink it to the survivors and agree on the last
    completed step (``step``: this rank's). Collective over the survivors of
    ``world``; every survivor must call it (a survivor still waiting in a call
    over ``world`` leaves it with ``ERR_REVOKED`` once one has revoked it).
    ``world`` itself is left revoked: free it.

    ``also``: the other communicators of the job (data, tensor and pipeline groups,
    ...), revoked too, first: a rank waiting on one that holds no dead rank (a
    pipeline receive from a live neighbour that has gone on to recover) leaves
    that call with ``ERR_REVOKED`` and comes here as well.

    A further failure during the recovery starts it again over the new survivors.
    """
    t0 = time.perf_counter()
    for other in also:
        if other is not None and other.comm not in (world.comm, MPI.COMM_NULL):
            try:
                other.comm.Revoke()
            except MPI.Exception:
                pass                               # revoked already, or freed
    comm = world.comm
    before = comm.Get_group()
    while True:
        try:
            comm.Revoke()
        except MPI.Exception:
            pass                                   # revoked already, by another survivor
        survivors = comm.Shrink()
        survivors.Set_errhandler(MPI.ERRORS_RETURN)
        flat = FlatComm(survivors, name or world.name, world.deadlines)
        try:
            steps = flat.allgather(int(step))
            break
        except MPI.Exception as exc:
            if not is_failure(exc):
                raise
            comm = survivors                       # another rank failed: again
    newest = max(steps)
    after = survivors.Get_group()
    ranks = list(range(before.Get_size()))
    # Ranks of the old group with no place in the new one are the lost ones.
    placed = MPI.Group.Translate_ranks(before, ranks, after)
    gone = [r for r, p in zip(ranks, placed) if p == MPI.UNDEFINED]
    lost = sorted(MPI.Group.Translate_ranks(before, gone, MPI.COMM_WORLD.Get_group()))
    before.Free()
    after.Free()
    return Survivors(world=flat, step=newest, source=steps.index(newest), steps=steps,
                    lost=lost, seconds=time.perf_counter() - t0)


def lost_since(world: FlatComm) -> BaseException | None:
    """Whether a rank of ``world`` was lost since its last call: a fault-tolerant
    agreement (``MPI_Comm_agree``, the same answer on every alive rank), None
    when every rank is alive, else the failure (``ERR_PROC_FAILED`` or
    ``ERR_REVOKED``) for [`recover`][mpishard.comm.ulfm.recover]. Collective over
    ``world``."""
    try:
        world.comm.Agree(1)
    except MPI.Exception as exc:
        if not is_failure(exc):
            raise
        return exc
    return None


def exit_now(code: int = 0, *, linger: float = 0.0) -> None:
    """End this process now, with ``code``, without ``MPI_Finalize``: for the end of
    a job that lost a rank. Open MPI 5's ``MPI_Finalize`` may then wait forever
    for the dead rank (a PMIx fence; open-mpi/ompi#11404 and #9434; here about 1
    job in 4-10 hung so on a loaded machine). Under ``mpirun --with-ft ulfm`` a
    process that ends so is not an error: ``mpirun`` still exits 0. Flushes
    ``sys.stdout`` and ``sys.stderr`` first, then waits ``linger`` seconds (a
    SIGTERM, ``mpirun`` ending the job, ends the wait); Python's ``atexit``
    handlers do not run.
    """
    stuck.forget()   # an exit, not a death, for the relaunch agent
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    if linger > 0:
        try:   # a handler of the training loop would only note it and sleep on
            signal.signal(signal.SIGTERM, lambda *_: os._exit(code))
        except ValueError:   # not the main thread
            pass
        time.sleep(linger)
    os._exit(code)


#: 0.5's name of `exit_now`, kept importable (tests/faults' job scripts still call it).
leave = exit_now
