"""Give each MPI rank its share of the cores before NumPy's BLAS starts threads.

Without this, every rank's OpenBLAS/MKL starts one thread per core of the node:
4 ranks on 2 cores run 8 busy threads and a training step gets ~40x slower
(measured on this project's 2-core test machine). Applied at import, only when
the user has set none of the variables, and only effective if NumPy was not
imported before mpishard.
"""

from __future__ import annotations

import os

__all__ = ["THREAD_VARIABLES", "default_threads", "limit_threads"]

THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")

# Launchers' names for "ranks on this node".
_LOCAL_SIZE = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "MV2_COMM_WORLD_LOCAL_SIZE",
               "SLURM_NTASKS_PER_NODE", "PMI_LOCAL_SIZE")


def default_threads() -> int | None:
    """Threads per rank: the cores this process may use, shared among the local ranks.

    A rank the launcher bound to some cores gets all of those; an unbound rank
    gets ``cores // ranks on the node`` (at least 1). None when not under MPI.
    """
    local = None
    for var in _LOCAL_SIZE:
        value = os.environ.get(var, "").split("(")[0]
        if value.isdigit() and int(value) > 0:
            local = int(value)
            break
    if local is None:
        return None
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    total = os.cpu_count() or allowed or 1
    if allowed and allowed < total:
        return allowed
    return max(1, total // local)


def limit_threads() -> None:
    """Set the thread variables to `default_threads` unless the user set any."""
    if (any(var in os.environ for var in THREAD_VARIABLES)
            or os.environ.get("MPISHARD_THREADS") == "keep"):
        return
    threads = default_threads()
    if threads is not None:
        for var in THREAD_VARIABLES:
            os.environ[var] = str(threads)
