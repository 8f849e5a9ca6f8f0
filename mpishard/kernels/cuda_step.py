"""What a GPU step may trade for speed: TF32 products, and replay as a CUDA graph.

Both are off by default, and neither has run on a GPU yet (see the GPU guide,
docs/guide/gpus.md; ``scripts/gpu-check.sh`` measures them).

* [`set_tf32`][mpishard.kernels.cuda_step.set_tf32]: CuPy's float32 products
  (``matmul``, ``dot``: cuBLAS) on TF32 tensor cores, inputs rounded to 10 bits of
  mantissa and sums kept in float32: about 1e-3 relative error on a product of
  width 512 instead of about 1e-6, so results change. CuPy's own switch is the
  ``CUPY_TF32=1`` environment variable, read at the process's first float32
  product; this one can be called at any time.
* [`StepGraph`][mpishard.kernels.cuda_step.StepGraph]: a function's GPU work
  captured once and replayed, so a step costs one launch instead of hundreds of
  Python calls and kernel launches. Only for work whose shapes and buffers do not
  change and that neither reads the host nor calls MPI; anything else falls
  back to running eagerly, with the reason kept.

Pure: no MPI.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["StepGraph", "set_tf32", "tf32_enabled"]


def _linalg() -> Any:
    """CuPy's compute-type switch (``cupy._core._routines_linalg``), or None."""
    try:
        from cupy._core import _routines_linalg as linalg
    except ImportError:
        return None
    return linalg if hasattr(linalg, "set_compute_type") else None


def set_tf32(xp: Any, enabled: bool) -> bool:
    """Let CuPy's float32 products use TF32 tensor cores (``enabled``) or not.
    For the whole process. Returns whether the products now do: False for NumPy,
    on a GPU before compute capability 8.0, or where this CuPy has no switch (then
    ``CUPY_TF32`` is set for its first float32 product, if that is still to come)."""
    if xp is np:
        return False
    linalg = _linalg()
    if linalg is None:
        os.environ["CUPY_TF32"] = "1" if enabled else "0"
        return False
    if enabled and int(xp.cuda.Device().compute_capability) < 80:
        return False
    linalg.set_compute_type(np.float32, linalg.COMPUTE_TYPE_TF32 if enabled
                            else linalg.COMPUTE_TYPE_DEFAULT)
    return tf32_enabled(xp)


def tf32_enabled(xp: Any) -> bool:
    """True when CuPy's float32 products use TF32 (never for NumPy)."""
    linalg = None if xp is np else _linalg()
    return linalg is not None and linalg.get_compute_type(np.float32) == linalg.COMPUTE_TYPE_TF32


class StepGraph:
    """Run ``fn`` (no arguments) as a CUDA graph once it has run ``warmup`` times.

    ``fn`` must only queue device work on the current stream, into buffers that
    stay where they are (the layers' and the loss's, made at the first step):
    no host read (``float(loss)``, ``.get()``), no MPI call, no argument that
    changes between calls (a step count passed to a kernel would be replayed
    as captured). The first ``warmup`` calls run ``fn`` (its kernels compile,
    its buffers are made); the next captures it on a side stream, with memory
    from a pool of its own that lives as long as the graph (what ``fn``
    allocates while captured is never handed to other code), and launches the
    graph; later calls launch it on the current stream. A capture that fails
    (an operation a capture forbids) leaves ``reason`` saying why, and ``fn``
    runs from then on. NumPy: ``fn`` always runs. Local.
    """

    def __init__(self, fn: Callable[[], Any], xp: Any, warmup: int = 2) -> None:
        if warmup < 1:
            raise ValueError(f"expecting warmup of at least 1 call, got {warmup}")
        self.fn, self.xp, self.warmup = fn, xp, int(warmup)
        self.calls = 0
        self.graph: Any = None
        self.reason: str | None = "NumPy arrays: nothing to capture" if xp is np else None
        self._pool: Any = None
        self._stream: Any = None

    @property
    def captured(self) -> bool:
        """True once the graph replays ``fn``."""
        return self.graph is not None

    def __call__(self) -> None:
        self.calls += 1
        if self.graph is not None:
            self.graph.launch(stream=self.xp.cuda.get_current_stream())
        elif self.reason is not None or self.calls <= self.warmup:
            self.fn()
        else:
            self._capture()

    def _capture(self) -> None:
        cuda = self.xp.cuda
        current = cuda.get_current_stream()
        current.synchronize()                   # the eager calls' work is done
        stream, pool = cuda.Stream(non_blocking=True), cuda.MemoryPool()
        # Kept even if the capture fails: arrays made during it may outlive it.
        self._pool, self._stream = pool, stream
        try:
            with cuda.using_allocator(pool.malloc), stream:
                stream.begin_capture()
                try:
                    self.fn()
                finally:
                    graph = stream.end_capture()
        except Exception as exc:  # CUDARuntimeError: an operation the capture forbids
            self.reason = f"capture failed, running eagerly: {type(exc).__name__}: {exc}"
            self.fn()                           # nothing captured ran: this call's work
            return
        self.graph = graph
        graph.launch(stream=current)
