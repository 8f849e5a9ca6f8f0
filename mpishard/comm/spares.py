"""Spare ranks (ULFM): launched with the job, outside every training group, waiting.

``ShardingConfiguration(spares=K)`` makes the last ``K`` ranks of its
communicator spares. A [`SparePool`][mpishard.comm.spares.SparePool] holds the
job's communicator over every rank, the training ones and the spares (``job``,
errors returned), and says which of its ranks are spares still waiting.

**How a spare waits.** It posts one ``MPI_Irecv`` on ``job`` from the pool's
``sender`` (the lowest training rank) and tests it with a growing sleep (0.1 ms
doubling up to ``poll``, 10 ms): Open MPI's blocking calls spin a core, a test
every 10 ms costs well under 1 % of one. It is woken

* by a *release* (the message arrives: the ``optimize()`` call ended without
  needing it; [`release`][mpishard.comm.spares.SparePool.release]; it stays a
  spare, for the script's next call), or
* by a failure: the survivors of a lost training rank revoke ``job`` with the
  training groups ([`mpishard.comm.ulfm.recover`][mpishard.comm.ulfm.recover]'s
  ``also``), so the pending receive fails with ``ERR_REVOKED`` (or the sender
  itself died: ``ERR_PROC_FAILED``). The spare then shrinks ``job`` with the
  survivors ([`shrink`][mpishard.comm.spares.SparePool.shrink]), where they agree
  who takes which place ([`mpishard.recovery.spares`][mpishard.recovery.spares]).

A spare that dies while it waits is noticed by nobody until the next shrink
(which leaves it out) or the release (whose message to it fails, and is let fail).
"""

from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

from . import ulfm
from .communicator import FlatComm

__all__ = ["POLL_SECONDS", "SparePool"]

#: The longest sleep between two tests of a waiting spare's receive (seconds).
POLL_SECONDS = 0.01
#: The tag of the release message on ``job``.
_RELEASE_TAG = 0x5350


class SparePool:
    """The job's communicator over the training ranks and the spares, and which
    of its ranks are spares still waiting.

    Args:
        job: every rank of the job (training and spares), errors returned.
        spares: the ranks of ``job`` that are spares still waiting, in order.
    """

    def __init__(self, job: FlatComm, spares: list[int]) -> None:
        self.job = job
        self.spares = list(spares)
        #: Seconds this rank waited as a spare, and the CPU seconds it used meanwhile.
        self.waited = 0.0
        self.cpu_seconds = 0.0

    @classmethod
    def split(cls, world: FlatComm, count: int) -> tuple[SparePool, FlatComm]:
        """``(pool, training)``: the pool over ``world`` (kept as ``job``, errors
        returned), its last ``count`` ranks the spares, and the communicator of
        the first ones (on a spare: a duplicate of ``COMM_SELF``). Collective over
        ``world``."""
        ulfm.enable([world])
        first = world.size - count
        spare = world.rank >= first
        training = world.split(1 if spare else 0, world.rank, "training")
        if spare:   # its own 1-rank world, until it is promoted
            training.free()
            training = FlatComm(MPI.COMM_SELF.Dup(), "spare", world.deadlines)
        return cls(world, list(range(first, world.size))), training

    @property
    def count(self) -> int:
        """Spares still waiting (dead ones included until a shrink leaves them out)."""
        return len(self.spares)

    @property
    def waiting(self) -> bool:
        """This rank is a spare still waiting."""
        return self.job.rank in self.spares

    @property
    def sender(self) -> int:
        """The rank of ``job`` that releases the spares: its lowest training rank."""
        return next(r for r in range(self.job.size) if r not in self.spares)

    def wait(self, poll: float = POLL_SECONDS) -> str:
        """Wait, sleeping, until released (``"release"``) or woken by a failure
        (``"wake"``: then [`shrink`][mpishard.comm.spares.SparePool.shrink]). On a
        waiting spare; point-to-point on ``job``."""
        flag = np.zeros(1, dtype=np.int64)
        t0, c0 = time.perf_counter(), time.process_time()
        request = self.job.comm.Irecv(flag, source=self.sender, tag=_RELEASE_TAG)
        pause = 1e-4
        try:
            while True:
                try:
                    if request.Test():
                        return "release"
                except MPI.Exception as exc:
                    if not ulfm.is_failure(exc):
                        raise
                    return "wake"
                time.sleep(pause)
                pause = min(2 * pause, poll)
        finally:
            self.waited += time.perf_counter() - t0
            self.cpu_seconds += time.process_time() - c0

    def release(self) -> None:
        """Tell every waiting spare that this ``optimize()`` call ended (each one's
        ``wait`` returns ``"release"``). The spares stay spares: the next call of
        the same script (every rank runs it) waits again, and a loss there
        promotes them. The ``sender`` sends, a send to a dead spare fails
        quietly. Point-to-point on ``job`` (every training rank calls it: only
        the ``sender`` sends)."""
        if self.job.rank == self.sender and self.job.comm != MPI.COMM_NULL:
            flag = np.ones(1, dtype=np.int64)
            requests = []
            for r in self.spares:
                try:
                    requests.append(self.job.comm.Isend(flag, dest=r, tag=_RELEASE_TAG))
                except MPI.Exception:
                    pass
            for request in requests:
                try:
                    request.Wait()
                except MPI.Exception:
                    pass          # that spare died while it waited

    def shrink(self, mine: int) -> tuple[FlatComm, list[int]]:
        """Revoke ``job``, shrink it to the ranks alive and gather one integer
        from each (``mine``: a training rank's old rank, -1 on a spare); the new
        ``job`` (errors returned) and the integers, in its rank order (the shrink
        keeps the old order). A failure meanwhile starts it again. Collective over
        the alive ranks of ``job``."""
        comm = self.job.comm
        while True:
            try:
                comm.Revoke()
            except MPI.Exception:
                pass                       # revoked already
            alive = comm.Shrink()
            alive.Set_errhandler(MPI.ERRORS_RETURN)
            flat = FlatComm(alive, self.job.name, self.job.deadlines)
            try:
                return flat, flat.allgather(int(mine))
            except MPI.Exception as exc:
                if not ulfm.is_failure(exc):
                    raise
                comm = alive               # another rank failed: again

    @staticmethod
    def revoke(comms: list[FlatComm]) -> None:
        """Revoke ``comms`` (a failure during a promotion: every rank waiting on
        one leaves it with ``ERR_REVOKED``). Local."""
        for flat in comms:
            try:
                if flat.comm != MPI.COMM_NULL:
                    flat.comm.Revoke()
            except MPI.Exception:
                pass
