"""A deadline for a collective the library cannot time itself (HDF5's).

HDF5's collectives (``File`` create and close under the ``mpio`` driver, which
duplicate the communicator and open the file with MPI-IO) block inside C code
while holding the GIL: h5py releases it around dataset reads and writes, not
there. A ``threading.Timer`` cannot fire then (measured: armed for 2 s around an
``mpio`` create that one rank entered 6 s late, it fired at 6.0 s, when the call
returned). So the library never *enters* such a call before every rank has:
[`FlatComm.barrier`][mpishard.comm.FlatComm.barrier] under the timeout goes
first and names a late rank. What is left (a rank that stops inside the call, a
file system that does not answer) is caught by [`hdf5_deadline`][mpishard.comm.hdf5_deadline], which
arms the standard library's ``faulthandler``: its timer is a C thread that needs no
GIL; past the deadline it prints ``Timeout (h:mm:ss)!`` and every thread's Python
stack (the stack names the HDF5 call), and exits the process with status 1,
whereupon ``mpirun``/``srun`` end the job. It makes no MPI call from another
thread, so it holds at any thread level MPI was initialised with (mpi4py asks for
``MPI_THREAD_MULTIPLE``, which Open MPI 4.1 here grants, but a caller may have set
``mpi4py.rc.thread_level``).
"""

from __future__ import annotations

import faulthandler
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from .communicator import FlatComm

__all__ = ["hdf5_deadline"]


@contextmanager
def hdf5_deadline(comm: FlatComm, what: str, *, synchronize: bool = True) -> Iterator[None]:
    """Enter the HDF5 collective ``what`` over ``comm`` ("HDF5 File create") once
    every rank has arrived, and end the process if it is not done within the
    file-I/O deadline (``comm.deadlines.io``: ``io_timeout=``). Collective over
    ``comm``. Without that deadline it does nothing at all.

    ``synchronize=False`` skips the barrier, where the call just before was a
    collective that completes only once every rank has arrived (an Allreduce).

    ``faulthandler`` has one such timer per process: this cancels one that the
    caller armed with ``faulthandler.dump_traceback_later``.
    """
    with comm.deadline("io"):
        seconds = comm.timeout
        if seconds is None:
            yield
            return
        if synchronize:
            comm.barrier(before=what)
        faulthandler.dump_traceback_later(seconds, exit=True, file=_stderr_fd())
        try:
            yield
        finally:
            faulthandler.cancel_dump_traceback_later()


def _stderr_fd() -> int:
    """``sys.stderr``'s file descriptor; 2 where it has none (a notebook's stream,
    pytest's ``capsys``): faulthandler writes to a descriptor, from C."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):   # io.UnsupportedOperation is an OSError
        return 2
