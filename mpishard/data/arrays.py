"""Datasets held in memory: fixed arrays, and a dataset that grows as samples arrive."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..backend import array_namespace
from .transfer import RowMover, source_namespace

__all__ = ["ArrayDataset", "StreamingDataset"]


class ArrayDataset:
    """Inputs and targets held as arrays with samples along the first axis.

    ``gather(indices, x_out, y_out)`` copies the selected rows into preallocated
    buffers (``numpy.take`` with ``out=``), so the step loop allocates nothing.
    ``x`` and ``y`` may also be h5py datasets (anything with ``len``, ``shape``,
    ``dtype`` and indexing by a sorted index array): each step then reads only
    its rows. An array-like without ``shape`` and ``dtype`` (a list of numbers
    or of rows of numbers, a tuple) is converted once, here, with
    ``numpy.asarray`` (a copy on the host; floating-point values are cast to
    the model's dtype as each batch is copied, as for arrays).

    Raises:
        ValueError: the inputs and targets differ in length; an array-like that
            does not convert to an array of numbers (ragged rows, strings).
    """

    def __init__(self, x: Any, y: Any) -> None:
        x, y = _as_rows(x, "inputs"), _as_rows(y, "targets")
        if len(x) != len(y):
            raise ValueError(f"inputs have {len(x)} samples but targets have {len(y)}")
        self.x = x
        self.y = y

    def __len__(self) -> int:
        return len(self.x)

    def buffers(self, rows: int, xp: Any = np, float_dtype: Any = None) -> tuple[Any, Any]:
        """Buffers for ``rows`` samples, on the device of ``xp``; floating-point
        data is held in ``float_dtype`` (the model's) when given, so the cast
        happens once, in the copy into the buffer."""
        def dtype(a: Any) -> Any:
            floating = np.issubdtype(a.dtype, np.floating)
            return float_dtype if floating and float_dtype is not None else a.dtype

        return (xp.empty((rows,) + self.x.shape[1:], dtype=dtype(self.x)),
                xp.empty((rows,) + self.y.shape[1:], dtype=dtype(self.y)))

    def gather(self, indices: np.ndarray, x_out: Any, y_out: Any) -> None:
        """Copy samples ``indices`` into the first rows of ``x_out``, ``y_out``. Local.

        Device data and a device model: the rows are gathered on the GPU (the
        indices are copied up once); host data and a device model: gathered on
        the host into pinned memory and copied up once (`mpishard.data.transfer`).
        """
        mover = self._mover()
        xp = array_namespace(x_out)
        idx = None
        if xp is not np and source_namespace(self.x) is xp:
            idx = mover.indices(xp, indices)   # once for inputs and targets
        mover.take(self.x, indices, x_out, idx, key="x")
        mover.take(self.y, indices, y_out, idx, key="y")

    def _mover(self) -> RowMover:
        # Made on first use: a subclass need not call this __init__.
        mover = getattr(self, "_row_mover", None)
        if mover is None:
            mover = self._row_mover = RowMover()
        return mover


class StreamingDataset(ArrayDataset):
    """An [`ArrayDataset`][mpishard.data.ArrayDataset] that grows:
    [`append`][mpishard.data.StreamingDataset.append] adds samples at the end (samples a running
    simulation sends, say) while earlier ones stay where they are.

    Training on it follows the growth rule of `mpishard.data.sampler`: each
    epoch covers the samples present when it starts, so ``optimize(model, data,
    epochs=e + 1, ...)`` after the ``e``-th batch of new samples trains one more
    epoch over everything received so far. Every rank must append the same
    samples (the training loop checks that the ranks agree on the length).
    Storage grows by doubling, so appending is amortised O(new rows) and the
    arrays the loop reads are views of it.

    Args:
        x, y: the first samples (may have no rows), or ``input_shape``/
            ``target_shape`` with dtypes to start empty.
    """

    def __init__(self, x: Any = None, y: Any = None, *, input_shape: tuple[int, ...] = (),
                 target_shape: tuple[int, ...] = (), dtype: Any = np.float64,
                 target_dtype: Any = None) -> None:
        if x is None:
            x = np.empty((0,) + tuple(input_shape), dtype=dtype)
            y = np.empty((0,) + tuple(target_shape),
                         dtype=target_dtype if target_dtype is not None else dtype)
        x, y = np.asarray(x), np.asarray(y)
        if len(x) != len(y):
            raise ValueError(f"inputs have {len(x)} samples but targets have {len(y)}")
        self._xs = np.array(x, copy=True)
        self._ys = np.array(y, copy=True)
        self._n = len(x)
        super().__init__(self._xs[:self._n], self._ys[:self._n])

    def append(self, x: Any, y: Any) -> None:
        """Add samples ``x``, ``y`` (arrays of rows, or one row each) at the end. Local."""
        x, y = np.asarray(x), np.asarray(y)
        if x.shape == self._xs.shape[1:]:          # one sample
            x, y = x[None], y[None]
        if x.shape[1:] != self._xs.shape[1:] or y.shape[1:] != self._ys.shape[1:]:
            raise ValueError(f"expecting rows of shape {self._xs.shape[1:]} and "
                             f"{self._ys.shape[1:]}, got {x.shape[1:]} and {y.shape[1:]}")
        if len(x) != len(y):
            raise ValueError(f"inputs have {len(x)} samples but targets have {len(y)}")
        need = self._n + len(x)
        if need > len(self._xs):
            size = max(need, 2 * len(self._xs), 16)
            self._xs = _grown(self._xs, size)
            self._ys = _grown(self._ys, size)
        self._xs[self._n:need] = x
        self._ys[self._n:need] = y
        self._n = need
        self.x, self.y = self._xs[:need], self._ys[:need]


def _as_rows(a: Any, what: str) -> Any:
    """``a`` itself when it has ``shape`` and ``dtype`` (an array of any library,
    an h5py dataset); else ``numpy.asarray(a)``, which must hold numbers in at
    least one dimension."""
    if hasattr(a, "shape") and hasattr(a, "dtype"):
        return a
    accepted = ("expecting an array, an h5py dataset, or a list of numbers or of equal "
                "rows of numbers")
    try:
        out = np.asarray(a)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what}: {accepted}; the {type(a).__name__} given does not "
                         f"convert to an array: {exc}") from None
    if out.dtype.kind not in "biuf" or out.ndim == 0:
        raise ValueError(f"{what}: {accepted}; the {type(a).__name__} given converts to "
                         f"an array of dtype {out.dtype} and shape {out.shape}, not "
                         f"numbers in rows")
    return out


def _grown(a: np.ndarray, rows: int) -> np.ndarray:
    out = np.empty((rows,) + a.shape[1:], dtype=a.dtype)
    out[:len(a)] = a
    return out
