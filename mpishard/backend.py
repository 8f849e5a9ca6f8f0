"""Choose NumPy or CuPy from an array, without importing CuPy at import time."""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

import numpy as np

__all__ = [
    "array_namespace",
    "cupy_available",
    "is_device_array",
    "synchronize",
    "to_numpy",
]


def array_namespace(*arrays: Any) -> ModuleType:
    """Return ``numpy`` or ``cupy``: the module that owns ``arrays``.

    CuPy is recognised only if it was already imported by the caller, so importing
    mpishard never imports CuPy. Mixing the two raises ``TypeError``.
    """
    found: ModuleType | None = None
    for a in arrays:
        if a is None:
            continue
        xp = _namespace_of(a)
        if found is not None and xp is not found:
            raise TypeError(f"arrays from both {found.__name__} and {xp.__name__}")
        found = xp
    return np if found is None else found


def _namespace_of(a: Any) -> ModuleType:
    cp = sys.modules.get("cupy")
    if cp is not None and isinstance(a, cp.ndarray):
        return cp
    if isinstance(a, (np.ndarray, np.generic, float, int)):
        return np
    raise TypeError(f"expecting a numpy or cupy array, got {type(a).__name__}")


def is_device_array(a: Any) -> bool:
    """True for a CuPy array (memory on the GPU)."""
    return array_namespace(a) is not np


def to_numpy(a: Any) -> np.ndarray:
    """A NumPy copy (or the same array) of ``a``, wherever it lives."""
    if is_device_array(a):
        return a.get()
    return np.asarray(a)


def synchronize(xp: ModuleType) -> None:
    """Wait for the current CUDA stream when ``xp`` is CuPy; nothing for NumPy.

    Call before handing a device buffer to MPI: MPI does not know CuPy's streams.
    """
    if xp is not np:
        xp.cuda.get_current_stream().synchronize()


def cupy_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # ImportError, CUDARuntimeError: no usable GPU
        return False
