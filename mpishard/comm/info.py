"""What the MPI library says about itself, for ``mpishard info``."""

from __future__ import annotations

import mpi4py
from mpi4py import MPI

__all__ = ["mpi_library_info", "world_rank"]

_THREAD_LEVELS = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
                  MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}


def mpi_library_info() -> dict[str, object]:
    """The MPI library (first line of its version string), the MPI standard it
    implements, mpi4py's version, the world size and the thread level MPI was
    initialised with. Local: no communication."""
    return {
        "mpi_library": MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0],
        "mpi_standard": "{}.{}".format(*MPI.Get_version()),
        "mpi4py": mpi4py.__version__,
        "world_size": MPI.COMM_WORLD.Get_size(),
        "mpi_thread_level": _THREAD_LEVELS.get(MPI.Query_thread(), str(MPI.Query_thread())),
    }


def world_rank() -> int:
    """This process's rank in ``MPI.COMM_WORLD``."""
    return MPI.COMM_WORLD.Get_rank()
