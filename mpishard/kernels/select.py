"""Which implementation of a kernel runs: the NumPy twin or a fused one.

``MPISHARD_KERNELS`` (read once per process) says it for every kernel:

* ``auto`` (the default): fused where a fused version exists for the array's
  library (Numba on the CPU when it imports, for arrays of at least
  `FUSED_MIN_ELEMENTS`; the CuPy kernels on a GPU unless
  ``MPISHARD_GPU_KERNELS=0``, see below), else the NumPy twin;
* ``reference``: always the NumPy twin (the bits of the reference path; slower);
* ``fused``: the fused version wherever one exists (an error where it cannot run).

The CuPy kernels are on by default since they passed the ``gpu`` tests on an
NVIDIA H100 (``scripts/gpu-check.sh``, 2026-11-26); ``MPISHARD_GPU_KERNELS=0``
turns them off (the twin's chain of CuPy calls), for a comparison or a device
where they misbehave.
"""

from __future__ import annotations

import functools
import os
import sys
from types import ModuleType

import numpy as np

__all__ = ["FUSED_MIN_ELEMENTS", "KERNEL_MODES", "fused_on", "import_numba", "kernel_mode",
           "numba_available"]

#: What ``MPISHARD_KERNELS`` accepts.
KERNEL_MODES = ("auto", "reference", "fused")

#: ``auto`` runs the Numba kernels on arrays of at least this many elements.
#: The first fused call of a process costs ~0.3 s here (importing Numba 0.15 s,
#: loading the cached machine code 0.15 s); a NumPy twin over a vector shorter
#: than one of its chunks costs tens of microseconds, so a small model (a test's,
#: a toy's) would never win that back. Above it the fused update saves about a
#: millisecond per million elements per step (benchmarks/bench_optimizer.py).
FUSED_MIN_ELEMENTS = 1 << 16


@functools.cache
def kernel_mode() -> str:
    """``MPISHARD_KERNELS`` (``auto`` when unset).

    Raises:
        ValueError: a value outside `KERNEL_MODES`.
    """
    mode = os.environ.get("MPISHARD_KERNELS", "auto").strip().lower() or "auto"
    if mode not in KERNEL_MODES:
        raise ValueError(f"MPISHARD_KERNELS must be one of {', '.join(KERNEL_MODES)}, "
                         f"got {mode!r}")
    return mode


#: Numba's switch for the highlighting of its error messages (read when it is imported).
_NO_HIGHLIGHT = "NUMBA_DISABLE_ERROR_MESSAGE_HIGHLIGHTING"


def import_numba() -> ModuleType:
    """Numba, imported with its error-message highlighting off unless the caller
    set ``NUMBA_DISABLE_ERROR_MESSAGE_HIGHLIGHTING``. The highlighting calls
    ``colorama.init()`` at the first compilation, whose exit handler writes
    ``ESC[0m`` to standard output when it is a terminal (every rank's, under
    ``mpirun``). The variable is set only while Numba is imported; a program
    that imported Numba before keeps Numba's own setting."""
    if "numba" not in sys.modules and _NO_HIGHLIGHT not in os.environ:
        os.environ[_NO_HIGHLIGHT] = "1"
        try:
            import numba
        finally:
            del os.environ[_NO_HIGHLIGHT]
    import numba

    return numba


@functools.cache
def numba_available() -> bool:
    """True when Numba imports (it is compiled lazily, at a kernel's first call)."""
    try:
        import_numba()
    except Exception:  # ImportError, or an llvmlite that does not load here
        return False
    return True


def _gpu_opted_in() -> bool:
    return os.environ.get("MPISHARD_GPU_KERNELS", "1").strip() not in ("", "0")


def fused_on(xp: ModuleType, elements: int | None = None) -> bool:
    """Whether kernels on arrays of ``xp`` (``numpy`` or ``cupy``) run fused.

    ``elements``: the size of the arrays at hand; under ``auto`` fewer than
    `FUSED_MIN_ELEMENTS` run the NumPy twin on the CPU.

    Raises:
        RuntimeError: ``MPISHARD_KERNELS=fused`` where no fused version can run
            (Numba missing on the CPU).
    """
    mode = kernel_mode()
    if mode == "reference":
        return False
    if xp is np:
        if mode == "auto" and elements is not None and elements < FUSED_MIN_ELEMENTS:
            return False
        if numba_available():
            return True
        if mode == "fused":
            raise RuntimeError("MPISHARD_KERNELS=fused, but Numba does not import here: "
                               "install numba, or use MPISHARD_KERNELS=auto")
        return False
    return mode == "fused" or _gpu_opted_in()
