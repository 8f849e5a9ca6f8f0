"""What the MPI library says about itself, and what a reproducible run's bits
depend on, for ``mpishard info``."""

from __future__ import annotations

import importlib.metadata
import os
import platform

import mpi4py
from mpi4py import MPI

__all__ = ["mpi_library_info", "reproducibility_info", "reproducibility_line", "world_rank"]

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


# numpy's dispatch targets that change the bits of a float64 or float32 function
# (float64 exp and log run numpy's own AVX-512F code where the processor has it,
# the C library's elsewhere); X86_V3 and X86_V4 are NumPy 2.4's names for the
# AVX2 and AVX-512 levels.
_SIMD_FEATURES = ("FMA3", "AVX2", "AVX512F", "AVX512_SKX", "X86_V3", "X86_V4")


def _blas() -> dict[str, object]:
    """NumPy's BLAS as threadpoolctl reads it from the loaded library: its name,
    version, the core type whose kernels it runs, and its threads."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return {"blas": "unknown (threadpoolctl is not installed)"}
    found = [p for p in threadpool_info() if p.get("user_api") == "blas"]
    if not found:
        return {"blas": "unknown (no BLAS loaded)"}
    lib = found[0]
    return {
        "blas": f"{lib.get('internal_api')} {lib.get('version')}",
        "blas_core": lib.get("architecture") or "unknown",
        "blas_threads": lib.get("num_threads"),
        "OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE", "unset"),
    }


def _numpy_simd() -> dict[str, str]:
    """The SIMD features NumPy found, and the target its float64 ``exp`` runs."""
    try:
        from numpy._core._multiarray_umath import __cpu_features__ as features
    except ImportError:   # NumPy 1.x
        from numpy.core._multiarray_umath import __cpu_features__ as features
    on = " ".join(name for name in _SIMD_FEATURES if features.get(name)) or "baseline"
    try:
        from numpy.lib.introspect import opt_func_info
        target = opt_func_info(func_name="^exp$", signature="float64")["exp"]["dd"]["current"]
    except (ImportError, KeyError):   # NumPy before 2.0
        target = "unknown"
    return {"numpy_simd": on, "numpy_exp_log": target}


def _numba_target() -> str:
    try:
        version = importlib.metadata.version("numba")
        from llvmlite import binding
    except (ImportError, importlib.metadata.PackageNotFoundError):
        return "not installed"
    cpu = os.environ.get("NUMBA_CPU_NAME") or binding.get_host_cpu_name()
    return f"{version} for {cpu}"


def reproducibility_info() -> dict[str, object]:
    """What the bits of a reproducible run depend on besides the library's own
    version: NumPy's BLAS (library, version, the core type whose kernels it
    runs, its threads, ``OPENBLAS_CORETYPE``), NumPy's version, the SIMD
    features it found and the target its float64 ``exp`` and ``log`` run
    (NumPy's own AVX-512 code or the C library's, ``libm``), and Numba's version and
    target (which change no bit: its sums are integer arithmetic). Local: no
    communication."""
    import numpy

    libc, version = platform.libc_ver()
    return {**_blas(), "numpy": numpy.__version__, **_numpy_simd(),
            "libm": f"{libc} {version}".strip() or "unknown", "numba": _numba_target()}


def reproducibility_line(info: dict[str, object] | None = None) -> str:
    """[`reproducibility_info`][mpishard.comm.reproducibility_info] on one
    line, to print with a hash. Local."""
    info = reproducibility_info() if info is None else info
    blas = info["blas"]
    if "blas_core" in info:
        blas = (f"{blas} core {info['blas_core']} threads {info['blas_threads']} "
                f"(OPENBLAS_CORETYPE {info['OPENBLAS_CORETYPE']})")
    return (f"BLAS {blas}; numpy {info['numpy']} (float64 exp/log "
            f"{info['numpy_exp_log']}, {info['libm']}); numba {info['numba']}")
