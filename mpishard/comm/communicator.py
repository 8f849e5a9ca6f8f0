"""Every MPI call of the library: buffers and small objects over one process group.

``FlatComm`` wraps one MPI communicator (a process group) and knows its name, so a
call that does not finish within the timeout aborts the job with a message that
names the call, the group, and this rank (world rank, host, rank in the group).
Device (CuPy) buffers go to MPI directly when the library is CUDA-aware;
otherwise they are copied through reusable host buffers, one per *slot*, so
concurrent non-blocking operations never share one.

Buffer calls use MPI's capitalisation (``Allreduce``); calls on small Python
objects are lower case (``allreduce``, ``bcast``, ``allgather``, ``gather``) and
travel as pickled bytes through the same timed non-blocking buffer calls, so no
call of the library can wait forever. (Pickle is used for messages between the
ranks of one job only, never in files.)
"""

from __future__ import annotations

import ctypes
import pickle
import socket
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
from mpi4py import MPI

from ..backend import array_namespace, synchronize
from ..errors import CommunicationError, MpiShardError
from . import stuck, waiting
from .cuda import cuda_aware
from .deadlines import Deadlines

__all__ = ["OPS", "FlatComm", "Handle", "from_comm", "world_rank_and_host"]

#: Reduction operations by name, for the calls on Python values and buffers.
OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "land": MPI.LAND, "lor": MPI.LOR,
       "prod": MPI.PROD, "bor": MPI.BOR}


def _op(op: str | MPI.Op) -> MPI.Op:
    if isinstance(op, MPI.Op):
        return op
    try:
        return OPS[op]
    except KeyError:
        raise ValueError(f"expecting a reduction among {sorted(OPS)}, got {op!r}") from None


#: Requests given up at a timeout (``abort_job`` False). Kept, never freed: MPI
#: forbids freeing an active collective's request, and a late rank may still
#: complete it.
_ABANDONED: list[MPI.Request] = []


def world_rank_and_host() -> str:
    """``world rank R on HOST``: how messages name this process."""
    return f"world rank {MPI.COMM_WORLD.Get_rank()} on {socket.gethostname()}"


class Handle:
    """A pending non-blocking collective; ``wait()`` completes it once.

    A collective on a device buffer staged through host memory starts later
    than it is asked for: its device-to-host copy runs on a CUDA stream of its
    own while the caller goes on (the backward keeps queueing kernels), and the
    MPI call starts once the copy is done (``request`` is None until then; see
    [`FlatComm.progress`][mpishard.comm.FlatComm.progress]).
    """

    __slots__ = ("request", "finish", "what", "comm", "start")

    def __init__(self, comm: FlatComm, request: MPI.Request | None, what: str,
                 finish: Callable[[], None] | None = None,
                 start: tuple[Any, Callable[[], MPI.Request]] | None = None) -> None:
        self.comm = comm
        self.request = request
        self.what = what
        self.finish = finish
        self.start = start    # (copied event, starts the MPI call): deferred

    def test(self) -> bool:
        """Progress the operation; True when it has completed (finish not yet run)."""
        if self.request is None:
            self.comm.progress()
            if self.request is None:
                return False
        try:
            return self.request.Test()
        except MPI.Exception as exc:
            other = self.comm.failure(exc)
            if other is exc:
                raise
            raise other from exc

    def wait(self, *, timed: bool = True) -> None:
        """Block until done, then run the completion step (copy back, accumulate).

        ``timed=False`` waits without the group's timeout: only for a wait whose
        length is set by the data another rank must handle first (say why at the
        call), never for one that only needs the other ranks to arrive.
        """
        if self.request is None:
            self.comm.start_deferred(self)
        assert self.request is not None
        if timed:
            self.comm.wait_request(self.request, self.what)
        else:
            waiting.wait(self.request)
        if self.finish is not None:
            finish, self.finish = self.finish, None
            finish()


