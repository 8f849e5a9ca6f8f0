"""Collectives on flat NumPy or CuPy buffers, with host staging and timeouts.

``FlatComm`` wraps one MPI communicator (a process group) and knows its name, so a
collective that does not finish within the timeout aborts the job with a message
that names the collective and the group. Device (CuPy) buffers go to MPI directly
when the library is CUDA-aware; otherwise they are copied through reusable host
buffers, one per *slot*, so concurrent non-blocking operations never share one.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from ..backend import array_namespace, synchronize
from .cuda import cuda_aware

__all__ = ["FlatComm", "Handle"]


class Handle:
    """A pending non-blocking collective; ``wait()`` completes it once."""

    __slots__ = ("request", "finish", "what", "comm")

    def __init__(self, comm: FlatComm, request: MPI.Request, what: str,
                 finish: Callable[[], None] | None = None) -> None:
        self.comm = comm
        self.request = request
        self.what = what
        self.finish = finish

    def test(self) -> bool:
        """Progress the operation; True when it has completed (finish not yet run)."""
        return self.request.Test()

    def wait(self) -> None:
        """Block until done, then run the completion step (copy back, accumulate)."""
        self.comm.wait_request(self.request, self.what)
        if self.finish is not None:
            finish, self.finish = self.finish, None
            finish()


class FlatComm:
    """One process group with buffer collectives for flat arrays.

    Args:
        comm: the MPI communicator of the group.
        name: the group's name in error messages ("data-parallel", ...).
        timeout: seconds a collective may take before the job is aborted
            (``None``: wait forever, using MPI's own blocking wait).
        cuda_aware: hand device buffers to MPI directly; ``None`` detects.
    """

    def __init__(self, comm: MPI.Comm, name: str, timeout: float | None = None,
                 cuda_aware_mpi: bool | None = None) -> None:
        self.comm = comm
        self.name = name
        self.timeout = timeout
        self.size = comm.Get_size()
        self.rank = comm.Get_rank()
        self._cuda_aware = cuda_aware_mpi
        self._staging: dict[Any, np.ndarray] = {}
        self._scalar = np.zeros(1, dtype=np.float64)   # reused by allreduce_scalar

    # --- waiting ---------------------------------------------------------
    def wait_request(self, request: MPI.Request, what: str) -> None:
        """Wait for ``request``; past the timeout abort the job naming ``what``."""
        if self.timeout is None:
            request.Wait()
            return
        deadline = time.monotonic() + self.timeout
        while not request.Test():
            if time.monotonic() > deadline:
                self.abort(f"{what} over the {self.name} group (size {self.size}) did not "
                           f"finish within {self.timeout:g} s; a rank is probably not taking "
                           f"part (it failed, or its code took another path)")
            time.sleep(0)

    def abort(self, message: str) -> None:
        """Print ``message`` with this rank and abort every rank of the job."""
        rank = MPI.COMM_WORLD.Get_rank()
        sys.stderr.write(f"[mpishard] rank {rank}: {message}; aborting the job\n")
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(3)

    # --- buffers ---------------------------------------------------------
    def _host(self, buf: Any, slot: Any) -> tuple[Any, Callable[[], None] | None]:
        """The buffer to give MPI, and a copy-back step when it was staged."""
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

    def _staging_buffer(self, slot: Any, size: int, dtype: Any, xp: Any) -> np.ndarray:
        key = (slot, np.dtype(dtype).str)
        have = self._staging.get(key)
        if have is None or have.size < size:
            # Pinned memory: the device copies are DMA transfers, about twice as
            # fast as from pageable memory. Grow-only, so the step loop reuses it.
            nbytes = size * np.dtype(dtype).itemsize
            mem = xp.cuda.alloc_pinned_memory(nbytes)
            have = np.frombuffer(mem, dtype=dtype, count=size)
            self._staging[key] = have
        return have[:size]

    # --- collectives -----------------------------------------------------
    def Iallreduce(self, buf: Any, slot: Any = "allreduce",
                   finish: Callable[[], None] | None = None) -> Handle:
        """Start summing ``buf`` in place over the group. Collective over the group."""
        host, copy_back = self._host(buf, slot)
        request = self.comm.Iallreduce(MPI.IN_PLACE, host, op=MPI.SUM)
        return Handle(self, request, "Iallreduce", _chain(copy_back, finish))

    def Allreduce(self, buf: Any, slot: Any = "allreduce") -> None:
        """Sum ``buf`` in place over the group. Collective over the group."""
        if self.timeout is not None or array_namespace(buf) is not np:
            self.Iallreduce(buf, slot).wait()
        else:
            self.comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)

    def Ireduce_scatter(self, sendbuf: Any, recvbuf: Any, counts: list[int],
                        slot: Any = "reduce_scatter",
                        finish: Callable[[], None] | None = None) -> Handle:
        """Start summing ``sendbuf`` over the group, rank ``i`` keeping the ``i``-th
        piece of ``counts[i]`` elements in ``recvbuf``. Collective over the group."""
        send, _ = self._host(sendbuf, (slot, "send"))
        recv, copy_back = self._host(recvbuf, (slot, "recv"))
        request = self.comm.Ireduce_scatter(send, recv, counts, op=MPI.SUM)
        return Handle(self, request, "Ireduce_scatter", _chain(copy_back, finish))

    def Reduce_scatter(self, sendbuf: Any, recvbuf: Any, counts: list[int],
                       slot: Any = "reduce_scatter") -> None:
        """Blocking :meth:`Ireduce_scatter`. Collective over the group."""
        if self.timeout is not None or array_namespace(sendbuf) is not np:
            self.Ireduce_scatter(sendbuf, recvbuf, counts, slot).wait()
        else:
            self.comm.Reduce_scatter(sendbuf, recvbuf, counts, op=MPI.SUM)

    def Allgatherv(self, buf: Any, counts: list[int], slot: Any = "allgather") -> None:
        """Gather in place: rank ``i`` contributes its piece of ``buf`` (``counts[i]``
        elements at ``sum(counts[:i])``) and receives everyone's. Collective over
        the group."""
        host, copy_back = self._host(buf, slot)
        displs = np.concatenate(([0], np.cumsum(counts[:-1]))).astype(int).tolist()
        spec = [host, (list(counts), displs)]
        if self.timeout is not None:
            self.wait_request(self.comm.Iallgatherv(MPI.IN_PLACE, spec), "Iallgatherv")
        else:
            self.comm.Allgatherv(MPI.IN_PLACE, spec)
        if copy_back is not None:
            copy_back()

    def Bcast(self, buf: Any, root: int = 0, slot: Any = "bcast") -> None:
        """Broadcast ``buf`` from ``root``. Collective over the group."""
        host, copy_back = self._host(buf, slot)
        if self.timeout is not None:
            self.wait_request(self.comm.Ibcast(host, root=root), "Ibcast")
        else:
            self.comm.Bcast(host, root=root)
        if copy_back is not None:
            copy_back()

    def Isend(self, buf: Any, dest: int, tag: int, slot: Any = "send") -> Handle:
        """Start sending ``buf`` to ``dest``; ``buf`` must stay unchanged until done."""
        host, _ = self._host(buf, slot)
        return Handle(self, self.comm.Isend(host, dest=dest, tag=tag), f"Isend to rank {dest}")

    def Recv(self, buf: Any, source: int, tag: int, slot: Any = "recv") -> None:
        """Receive into ``buf`` from ``source`` (waits, with the group's timeout)."""
        xp = array_namespace(buf)
        if xp is np or self._device_direct():
            self.wait_request(self.comm.Irecv(buf, source=source, tag=tag),
                              f"Irecv from rank {source}")
            return
        host = self._staging_buffer(slot, buf.size, buf.dtype, xp)
        self.wait_request(self.comm.Irecv(host, source=source, tag=tag), f"Irecv from rank {source}")
        buf.set(host.reshape(buf.shape))

    def _device_direct(self) -> bool:
        if self._cuda_aware is None:
            self._cuda_aware = cuda_aware()
        return self._cuda_aware

    def allreduce_scalar(self, value: float, op: MPI.Op = MPI.SUM) -> float:
        """Reduce one Python float over the group. Collective over the group."""
        if self.size == 1:
            return value
        buf = self._scalar
        buf[0] = value
        if self.timeout is not None:
            self.wait_request(self.comm.Iallreduce(MPI.IN_PLACE, buf, op=op), "Iallreduce")
        else:
            self.comm.Allreduce(MPI.IN_PLACE, buf, op=op)
        return float(buf[0])

    def barrier(self) -> None:
        """Wait for every rank of the group. Collective over the group."""
        if self.timeout is not None:
            self.wait_request(self.comm.Ibarrier(), "Ibarrier")
        else:
            self.comm.Barrier()


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
