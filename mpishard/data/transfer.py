"""Rows of a batch into the model's buffers, wherever the data and the model live.

The training loop makes its batch buffers once, on the model's device, and each
step a dataset fills their first rows with the rows the sampler chose. Four
cases, one object (`RowMover`, one per dataset) that keeps what they
reuse:

* data and model on the host: ``numpy.take`` into the buffer (it casts; nothing
  is allocated);
* data and model on the GPU: the step's indices are copied to the device once
  per batch, into a grow-only device buffer (through a pinned one), and the rows
  are gathered on the device (``cupy.take``): no row crosses the bus;
* data on the host (NumPy, h5py), model on the GPU: the rows are gathered on the
  host into a pinned staging buffer of the buffer's dtype (the cast happens
  there), then copied to the device once, asynchronously on the current stream;
  the staging buffer is reused once that copy has completed (a CUDA event per
  buffer, not a synchronisation of the device);
* data on the GPU, model on the host: the rows are gathered on the device and
  copied down (an unusual layout; it allocates).

Pure of MPI; CuPy is used only through the arrays' own namespace.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from ..backend import array_namespace

__all__ = ["RowMover", "source_namespace"]


def source_namespace(a: Any) -> Any:
    """``numpy`` or ``cupy`` for an array, None for anything else indexable by rows
    (an h5py dataset)."""
    if isinstance(a, np.ndarray):
        return np
    try:
        return array_namespace(a)
    except TypeError:
        return None


class RowMover:
    """The reused buffers of one dataset's row copies (see the module docstring).

    Local: no communication. Not thread-safe (one training loop uses it).
    """

    def __init__(self) -> None:
        self._pinned: dict[str, tuple[np.ndarray, Any]] = {}   # key -> (bytes, event)
        self._index: Any = None                                 # device int64 buffer
        self._host: dict[str, np.ndarray] = {}                  # cast scratch, by key

    def indices(self, xp: Any, indices: np.ndarray) -> Any:
        """``indices`` where arrays of ``xp`` can use them: the host array itself,
        or its copy in this mover's device buffer (valid until the next call)."""
        if xp is np:
            return indices
        n = len(indices)
        if self._index is None or len(self._index) < n:
            self._index = xp.empty(max(n, 1), dtype=np.int64)
        stage = self._staging("index", (n,), np.int64, xp)
        np.copyto(stage, indices, casting="unsafe")
        out = self._index[:n]
        self._upload("index", stage, out, xp)
        return out

    def take(self, a: Any, indices: np.ndarray, out: Any, device_indices: Any = None,
             key: str = "rows") -> None:
        """``out[:] = a[indices]`` (cast to ``out``'s dtype), for ``a`` a NumPy or
        CuPy array or an h5py dataset and ``out`` a NumPy or CuPy array.
        ``device_indices``: `indices` of the same ``indices`` (to copy them
        once for inputs and targets); ``key`` names the staging buffer."""
        if len(indices) == 0:
            return
        xa, xo = source_namespace(a), array_namespace(out)
        if xo is np:
            if xa is np or xa is None:
                self._host_rows(a, indices, out, key)
            else:   # device data, host model
                idx = device_indices if device_indices is not None else self.indices(xa, indices)
                out[...] = a.take(idx, axis=0).get().reshape(out.shape)
            return
        if xa is xo:   # both on the device: gather there
            idx = device_indices if device_indices is not None else self.indices(xo, indices)
            if a.dtype == out.dtype:
                xo.take(a, idx, axis=0, out=out)
            else:
                out[...] = xo.take(a, idx, axis=0)
            return
        # Host rows, device buffer: gather and cast into pinned memory, one copy up.
        stage = self._staging(key, out.shape, out.dtype, xo)
        self._host_rows(a, indices, stage, key)
        self._upload(key, stage, out, xo)

    def put(self, rows: Any, out: Any, key: str = "rows", order: Any = None) -> None:
        """``out[:] = rows`` (cast to ``out``'s dtype) for host or device ``rows``
        and ``out``, or with ``order`` (host positions) ``out[order] = rows``;
        host rows reach a device ``out`` through pinned memory, in one copy."""
        xr, xo = array_namespace(rows), array_namespace(out)
        if xr is not np and xo is np:
            rows = rows.get()
            xr = np
        if xr is xo:
            if order is None:
                out[...] = rows.reshape(out.shape)
            else:
                out[order] = rows
            return
        stage = self._staging(key, out.shape, out.dtype, xo)
        if order is None:
            np.copyto(stage, rows.reshape(out.shape), casting="unsafe")
        else:
            stage[order] = rows
        self._upload(key, stage, out, xo)

    def _host_rows(self, a: Any, indices: np.ndarray, out: np.ndarray, key: str) -> None:
        """``out[:] = a[indices]`` on the host: ``numpy.take`` for an array (into a
        grow-only scratch of ``a``'s dtype first where take cannot cast: it
        writes through a buffer of ``a``'s dtype, so ``out``'s dtype must cast
        safely to ``a``'s), one sorted read for an h5py dataset."""
        if isinstance(a, np.ndarray):
            if np.can_cast(out.dtype, a.dtype, "safe"):
                np.take(a, indices, axis=0, out=out, mode="clip")
            else:
                rows = self._scratch(key, out.shape, a.dtype)
                np.take(a, indices, axis=0, out=rows, mode="clip")
                np.copyto(out, rows, casting="unsafe")
            return
        # h5py and the like: increasing, duplicate-free selections, read once.
        want, inverse = np.unique(np.asarray(indices), return_inverse=True)
        out[...] = np.asarray(a[want])[inverse].reshape(out.shape)

    def _scratch(self, key: str, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        size = int(np.prod(shape, dtype=np.int64))
        have = self._host.get(key)
        if have is None or have.size < size or have.dtype != dtype:
            have = self._host[key] = np.empty(size, dtype=dtype)
        return have[:size].reshape(shape)

    # --- pinned staging --------------------------------------------------------------
    def _staging(self, key: str, shape: tuple[int, ...], dtype: Any, xp: Any) -> np.ndarray:
        """A pinned host array of ``shape`` and ``dtype``; grow-only per ``key``.
        Waits for the previous copy out of it (its event) before handing it out."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        have = self._pinned.get(key)
        if have is None or have[0].nbytes < nbytes:
            if have is not None:
                have[1].synchronize()   # the old buffer's last copy, before it is freed
            # Pinned: the copy to the device is a DMA transfer that runs while the
            # host goes on (from pageable memory the driver copies it twice).
            mem = xp.cuda.alloc_pinned_memory(max(nbytes, 1))
            have = (np.frombuffer(mem, dtype=np.uint8, count=max(nbytes, 1)),
                    xp.cuda.Event(disable_timing=True))
            self._pinned[key] = have
        else:
            have[1].synchronize()   # the last copy out of this buffer has finished
        return have[0][:nbytes].view(dtype).reshape(shape)

    def _upload(self, key: str, stage: np.ndarray, out: Any, xp: Any) -> None:
        """Copy pinned ``stage`` into the contiguous device array ``out`` on the
        current stream, without waiting; record the buffer's event after it."""
        if not out.flags.c_contiguous:
            raise ValueError("expecting a contiguous device buffer for the rows")
        stream = xp.cuda.get_current_stream()
        # A ctypes pointer: CuPy before v12 takes no plain int here.
        out.data.copy_from_host_async(stage.ctypes.data_as(ctypes.c_void_p), stage.nbytes,
                                      stream)
        self._pinned[key][1].record(stream)

