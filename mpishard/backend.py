"""Choose NumPy or CuPy from an array, without importing CuPy at import time."""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

import numpy as np

__all__ = [
    "array_namespace",
    "cupy_available",
    "gpu_for_rank",
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


def gpu_for_rank(local_rank: int, visible: int, index: int | None = None,
                 cuda_visible: str | None = None) -> tuple[int, str]:
    """``(device, why)``: which of the ``visible`` CUDA devices a rank uses. Pure.

    ``index`` (``--gpu-index``) wins; otherwise the rank takes ``local_rank %
    visible``, its rank among the ranks of its node modulo the devices it sees.
    ``cuda_visible`` (the process's ``CUDA_VISIBLE_DEVICES``) only names the
    rule in ``why``: it has already narrowed what ``visible`` counts (a Slurm
    job with ``--gpus-per-task=1`` shows each task its own device, so every
    rank takes its device 0).

    Raises:
        ValueError: no device visible, or an ``index`` outside ``[0, visible)``.
    """
    shown = "" if cuda_visible is None else f" (CUDA_VISIBLE_DEVICES={cuda_visible})"
    if visible < 1:
        raise ValueError(f"no CUDA device is visible to this rank{shown}")
    if index is not None:
        if not 0 <= index < visible:
            raise ValueError(f"--gpu-index {index} is not a device of this rank: it sees "
                             f"{visible} device(s){shown}, numbered 0 to {visible - 1}")
        return index, f"--gpu-index {index}"
    device = local_rank % visible
    return device, f"local rank {local_rank} % {visible} visible device(s){shown}"
