"""The binned sums of reproducible mode as fused kernels: one pass over the data each.

[`mpishard.reprosum`][mpishard.reprosum] defines the arithmetic (chunks of 128 elements,
absolute bins of ``W`` bits, ``K`` integer words per element, the error bound)
and holds the NumPy twin of every kernel here: about ten array passes per
deposit. The fused versions do the same integer arithmetic chunk by chunk, the
chunk staying in the cache (in registers on a GPU): a Numba JIT on the CPU,
CuPy ``RawKernel`` s on a GPU (a thread block per chunk, a thread per element:
`mpishard.kernels.deposit_cuda`).
Each gives its twin's bits, ``tests/unit/test_kernels_deposit.py`` checks it on
values over the whole float range (signed zeros, subnormals, 1e305, NaN).

* `deposit`: add one vector to a [`BinnedAccumulator`][mpishard.reprosum.BinnedAccumulator]
  (its words stay in memory between deposits: many units on one rank).
* `to_float`: the accumulator's words back to floating point.
* `exact_sum`: the same binned sum of the rows of a matrix (a few units'
  gradients side by side) written straight to floating point: the words live
  only in the cache, so each value is read once and the result written once.
* `square_words`: the words of a sum of squares at an agreed bin (a
  gradient norm); `max_magnitude`.

Which version runs is [`mpishard.kernels.select.fused_on`][mpishard.kernels.select.fused_on]'s
choice. The Numba kernels (`mpishard.kernels.numba_deposit`) compile at their first call
(cached on disk, reused by later processes); the CuPy ones at theirs. Pure: no MPI.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..backend import array_namespace
from ..reprosum import (
    EMPTY_BIN,
    NORM_WORD_BITS,
    NORM_WORDS,
    WORD_BITS,
    BinnedAccumulator,
    ChunkGrid,
    fixed_bin_sum,
    words_for,
)
from . import deposit_cuda
from .select import fused_on

__all__ = ["deposit", "deposit_rows", "exact_sum", "max_magnitude", "square_words",
           "to_float"]

# Per float item size: the integer type of the same bits, the mask clearing the
# sign bit, the exponent field's shift, the exponent field of inf and NaN, and the
# exponent of a subnormal's unit (2**-149, 2**-1074).
_BITS = {4: (np.int32, 0x7FFFFFFF, 23, 0xFF, -149),
         8: (np.int64, 0x7FFFFFFFFFFFFFFF, 52, 0x7FF, -1074)}


# --------------------------------------------------------------------------- kernels

def deposit(acc: BinnedAccumulator, x: Any) -> bool:
    """``acc.deposit(x)`` for an accumulator without extras: add vector ``x``,
    or return False, depositing nothing, when a value is not finite. Local.

    Raises:
        ValueError: the accumulator holds its capacity of deposits already.
    """
    xp = acc.xp
    if acc.extras or not fused_on(xp) or acc.deposits >= acc.capacity:
        return acc.deposit(x)           # the twin (it raises on a full accumulator)
    source = x.reshape(-1)
    if xp is np:
        itype, mask, shift, inf, unit = _BITS[source.dtype.itemsize]
        row = np.ascontiguousarray(source).reshape(1, -1)
        ok = _numba().deposit_rows(row, row.view(itype), mask, shift, inf, unit,
                                   acc.grid.starts, acc.grid.lengths, acc.words, acc.bins,
                                   _chunk_scratch(acc), acc.word_bits)
    else:
        ok = _cuda().deposit(acc, source)
    if ok:
        acc.deposits += 1
    return bool(ok)


def deposit_rows(acc: BinnedAccumulator, rows: Any) -> int:
    """Deposit every row of ``rows`` (``(R, acc.size)``) into ``acc``: the bits of
    `deposit` row after row, but each chunk's words are read and written
    once for all the rows. Returns -1, or the first row holding a non-finite
    value (that row and the later ones are not deposited). Local.

    Raises:
        ValueError: more rows than the accumulator has room for.
    """
    xp = acc.xp
    if acc.extras or not fused_on(xp) or acc.deposits + rows.shape[0] > acc.capacity:
        return _deposit_rows_twin(acc, rows)
    if rows.shape[0] == 0:
        return -1
    if xp is np:
        itype, mask, shift, inf, unit = _BITS[rows.dtype.itemsize]
        rows = np.ascontiguousarray(rows)
        done = _numba().deposit_rows(rows, rows.view(itype), mask, shift, inf, unit,
                                     acc.grid.starts, acc.grid.lengths, acc.words, acc.bins,
                                     _chunk_scratch(acc), acc.word_bits)
    else:
        done = _cuda().deposit_rows(acc, rows)
    if not done:                        # a non-finite value: the twin says where
        return _deposit_rows_twin(acc, rows)
    acc.deposits += rows.shape[0]
    return -1


def to_float(acc: BinnedAccumulator, out: Any, start: int = 0, stop: int | None = None) -> None:
    """``acc.to_float(out, start, stop)``: elements ``[start, stop)`` of the sum,
    rounded to ``out``'s dtype. Local."""
    stop = acc.size if stop is None else stop
    if not fused_on(acc.xp) or stop <= start:
        acc.to_float(out, start, stop)
        return
    for a, b, padded in acc.segments:       # the padded words of each tensor's piece
        lo, hi = max(a, start), min(b, stop)
        if lo < hi:
            piece = out[lo - start:hi - start]
            if acc.xp is np:
                _numba().to_float(acc.words, acc.bins, acc.word_bits, acc.chunk,
                                  padded + lo - a, padded + hi - a, piece)
            else:
                _cuda().to_float(acc, padded + lo - a, padded + hi - a, piece)


