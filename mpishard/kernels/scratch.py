"""Grow-only work arrays for the NumPy twins, and the chunks they walk a vector in."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

__all__ = ["ScratchBuffers", "chunk_bounds"]


class ScratchBuffers:
    """Grow-only work arrays, one set per (array module, device, dtype).

    ``get`` returns ``count`` arrays of at least ``size`` elements; they are made
    on the first request and replaced only by a larger request, so a training loop
    allocates nothing after its first step.
    """

    def __init__(self, count: int) -> None:
        self.count = count
        self._buffers: dict[tuple[str, Any, str], tuple[Any, ...]] = {}

    def get(self, xp: Any, dtype: Any, size: int, device: Any = None) -> tuple[Any, ...]:
        key = (xp.__name__, device, np.dtype(dtype).str)
        buffers = self._buffers.get(key)
        if buffers is None or buffers[0].shape[0] < size:
            buffers = tuple(xp.empty(size, dtype=dtype) for _ in range(self.count))
            self._buffers[key] = buffers
        return buffers


def chunk_bounds(n: int, chunk: int) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` of the chunks of ``chunk`` elements that cover ``range(n)``."""
    for start in range(0, n, chunk):
        yield start, min(start + chunk, n)
