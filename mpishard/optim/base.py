"""Shared machinery of the flat-vector optimizers: hyperparameters, chunking, checks."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import numpy as np

from ..backend import array_namespace
from ..kernels.scratch import ScratchBuffers

__all__ = [
    "CHUNK_ELEMENTS",
    "DEVICE_CHUNK_ELEMENTS",
    "FlatOptimizer",
    "ScratchBuffers",
    "check_hyperparameter",
    "check_range",
]

#: Elements per chunk on the host, for the NumPy twins of the updates
#: (`mpishard.kernels.optim`; the fused kernels make one unchunked pass).
#: A twin does about a dozen in-place NumPy passes over each chunk; the chunk's
#: slices of the parameters, gradients, state and scratch must stay in cache
#: between those passes, so that main memory is read and written once per
#: element. Smaller chunks pay Python's per-call cost (~1 us per ufunc, ~12 us
#: per Adam chunk) too often: 4K-16K measured 1.3-2.5x slower. 64K float32
#: (256 KiB per array, ~1.3 MiB for Adam's five) fits a 2 MiB L2 and measured
#: within noise of the best (128K-1M) at 25M elements. At 1.9M elements 256K
#: chunks were up to ~20% faster, but only by using this 2-core machine's 32 MiB
#: L3, which ranks sharing a node would share too
#: (benchmarks/bench_optimizer.py --chunk-sweep).
CHUNK_ELEMENTS = 1 << 16

#: Elements per chunk for device arrays (CuPy). A GPU gains nothing from
#: chunking; the loop only bounds the scratch memory (two buffers of this many
#: elements, 64 MiB each in float32) and costs a dozen kernel launches per chunk.
DEVICE_CHUNK_ELEMENTS = 1 << 24


def check_range(params: Any, grads: Any, state: dict[str, Any], names: tuple[str, ...],
                step: int) -> None:
    """Raise ``ValueError`` unless the arguments of an update fit together."""
    if getattr(params, "ndim", None) != 1:
        raise ValueError(f"expecting 1-D params, got shape {getattr(params, 'shape', None)}")
    if grads.shape != params.shape:
        raise ValueError(f"expecting grads of shape {params.shape}, got {grads.shape}")
    if grads.dtype != params.dtype:
        raise ValueError(f"expecting grads of dtype {params.dtype}, got {grads.dtype}")
    for name in names:
        if name not in state:
            raise ValueError(f"expecting state {sorted(names)}, got {sorted(state)}")
        if state[name].shape != params.shape:
            raise ValueError(
                f"expecting state[{name!r}] of shape {params.shape}, got {state[name].shape}")
    if step < 1:
        raise ValueError(f"expecting a 1-based step >= 1, got {step}")


def check_hyperparameter(name: str, value: Any, low: float, high: float | None = None,
                         high_open: bool = False) -> float:
    """Return ``float(value)``; raise ``ValueError`` unless ``low <= value`` (and ``< high``)."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"expecting a number for {name}, got {value!r}") from None
    bad = not math.isfinite(x) or x < low or (high is not None and (x >= high if high_open
                                                                    else x > high))
    if bad:
        close = ")" if high_open else "]"
        span = f"in [{low}, {high}{close}" if high is not None else f">= {low}"
        raise ValueError(f"expecting {name} {span}, got {value!r}")
    return x


@dataclass
class FlatOptimizer:
    """Base class: hyperparameters from the dataclass fields, zeroed state, chunks.

    Subclasses are dataclasses whose ``init`` fields are exactly their
    hyperparameters; they set ``state_names`` and ``scratch_count`` and implement
    ``update``. ``chunk_size`` (keyword only) changes speed, never results: every
    operation is elementwise, so any chunking gives bit-identical updates.
    The scratch belongs to the instance: one thread updates with it at a time.
    """

    state_names: ClassVar[tuple[str, ...]] = ()
    scratch_count: ClassVar[int] = 2

    chunk_size: int = field(default=CHUNK_ELEMENTS, kw_only=True, repr=False, compare=False)
    _scratch: ScratchBuffers = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if int(self.chunk_size) != self.chunk_size or self.chunk_size < 1:
            raise ValueError(f"expecting chunk_size >= 1, got {self.chunk_size!r}")
        self.chunk_size = int(self.chunk_size)
        self._scratch = ScratchBuffers(self.scratch_count)

    def hyperparameters(self) -> dict[str, Any]:
        """A JSON-serialisable dict that
        [`optimizer_from_hyperparameters`][mpishard.optim.optimizer_from_hyperparameters] reads
        back."""
        out: dict[str, Any] = {"name": type(self).__name__}
        for f in fields(self):
            if f.init and f.name != "chunk_size":
                value = getattr(self, f.name)
                out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    def init_state(self, size: int, dtype: Any, xp: Any) -> dict[str, Any]:
        """Zeroed state arrays of length ``size`` by name (``{}`` when stateless)."""
        return {name: xp.zeros(size, dtype=dtype) for name in self.state_names}

    def _chunk_length(self, params: Any) -> int:
        """Elements per chunk of the NumPy twins over ``params``."""
        limit = self.chunk_size if array_namespace(params) is np else DEVICE_CHUNK_ELEMENTS
        return max(1, min(limit, params.shape[0]))
