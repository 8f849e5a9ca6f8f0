"""Is the MPI library CUDA-aware? Detected once, overridable by the user."""

from __future__ import annotations

import ctypes
import functools
import os

__all__ = ["cuda_aware", "cuda_aware_reason"]

# Environment variables by which other MPI libraries say GPU buffers are enabled.
_VENDOR_FLAGS = {
    "MPICH_GPU_SUPPORT_ENABLED": "Cray MPICH",
    "MPIR_CVAR_ENABLE_GPU": "MPICH",
    "MV2_USE_CUDA": "MVAPICH2",
}


@functools.lru_cache(maxsize=1)
def cuda_aware_reason() -> tuple[bool, str]:
    """(aware, why): whether device buffers may be handed to MPI directly.

    ``MPISHARD_CUDA_AWARE=0`` or ``=1`` forces the answer. Otherwise Open MPI is
    asked through its extension ``MPIX_Query_cuda_support()`` (the library was
    built with CUDA *and* the runtime supports it), and other libraries through
    the environment variables that enable their GPU support.
    """
    forced = os.environ.get("MPISHARD_CUDA_AWARE")
    if forced in ("0", "1"):
        return forced == "1", f"forced by MPISHARD_CUDA_AWARE={forced}"
    from mpi4py import MPI

    version = MPI.Get_library_version()
    if "Open MPI" in version:
        query = _find_symbol("MPIX_Query_cuda_support")
        if query is None:
            return False, "Open MPI without the CUDA extension"
        query.restype = ctypes.c_int
        aware = bool(query())
        return aware, f"MPIX_Query_cuda_support() returned {int(aware)}"
    for var, vendor in _VENDOR_FLAGS.items():
        if os.environ.get(var, "0") not in ("", "0"):
            return True, f"{vendor}: {var}={os.environ[var]}"
    return False, "no sign of CUDA support in the MPI library"


def cuda_aware() -> bool:
    """True when device buffers may be handed to MPI without host staging."""
    return cuda_aware_reason()[0]


def _find_symbol(name: str):
    # mpi4py loads libmpi; look for the symbol in the process, then in the
    # libraries mapped into it whose name says MPI.
    try:
        return getattr(ctypes.CDLL(None), name)
    except AttributeError:
        pass
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libmpi" in line and ".so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return getattr(ctypes.CDLL(path), name)
        except (OSError, AttributeError):
            continue
    return None