def exact_sum(grid: ChunkGrid, rows: Any, out: Any, lo: int = 0, hi: int | None = None) -> int:
    """The binned sum of the rows of ``rows`` (``(R, grid.size)``, chunked as
    ``grid`` says), its elements ``[lo, hi)`` written into ``out``: the bits of
    depositing every row into a [`BinnedAccumulator`][mpishard.reprosum.BinnedAccumulator]
    and converting (the twin does just that), in one pass that keeps a chunk's
    words in the cache and never writes them to memory. Returns -1, or the first
    row holding a non-finite value (``out`` is then unspecified). Local.
    """
    hi = grid.size if hi is None else hi
    xp = array_namespace(rows)
    if not fused_on(xp) or rows.shape[0] == 0:
        return _exact_sum_twin(grid, rows, out, lo, hi)
    k = words_for(rows.dtype)
    if xp is np:
        itype, mask, shift, inf, unit = _BITS[rows.dtype.itemsize]
        rows = np.ascontiguousarray(rows)
        return int(_numba().exact_sum(rows, rows.view(itype), mask, shift, inf, unit,
                                      grid.starts, grid.lengths, k, WORD_BITS, lo, hi, out))
    return _cuda().exact_sum(grid, rows, out, lo, hi, k)


def square_words(x: Any, top_bin: int, scratch: Any, slices: Any) -> list[float]:
    """``fixed_bin_sum(x, top_bin, scratch, slices, square=True)``: the words of
    ``sum(x**2)`` at bin ``top_bin`` (`NORM_WORDS` of
    `NORM_WORD_BITS` bits), in one pass. Local."""
    xp = array_namespace(x)
    if top_bin == EMPTY_BIN or not fused_on(xp) or x.size == 0:
        return fixed_bin_sum(x, top_bin, scratch, slices, square=True)
    flat = x.reshape(-1)
    if xp is np:
        out = np.zeros(NORM_WORDS)
        _numba().square_words(np.ascontiguousarray(flat), -top_bin * NORM_WORD_BITS,
                              NORM_WORD_BITS, out)
        return [float(v) for v in out]
    return _cuda().square_words(flat, top_bin)


def max_magnitude(x: Any) -> float:
    """``max(|x|)`` (0.0 for no elements; NaN or inf where there is one). Local."""
    xp = array_namespace(x)
    if x.size == 0:
        return 0.0
    if xp is np and fused_on(xp):
        flat = np.ascontiguousarray(x.reshape(-1))
        itype, mask = _BITS[flat.dtype.itemsize][:2]
        bits = np.array([_numba().max_bits(flat.view(itype), mask)], dtype=itype)
        return float(bits.view(flat.dtype)[0])      # a NaN's or inf's bits: itself
    return float(xp.maximum(x.max(), -x.min()))


# --------------------------------------------------------------------------- twins

def _deposit_rows_twin(acc: BinnedAccumulator, rows: Any) -> int:
    for r in range(rows.shape[0]):
        if not acc.deposit(rows[r]):
            return r
    return -1


def _exact_sum_twin(grid: ChunkGrid, rows: Any, out: Any, lo: int, hi: int) -> int:
    """Deposit every row, convert: the definition of `exact_sum` (its
    accumulator is made once per grid, dtype and array library)."""
    xp = array_namespace(rows)
    key = (np.dtype(rows.dtype).str, xp.__name__)
    acc = grid.kernel_scratch.get(key)
    if acc is None:
        acc = grid.kernel_scratch[key] = BinnedAccumulator(grid.size, rows.dtype, xp,
                                                           segments=grid.segments,
                                                           chunk=grid.chunk)
    acc.clear()
    for r in range(rows.shape[0]):
        if not acc.deposit(rows[r]):
            return r
    acc.to_float(out, lo, hi)
    return -1


def _chunk_scratch(acc: BinnedAccumulator) -> Any:
    """One int64 per chunk (the largest magnitude's bits), made on first need."""
    scratch = acc.kernel_scratch.get("bits")
    if scratch is None:
        scratch = acc.kernel_scratch["bits"] = np.zeros(acc.main_chunks, dtype=np.int64)
    return scratch


# --------------------------------------------------------------------------- Numba

def _numba() -> Any:
    """The Numba kernels (`mpishard.kernels.numba_deposit`: imported at the first
    fused call on the CPU; compiled per signature, cached on disk)."""
    from . import numba_deposit  # optional dependency: imported on first use only
    return numba_deposit


def _cuda() -> Any:
    """The CUDA kernels (`mpishard.kernels.deposit_cuda`; compiled by CuPy at
    their first launch)."""
    return deposit_cuda