class FlatComm:
    """One process group with buffer collectives for flat arrays.

    Args:
        comm: the MPI communicator of the group.
        name: the group's name in error messages ("data-parallel", ...).
        timeout: seconds a collective may take before the job is aborted
            (``None``: wait forever, using MPI's own blocking wait), or the
            [`Deadlines`][mpishard.comm.deadlines.Deadlines] of each kind of wait;
            a call waits under the ``peer`` deadline unless it is made inside
            [`deadline`][mpishard.comm.FlatComm.deadline] (``"data"``, ``"io"``).
        cuda_aware: hand device buffers to MPI directly; ``None`` detects.
    """

    #: What `abort` does (a timeout's end): ``MPI_Abort``, ending every
    #: process of the job (True), or raise `CommunicationError`
    #: on this rank only (False: ``ShardingConfiguration(abort_on_exception=False)``,
    #: for a job whose other ranks, a simulation, must live on). Groups made
    #: from this one (dup, split) inherit it.
    abort_job = True

    def __init__(self, comm: MPI.Comm, name: str, timeout: float | Deadlines | None = None,
                 cuda_aware_mpi: bool | None = None) -> None:
        self.deadlines = Deadlines.build(timeout)
        self._kinds: list[str] = []                      # the kind of wait, innermost last
        self.comm = comm
        self.name = name
        self.size = comm.Get_size()
        self.rank = comm.Get_rank()
        self._cuda_aware = cuda_aware_mpi
        self._staging: dict[Any, np.ndarray] = {}
        # Staged collectives whose MPI call waits for their device-to-host copy,
        # in the order they were asked for; the CUDA stream and events of each slot.
        self._deferred: deque[Handle] = deque()
        self._copies: dict[Any, tuple[Any, Any, Any]] = {}
        self._scalar = np.zeros(1, dtype=np.float64)   # reused by allreduce_scalar
        self._int = np.zeros(1, dtype=np.int64)          # reused by allreduce of ints
        self._length = np.zeros(1, dtype=np.int64)       # reused by bcast
        self._during: list[str] = []                     # what the caller is doing, for messages
        #: At the timeout, SIGKILL the ranks that did not arrive instead of aborting
        #: (ULFM only: `mpishard.comm.ulfm.enable` sets it).
        self.evict_stuck = False
        #: Seconds a wait goes on past the deadline before it gives up (the
        #: messages still name the deadline): see `arrival_spread`.
        self.grace = 0.0

    # --- waiting ---------------------------------------------------------
    @property
    def timeout(self) -> float | None:
        """Seconds the calls made now may wait: the deadline of the current kind
        (``peer`` outside [`deadline`][mpishard.comm.FlatComm.deadline])."""
        return self.deadlines.of(self._kinds[-1] if self._kinds else "peer")

    @property
    def kind(self) -> str:
        """The kind of wait of the calls made now: ``"peer"``, ``"data"`` or ``"io"``."""
        return self._kinds[-1] if self._kinds else "peer"

    @contextmanager
    def deadline(self, kind: str) -> Iterator[FlatComm]:
        """Make the calls inside the ``with`` block wait under the deadline of
        ``kind`` (``"data"``: the slowest rank's data; ``"io"``: file I/O; see
        [`mpishard.comm.deadlines`][mpishard.comm.deadlines]), named so in a timeout message. Local;
        nests."""
        self.deadlines.of(kind)   # a ValueError for an unknown kind
        self._kinds.append(kind)
        try:
            yield self
        finally:
            self._kinds.pop()

    def wait_request(self, request: MPI.Request, what: str) -> None:
        """Wait for ``request``; past the timeout abort the job naming ``what``.
        A failure raises `mpi4py.MPI.Exception` ([`failure`][mpishard.comm.FlatComm.failure])."""
        try:
            self._wait(request, what)
        except MPI.Exception as exc:
            other = self.failure(exc)
            if other is exc:
                raise
            raise other from exc
        except CommunicationError:
            _ABANDONED.append(request)
            raise

    def failure(self, exc: MPI.Exception) -> MPI.Exception:
        """``exc``, or, on a fault-tolerant group
        ([`mpishard.comm.ulfm.enable`][mpishard.comm.ulfm.enable]) that a survivor revoked or where
        a rank failed, ``ERR_REVOKED`` in place of the ``ERR_OTHER`` that Open MPI 5's non-blocking
        collectives (libnbc: "Error in NBC_Start_round") sometimes report then, so that the caller
        recovers instead of ending the job. Local."""
        if not (getattr(self, "fault_tolerant", False) and hasattr(MPI, "ERR_REVOKED")
                and exc.Get_error_class() == MPI.ERR_OTHER):
            return exc
        try:
            broken = self.comm.Is_revoked() or self.comm.Get_failed().Get_size() > 0
        except (MPI.Exception, AttributeError, NotImplementedError):
            return exc
        return MPI.Exception(MPI.ERR_REVOKED) if broken else exc

    @property
    def _polls(self) -> bool:
        # Whether the calls made now wait by testing their request (under a
        # timeout, or napping where ranks outnumber cores: comm/waiting.py)
        # rather than in MPI's blocking call.
        return self.timeout is not None or waiting.naps()

    def _wait(self, request: MPI.Request, what: str) -> None:
        if self.timeout is None:
            waiting.wait(request)
            return
        start = time.monotonic()
        deadline = start + self.timeout + self.grace
        # A wait longer than note_after() is noted in the job directory, so that the
        # ranks that time out can tell who arrived; quick waits write nothing.
        note_at, noted, evicted = start + stuck.note_after(self.timeout), False, False
        nap = 0.0
        try:
            while not request.Test():
                now = time.monotonic()
                if not noted and now > note_at:
                    stuck.note_wait(self.name, self.rank, self.describe(what))
                    noted = True
                if now > deadline:
                    if self.evict_stuck and not evicted:
                        # ULFM: end the ranks that did not arrive; this wait then fails
                        # with ERR_PROC_FAILED and the caller recovers in place.
                        self._evict(what)
                        evicted, deadline = True, now + self.timeout
                        continue
                    self._abort_stuck(what)
                # Yield at first (a quick wait stays quick), then nap, so that
                # waiting ranks leave the cores to the working ones where ranks
                # outnumber cores (comm/waiting.py).
                nap = waiting.next_nap(nap, now - start)
                time.sleep(nap)
        finally:
            if noted:
                stuck.unnote_wait()

    def _members(self) -> list[int]:
        """The ``MPI.COMM_WORLD`` rank of each rank of the group. Local."""
        return list(MPI.Group.Translate_ranks(self.comm.Get_group(), list(range(self.size)),
                                              MPI.COMM_WORLD.Get_group()))

    def _evict(self, what: str) -> None:
        done = stuck.evict(self.name, self._members())
        sys.stderr.write(f"[mpishard] {world_rank_and_host()} (rank {self.rank} of the "
                         f"{self.name} group): {self.describe(what)} did not finish within "
                         f"{self.timeout:g} s ({self.deadlines.explain(self.kind)}); "
                         + ("; ".join(done) or "no rank to evict") + "\n")
        sys.stderr.flush()

    def _abort_stuck(self, what: str) -> None:
        """Abort naming ``what`` and the ranks of the group that did not arrive:
        world rank, pid, host, whether it is stopped, and its Python stack
        (`mpishard.comm.stuck`)."""
        summary, detail = stuck.diagnose(self.name, self._members())
        self.abort(f"{self.describe(what)} did not finish within {self.timeout:g} s "
                   f"({self.deadlines.explain(self.kind)})"
                   + (summary or "; a rank is probably not taking part (it failed, or its "
                                 "code took another path)"), detail=detail)

    def describe(self, what: str) -> str:
        """``what`` named as in a timeout message: "Ibcast over the training
        group (size 4) in save_checkpoint(/runs/c.h5)"."""
        text = f"{what} over the {self.name} group (size {self.size})"
        return f"{text} in {self._during[-1]}" if self._during else text

    @contextmanager
    def during(self, activity: str) -> Iterator[FlatComm]:
        """Name ``activity`` ("save_checkpoint(/runs/c.h5)") in the timeout
        messages of the calls made inside the ``with`` block. Local; nests."""
        self._during.append(activity)
        try:
            yield self
        finally:
            self._during.pop()

    def abort(self, message: str, code: int = 3, detail: str = "") -> None:
        """Print ``message`` naming this rank and abort every rank of the job.

        ``MPI_Abort`` ends every process of the job (all of ``MPI.COMM_WORLD``
        under Open MPI), not only this group. With `abort_job` False it
        raises instead, on this rank only.

        Raises:
            CommunicationError: ``abort_job`` is False; this group is unusable after.
        """
        if not self.abort_job:
            raise CommunicationError(f"{world_rank_and_host()} (rank {self.rank} of the "
                                     f"{self.name} group): {message}; the library's "
                                     f"communicators over these ranks are unusable now"
                                     + (f"\n{detail}" if detail else ""))
        sys.stderr.write(f"[mpishard] {world_rank_and_host()} (rank {self.rank} of the "
                         f"{self.name} group): {message}; aborting the job\n{detail}")
        sys.stderr.flush()
        stuck.note_abort(message)
        MPI.COMM_WORLD.Abort(code)

    def _timed(self, request: MPI.Request, what: str) -> None:
        """Complete ``request`` (under the timeout when one is set)."""
        if self.timeout is None:
            waiting.wait(request)
        else:
            self.wait_request(request, what)

    # --- buffers ---------------------------------------------------------
    def _host(self, buf: Any, slot: Any) -> tuple[Any, Callable[[], None] | None]:
        """The buffer to give MPI, and a copy-back step when it was staged. Starts
        the deferred collectives first: MPI needs every rank's calls in one order."""
        self.flush_deferred()
        xp = array_namespace(buf)
        if xp is np:
            return buf, None
        synchronize(xp)
        if self._device_direct():
            return buf, None
        host = self._staging_buffer(slot, buf.size, buf.dtype, xp).reshape(buf.shape)
        buf.get(out=host)

        def copy_back() -> None:
            buf.set(host)

        return host, copy_back

    # --- staged collectives that start after their copy -------------------------------
    def _deferrable(self, *bufs: Any) -> Any:
        """CuPy when every one of ``bufs`` is a contiguous device array to be staged
        through host memory (MPI not CUDA-aware), else None."""
        xp = array_namespace(*bufs)
        if xp is np or self._device_direct():
            return None
        return xp if all(b.flags.c_contiguous for b in bufs) else None

    def _copy_down(self, buf: Any, slot: Any, xp: Any) -> tuple[np.ndarray, Any]:
        """Start copying device ``buf`` into the pinned staging buffer of ``slot`` on
        the slot's own CUDA stream, after the work queued so far on the current
        stream (an event, not a synchronisation: the caller goes on queueing
        kernels). Returns the host buffer and the event recorded after the copy."""
        host = self._staging_buffer(slot, buf.size, buf.dtype, xp).reshape(buf.shape)
        have = self._copies.get(slot)
        if have is None:
            have = (xp.cuda.Stream(non_blocking=True), xp.cuda.Event(disable_timing=True),
                    xp.cuda.Event(disable_timing=True))
            self._copies[slot] = have
        stream, ready, copied = have
        ready.record(xp.cuda.get_current_stream())
        stream.wait_event(ready)
        buf.data.copy_to_host_async(host.ctypes.data_as(ctypes.c_void_p), buf.nbytes, stream)
        copied.record(stream)
        return host, copied

    @staticmethod
    def _copy_up(buf: Any, host: np.ndarray, xp: Any) -> Callable[[], None]:
        """The step that copies ``host`` back into ``buf`` on the current stream,
        without waiting (later kernels on that stream run after it)."""
        def copy_up() -> None:
            buf.data.copy_from_host_async(host.ctypes.data_as(ctypes.c_void_p), buf.nbytes,
                                          xp.cuda.get_current_stream())

        return copy_up

    def _defer(self, what: str, copied: Any, start: Callable[[], MPI.Request],
               finish: Callable[[], None] | None) -> Handle:
        """A handle whose MPI call ``start()`` runs once event ``copied`` is done."""
        handle = Handle(self, None, what, finish, (copied, start))
        self._deferred.append(handle)
        self.progress()
        return handle

    def progress(self) -> None:
        """Start the deferred collectives whose copies are done, in the order they
        were asked for (every rank starts its collectives in one order); stop at
        the first whose copy is still running. Local; never waits."""
        while self._deferred and self._deferred[0].start[0].done:
            self._start_first(wait=False)

    def start_deferred(self, handle: Handle) -> None:
        """Start ``handle``'s MPI call and every deferred one before it, waiting for
        their copies. Local."""
        while handle.request is None:
            self._start_first()

    def flush_deferred(self) -> None:
        """Start every deferred collective (before any other call of this group)."""
        while self._deferred:
            self._start_first()

    def _start_first(self, wait: bool = True) -> None:
        handle = self._deferred.popleft()
        copied, start = handle.start
        if wait:
            copied.synchronize()      # this slot's copy only, not the device
        handle.start = None
        handle.request = start()

    def _staging_buffer(self, slot: Any, size: int, dtype: Any, xp: Any) -> np.ndarray:
        key = (slot, np.dtype(dtype).str)
        have = self._staging.get(key)
        if have is None or have.size < size:
            # Pinned memory: the device copies are DMA transfers, about twice as
            # fast as from pageable memory. Grow-only, so the step loop reuses it.
            nbytes = size * np.dtype(dtype).itemsize
            mem = xp.cuda.alloc_pinned_memory(nbytes)
            if key in self._staging:
                # An asynchronous copy may still read the old one: wait for the
                # device before it goes back to CuPy's pool (only while growing).
                xp.cuda.Device().synchronize()
            have = np.frombuffer(mem, dtype=dtype, count=size)
            self._staging[key] = have
        return have[:size]

    # --- collectives -----------------------------------------------------
    def Iallreduce(self, buf: Any, slot: Any = "allreduce",
                   finish: Callable[[], None] | None = None, op: str = "sum") -> Handle:
        """Start reducing ``buf`` in place over the group (``op``: sum by default).
        Collective over the group."""
        xp = self._deferrable(buf)
        if xp is not None:
            host, copied = self._copy_down(buf, slot, xp)
            return self._defer("Iallreduce", copied,
                               lambda: self.comm.Iallreduce(MPI.IN_PLACE, host, op=_op(op)),
                               _chain(self._copy_up(buf, host, xp), finish))
        host, copy_back = self._host(buf, slot)
        request = self.comm.Iallreduce(MPI.IN_PLACE, host, op=_op(op))
        return Handle(self, request, "Iallreduce", _chain(copy_back, finish))

    def Allreduce(self, buf: Any, slot: Any = "allreduce", op: str = "sum") -> None:
        """Reduce ``buf`` in place over the group (``op``: sum by default).
        Collective over the group."""
        self.flush_deferred()
        if self._polls or array_namespace(buf) is not np:
            self.Iallreduce(buf, slot, op=op).wait()
        else:
            self.comm.Allreduce(MPI.IN_PLACE, buf, op=_op(op))

    def Ireduce_scatter(self, sendbuf: Any, recvbuf: Any, counts: list[int],
                        slot: Any = "reduce_scatter",
                        finish: Callable[[], None] | None = None) -> Handle:
        """Start summing ``sendbuf`` over the group, rank ``i`` keeping the ``i``-th
        piece of ``counts[i]`` elements in ``recvbuf``. Collective over the group."""
        xp = self._deferrable(sendbuf, recvbuf)
        if xp is not None:
            send, copied = self._copy_down(sendbuf, (slot, "send"), xp)
            # The receive buffer is output only: staged, never copied down.
            recv = self._staging_buffer((slot, "recv"), recvbuf.size, recvbuf.dtype, xp)
            recv = recv.reshape(recvbuf.shape)
            return self._defer("Ireduce_scatter", copied,
                               lambda: self.comm.Ireduce_scatter(send, recv, counts, op=MPI.SUM),
                               _chain(self._copy_up(recvbuf, recv, xp), finish))
        send, _ = self._host(sendbuf, (slot, "send"))
        recv, copy_back = self._host(recvbuf, (slot, "recv"))
        request = self.comm.Ireduce_scatter(send, recv, counts, op=MPI.SUM)
        return Handle(self, request, "Ireduce_scatter", _chain(copy_back, finish))

    def Reduce_scatter(self, sendbuf: Any, recvbuf: Any, counts: list[int],
                       slot: Any = "reduce_scatter") -> None:
        """Blocking [`Ireduce_scatter`][mpishard.comm.FlatComm.Ireduce_scatter]. Collective over the
        group."""
        self.flush_deferred()
        if self._polls or array_namespace(sendbuf) is not np:
            self.Ireduce_scatter(sendbuf, recvbuf, counts, slot).wait()
        else:
            self.comm.Reduce_scatter(sendbuf, recvbuf, counts, op=MPI.SUM)

    def Iallgatherv(self, buf: Any, counts: Sequence[int], slot: Any = "allgather",
                    finish: Callable[[], None] | None = None) -> Handle:
        """Start the in-place [`Allgatherv`][mpishard.comm.FlatComm.Allgatherv] of ``buf`` (each
        rank's piece already sits in ``buf``). Collective over the group."""
        spec = ([int(c) for c in counts], _displacements(counts))
        xp = self._deferrable(buf)
        if xp is not None:
            host, copied = self._copy_down(buf, slot, xp)
            return self._defer("Iallgatherv", copied,
                               lambda: self.comm.Iallgatherv(MPI.IN_PLACE, [host, spec]),
                               _chain(self._copy_up(buf, host, xp), finish))
        host, copy_back = self._host(buf, slot)
        request = self.comm.Iallgatherv(MPI.IN_PLACE, [host, spec])
        return Handle(self, request, "Iallgatherv", _chain(copy_back, finish))

    def Allgatherv(self, buf: Any, counts: Sequence[int], slot: Any = "allgather",
                   sendbuf: Any = None) -> None:
        """Gather into ``buf``: rank ``i`` contributes ``counts[i]`` elements, placed
        at ``sum(counts[:i])``, and every rank receives everyone's. In place (each
        rank's piece already sits in ``buf``) unless ``sendbuf`` is given.
        Collective over the group."""
        host, copy_back = self._host(buf, slot)
        spec = [host, (list(counts), _displacements(counts))]
        send = MPI.IN_PLACE
        if sendbuf is not None:
            send, _ = self._host(sendbuf, (slot, "send"))
        if self._polls:
            self.wait_request(self.comm.Iallgatherv(send, spec), "Iallgatherv")
        else:
            self.comm.Allgatherv(send, spec)
        if copy_back is not None:
            copy_back()

    def Alltoallv(self, sendbuf: Any, sendcounts: Sequence[int], recvbuf: Any,
                  recvcounts: Sequence[int], slot: Any = "alltoall",
                  senddispls: Sequence[int] | None = None,
                  recvdispls: Sequence[int] | None = None) -> None:
        """Rank ``i`` sends the ``j``-th piece of ``sendbuf`` (``sendcounts[j]``
        elements; pieces in rank order) to rank ``j``, and receives ``recvcounts[j]``
        elements from each rank ``j`` into ``recvbuf``, placed in rank order.
        ``senddispls`` / ``recvdispls`` place the pieces elsewhere (sent pieces may
        overlap). Collective over the group."""
        send, _ = self._host(sendbuf, (slot, "send"))
        recv, copy_back = self._host(recvbuf, (slot, "recv"))
        sd = _displacements(sendcounts) if senddispls is None else [int(d) for d in senddispls]
        rd = _displacements(recvcounts) if recvdispls is None else [int(d) for d in recvdispls]
        sspec = [send, ([int(c) for c in sendcounts], sd)]
        rspec = [recv, ([int(c) for c in recvcounts], rd)]
        if self._polls:
            self.wait_request(self.comm.Ialltoallv(sspec, rspec), "Ialltoallv")
        else:
            self.comm.Alltoallv(sspec, rspec)
        if copy_back is not None:
            copy_back()

    def Bcast(self, buf: Any, root: int = 0, slot: Any = "bcast") -> None:
        """Broadcast ``buf`` from ``root``. Collective over the group."""
        host, copy_back = self._host(buf, slot)
        if self._polls:
            self.wait_request(self.comm.Ibcast(host, root=root), "Ibcast")
        else:
            self.comm.Bcast(host, root=root)
        if copy_back is not None:
            copy_back()

    def Isend(self, buf: Any, dest: int, tag: int, slot: Any = "send") -> Handle:
        """Start sending ``buf`` to ``dest``; ``buf`` must stay unchanged until done."""
        host, _ = self._host(buf, slot)
        return Handle(self, self.comm.Isend(host, dest=dest, tag=tag), f"Isend to rank {dest}")

    def Irecv(self, buf: Any, source: int, tag: int) -> Handle:
        """Start receiving into host (NumPy) buffer ``buf`` from ``source``."""
        self.flush_deferred()
        return Handle(self, self.comm.Irecv(buf, source=source, tag=tag),
                      f"Irecv from rank {source}")

    def Recv(self, buf: Any, source: int, tag: int, slot: Any = "recv") -> None:
        """Receive into ``buf`` from ``source`` (waits, with the group's timeout)."""
        self.flush_deferred()
        xp = array_namespace(buf)
        if xp is np or self._device_direct():
            self.wait_request(self.comm.Irecv(buf, source=source, tag=tag),
                              f"Irecv from rank {source}")
            return
        host = self._staging_buffer(slot, buf.size, buf.dtype, xp)
        self.wait_request(self.comm.Irecv(host, source=source, tag=tag),
                          f"Irecv from rank {source}")
        buf.set(host.reshape(buf.shape))

    def _device_direct(self) -> bool:
        if self._cuda_aware is None:
            self._cuda_aware = cuda_aware()
        return self._cuda_aware

    def allreduce_scalar(self, value: float, op: str | MPI.Op = "sum") -> float:
        """Reduce one Python float over the group. Collective over the group."""
        self.flush_deferred()
        if self.size == 1:
            return float(value)
        buf = self._scalar
        buf[0] = value
        self._timed(self.comm.Iallreduce(MPI.IN_PLACE, buf, op=_op(op)), "Iallreduce")
        return float(buf[0])

    def allreduce(self, value: bool | int | float, op: str = "sum") -> Any:
        """Reduce one Python bool, int or float over the group; returns the same
        type. ``op``: "sum", "max", "min", "land", "lor", "prod". Collective over
        the group."""
        self.flush_deferred()
        if isinstance(value, (bool, np.bool_)):
            if op not in ("land", "lor", "max", "min"):
                raise ValueError(f"a bool reduces with land, lor, max or min, not {op!r}")
            if self.size == 1:
                return bool(value)
            self._int[0] = int(bool(value))
            o = {"land": "min", "lor": "max"}.get(op, op)
            self._timed(self.comm.Iallreduce(MPI.IN_PLACE, self._int, op=_op(o)), "Iallreduce")
            return bool(self._int[0])
        if isinstance(value, (int, np.integer)):
            if self.size == 1:
                return int(value)
            self._int[0] = value
            self._timed(self.comm.Iallreduce(MPI.IN_PLACE, self._int, op=_op(op)), "Iallreduce")
            return int(self._int[0])
        return self.allreduce_scalar(float(value), op)

    def bcast(self, obj: Any, root: int = 0) -> Any:
        """``obj`` of rank ``root`` on every rank (a small picklable object).
        Collective over the group."""
        self.flush_deferred()
        if self.size == 1:
            return obj
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if self.rank == root else b""
        self._length[0] = len(data)
        self._timed(self.comm.Ibcast(self._length, root=root), "Ibcast")
        buf = bytearray(int(self._length[0])) if self.rank != root else bytearray(data)
        self._timed(self.comm.Ibcast([buf, MPI.BYTE], root=root), "Ibcast")
        return obj if self.rank == root else pickle.loads(buf)

    def allgather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank. Collective over the group."""
        self.flush_deferred()
        if self.size == 1:
            return [obj]
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        lengths = np.zeros(self.size, dtype=np.int64)
        lengths[self.rank] = len(data)
        self._timed(self.comm.Iallgather(MPI.IN_PLACE, lengths), "Iallgather")
        displs = np.concatenate(([0], np.cumsum(lengths[:-1]))).astype(int)
        out = bytearray(int(lengths.sum()))
        spec = [out, (lengths.astype(int).tolist(), displs.tolist()), MPI.BYTE]
        self._timed(self.comm.Iallgatherv([data, MPI.BYTE], spec), "Iallgatherv")
        return [pickle.loads(out[d:d + n]) for d, n in zip(displs, lengths)]

    def gather(self, obj: Any, root: int = 0) -> list[Any] | None:
        """Every rank's ``obj`` in rank order on ``root``; None elsewhere.
        Collective over the group."""
        self.flush_deferred()
        if self.size == 1:
            return [obj]
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        lengths = np.zeros(self.size, dtype=np.int64)
        mine = np.array([len(data)], dtype=np.int64)
        self._timed(self.comm.Igather(mine, lengths, root=root), "Igather")
        if self.rank != root:
            self._timed(self.comm.Igatherv([data, MPI.BYTE], None, root=root), "Igatherv")
            return None
        displs = np.concatenate(([0], np.cumsum(lengths[:-1]))).astype(int)
        out = bytearray(int(lengths.sum()))
        spec = [out, (lengths.astype(int).tolist(), displs.tolist()), MPI.BYTE]
        self._timed(self.comm.Igatherv([data, MPI.BYTE], spec, root=root), "Igatherv")
        return [pickle.loads(out[d:d + n]) for d, n in zip(displs, lengths)]

    def agree(self, problem: str | None, exc_type: type[Exception] = MpiShardError) -> None:
        """Raise ``exc_type`` on every rank if any rank has a ``problem``.

        A check whose outcome can differ between ranks must not raise on only
        some of them: the others would wait forever in the next collective.
        Each rank passes its own finding (None when all is well); the lowest
        failing rank's message is raised everywhere, prefixed with that rank
        (its rank in this group, and its world rank where they differ).
        Collective over the group.
        """
        if self.size == 1:
            if problem is not None:
                raise exc_type(problem)
            return
        found = self.first_finding(problem)
        if found is None:
            return
        first, world, text = found
        where = f"rank {first}" if world == first else f"rank {first} (world rank {world})"
        raise exc_type(f"{where}: {text}")

    def first_finding(self, finding: Any) -> tuple[int, int, Any] | None:
        """The lowest rank with a ``finding`` (not None): ``(rank in the group,
        world rank, its finding)`` on every rank, or None where no rank has one.
        The agreement under [`agree`][mpishard.comm.FlatComm.agree], for callers that raise in their
        own way. Collective over the group: one integer Allreduce, and a broadcast
        only when some rank found something."""
        first = self.allreduce(self.rank if finding is not None else self.size, op="min")
        if first == self.size:
            return None
        world, found = self.bcast((MPI.COMM_WORLD.Get_rank(), finding), root=first)
        return first, world, found

    def arrival_spread(self) -> float:
        """Seconds from the first rank's call of this to the last one's, by the
        ranks' clocks (``time.time()``): one Iallreduce of two floats, the same
        result on every rank. Collective over the group.

        It lets ranks agree on a timeout without a second collective: a rank
        that gives up waiting here (past ``timeout + grace``) leaves its request
        to the last rank, whose call then completes at once and returns more
        than ``timeout``, so that every rank, the late ones too, knows the wait
        failed. With ``grace`` above the clocks' skew, the ranks whose call
        completed decide alike from the same number.
        """
        self.flush_deferred()
        now = time.time()
        buf = np.array([now, -now])
        if self.size > 1:
            self._timed(self.comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.MAX), "Iallreduce")
        return float(buf[0] + buf[1])

    def barrier(self, before: str | None = None) -> None:
        """Wait for every rank of the group. Collective over the group.

        ``before`` names what comes next in a timeout message ("Ibarrier before
        HDF5 File create"): a barrier is how a call that cannot be timed (an
        HDF5 collective) is entered only once every rank has arrived.
        """
        self.flush_deferred()
        if self.size > 1:
            self._timed(self.comm.Ibarrier(), f"Ibarrier before {before}" if before else "Ibarrier")

    # --- communicators ---------------------------------------------------
    def dup(self, name: str | None = None, *, context: bool = True) -> FlatComm:
        """A duplicate of the group (its own message space), with the activities
        named by [`during`][mpishard.comm.FlatComm.during] and the kind of wait of
        [`deadline`][mpishard.comm.FlatComm.deadline] unless ``context`` is False. Collective over
        the group."""
        self.flush_deferred()
        if self.timeout is not None and hasattr(self.comm, "Idup"):
            comm, request = self.comm.Idup()
            self.wait_request(request, "Idup")
        else:
            comm = self.comm.Dup()
        copy = FlatComm(comm, name or self.name, self.deadlines, self._cuda_aware)
        if context:
            copy._during = list(self._during)
            copy._kinds = list(self._kinds)
        copy.abort_job = self.abort_job
        return copy

    def split(self, color: int, key: int, name: str) -> FlatComm:
        """The sub-group of the ranks with the same ``color``, ordered by ``key``.
        Collective over the group (``Comm_split`` has no non-blocking form, so it
        is not under the timeout; the collective before it in the library is)."""
        self.flush_deferred()
        child = FlatComm(self.comm.Split(color=color, key=key), name, self.deadlines,
                         self._cuda_aware)
        child.abort_job = self.abort_job
        return child

    def split_shared(self, name: str = "node") -> FlatComm:
        """The ranks of this group that share this rank's node (shared memory).
        Collective over the group."""
        self.flush_deferred()
        child = FlatComm(self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank), name,
                         self.deadlines, self._cuda_aware)
        child.abort_job = self.abort_job
        return child

    def is_world(self) -> bool:
        """The group's communicator is ``MPI.COMM_WORLD`` itself. Local."""
        return MPI.Comm.Compare(self.comm, MPI.COMM_WORLD) == MPI.IDENT

    def world_ranks(self) -> list[int]:
        """The ``MPI.COMM_WORLD`` rank of each rank of the group, in group order. Local."""
        return self._members()

    def free(self) -> None:
        """Free the communicator (not ``MPI.COMM_WORLD``/``COMM_SELF``). Collective."""
        self.flush_deferred()
        if self.comm not in (MPI.COMM_NULL, MPI.COMM_WORLD, MPI.COMM_SELF):
            self.comm.Free()
        self.comm = MPI.COMM_NULL

    def __repr__(self) -> str:
        return f"FlatComm({self.name!r}, rank {self.rank} of {self.size})"


def from_comm(comm: Any, name: str, timeout: float | Deadlines | None = None) -> FlatComm:
    """``comm`` itself when it already is a [`FlatComm`][mpishard.comm.FlatComm], else one around it
    (for code that takes a user's ``mpi4py`` communicator)."""
    if isinstance(comm, FlatComm):
        return comm
    if comm is None:
        comm = MPI.COMM_WORLD
    if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
        raise TypeError(f"expecting an MPI intra-communicator, got {comm!r}")
    return FlatComm(comm, name, timeout)


def _chain(*steps: Callable[[], None] | None) -> Callable[[], None] | None:
    todo = [s for s in steps if s is not None]
    if not todo:
        return None
    if len(todo) == 1:
        return todo[0]

    def run() -> None:
        for step in todo:
            step()

    return run


def _displacements(counts: Sequence[int]) -> list[int]:
    """Where each rank's piece starts: the running sum of ``counts`` before it."""
    return np.concatenate(([0], np.cumsum(counts[:-1]))).astype(int).tolist()
