"""Fused array kernels: each hot elementwise or reduction operation as one function.

Every kernel here has a NumPy twin (the reference, and the fallback) and, where it
pays, a fused version: a Numba JIT on the CPU, a CuPy kernel on the GPU. The layers,
optimizers and strategies call the function; they never choose a backend themselves.
Which implementation runs is [`mpishard.kernels.select`][mpishard.kernels.select]'s decision. Pure:
no MPI.
"""

from .optim import adam_update, adam_update_numpy, sgd_update, sgd_update_numpy
from .scratch import ScratchBuffers, chunk_bounds
from .select import FUSED_MIN_ELEMENTS, KERNEL_MODES, fused_on, kernel_mode, numba_available

__all__ = [
    "FUSED_MIN_ELEMENTS",
    "KERNEL_MODES",
    "ScratchBuffers",
    "adam_update",
    "adam_update_numpy",
    "chunk_bounds",
    "fused_on",
    "kernel_mode",
    "numba_available",
    "sgd_update",
    "sgd_update_numpy",
]
