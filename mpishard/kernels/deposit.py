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
choice. The Numba kernels compile at their first call (cached on disk); the CuPy ones at
theirs. Pure: no MPI.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
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
from .select import fused_on, import_numba

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

_COMPILED: dict[str, Any] = {}


def _numba() -> Any:
    """The Numba kernels (built at the first call; compiled per signature, cached)."""
    kernels = _COMPILED.get("numba")
    if kernels is None:
        kernels = _COMPILED["numba"] = _build_numba()
    return kernels


def _build_numba() -> SimpleNamespace:
    numba = import_numba()
    jit = numba.njit(cache=True, nogil=True)
    # Helpers are inlined into the kernels: no array views or calls per chunk.
    inline = numba.njit(cache=True, nogil=True, inline="always")
    h = _numba_helpers(jit, inline)
    h = SimpleNamespace(**vars(h), **vars(_numba_slices(inline, h.power_of_two)))
    kernels = SimpleNamespace(max_bits=h.max_bits)
    for build in (_numba_deposits, _numba_to_float, _numba_exact_sum, _numba_squares):
        kernels.__dict__.update(vars(build(jit, h)))
    return kernels


def _numba_helpers(jit: Any, inline: Any) -> SimpleNamespace:
    """The scalar helpers of the Numba kernels (inlined into them) and ``max_bits``."""
    # In every kernel, indices inside the per-chunk loops are unsigned (np.uint64):
    # a signed index makes Numba test it for wrap-around, which stops the loop from
    # vectorising (5x slower). And no array views per chunk: each costs reference
    # counting (atomics).
    empty = EMPTY_BIN
    @inline
    def frexp_exponent(bits, shift, unit):
        # math.frexp(v)[1] of the non-negative float v whose bits are ``bits``.
        field = bits >> shift
        if field:
            return field + unit + shift
        return math.frexp(float(bits))[1] + unit

    @inline
    def bin_of_bits(bits, shift, unit, w):
        if bits == 0:
            return empty
        return (frexp_exponent(bits, shift, unit) - 1) // w

    @jit
    def max_bits(bits, mask):
        # IEEE floats without their sign order as their bits do: the largest
        # magnitude is an integer maximum (vectorised; NaN and inf come out on top).
        m = 0
        for j in range(bits.size):
            v = bits[j] & mask
            if v > m:
                m = v
        return m

    @inline
    def chunk_bits(bits, r, mask, a, n):
        m = 0
        for j in range(n):
            v = bits[r, a + j] & mask
            if v > m:
                m = v
        return m

    @inline
    def power_of_two(e, pun):
        # 2**e for -1022 <= e <= 1023 (a normal float64: exact), from its bits: a
        # call to ldexp per chunk cost 12 ns, a third of a float32 chunk's sum.
        # ``pun``: an int64 array of one element and its float64 view.
        pun[0][0] = (e + 1023) << 52
        return pun[1][0]

    @inline
    def punning():
        bits = np.zeros(1, dtype=np.int64)
        return bits, bits.view(np.float64)
    return SimpleNamespace(frexp_exponent=frexp_exponent, bin_of_bits=bin_of_bits,
                           max_bits=max_bits, chunk_bits=chunk_bits,
                           power_of_two=power_of_two, punning=punning)

def _numba_slices(inline: Any, power_of_two: Any) -> SimpleNamespace:
    """A chunk of values into its K words, and K words back into values (inlined)."""
    @inline
    def slice_into(src, r, a, n, e, step, words, base, k, pun):
        # Add the K slices of src[r, a:a+n] * 2**e (the chunk's bin) to
        # words[:, base:base+n]. The scaling is one multiply by a normal power of
        # two where there is one (exact unless the product is subnormal, where it
        # rounds as ldexp does), else ldexp: the test is outside the loops.
        if -1022 <= e <= 1023:
            f = power_of_two(e, pun)
            if k == 2:
                for j in range(n):
                    t = np.float64(src[r, a + j]) * f
                    s = np.trunc(t)
                    words[0, base + j] += s
                    words[1, base + j] += np.trunc((t - s) * step)
            else:
                for j in range(n):
                    t = np.float64(src[r, a + j]) * f
                    s = np.trunc(t)
                    words[0, base + j] += s
                    t = (t - s) * step
                    s = np.trunc(t)
                    words[1, base + j] += s
                    words[2, base + j] += np.trunc((t - s) * step)
        else:
            for j in range(n):
                t = math.ldexp(np.float64(src[r, a + j]), e)
                for kk in range(k - 1):
                    s = np.trunc(t)
                    words[kk, base + j] += s
                    t = (t - s) * step
                words[k - 1, base + j] += np.trunc(t)

    @inline
    def join_into(words, base, k, n, step, e, out, o, pun):
        # out[o + j] = the value of words[:, base + j] times 2**e for j < n, rounded
        # to out's dtype: Horner in float64, then one multiply (or ldexp).
        if -1022 <= e <= 1023:
            f = power_of_two(e, pun)
            if k == 2:
                for j in range(n):
                    out[o + j] = (words[0, base + j] * step + words[1, base + j]) * f
            else:
                for j in range(n):
                    out[o + j] = ((words[0, base + j] * step + words[1, base + j]) * step
                                  + words[2, base + j]) * f
        else:
            for j in range(n):
                v = words[0, base + j] * step + words[1, base + j]
                if k == 3:
                    v = v * step + words[2, base + j]
                out[o + j] = math.ldexp(v, e)
    return SimpleNamespace(slice_into=slice_into, join_into=join_into)


def _numba_deposits(jit: Any, h: SimpleNamespace) -> SimpleNamespace:
    """The deposit of rows into the words (a vector is one row)."""
    # The jitted helpers as closure variables (Numba reads no attributes of h).
    bin_of_bits, chunk_bits, power_of_two = h.bin_of_bits, h.chunk_bits, h.power_of_two
    punning, slice_into = h.punning, h.slice_into
    empty, u = EMPTY_BIN, np.uint64     # unsigned indices: see _numba_helpers

    @jit
    def deposit_rows(rows, bits, mask, shift, inf, unit, starts, lengths, words, bins, top,
                     w):
        # deposit() of each row, a chunk at a time: the chunk's words stay in the
        # cache for all the rows. False (nothing deposited) on a non-finite value.
        nc = starts.size
        nrows = u(rows.shape[0])
        for c in range(nc):
            m = 0
            for r in range(nrows):
                v = chunk_bits(bits, r, mask, u(starts[c]), u(lengths[c]))
                if v > m:
                    m = v
            if (m >> shift) >= inf:
                return False
            top[c] = m
        k = words.shape[0]
        width = words.shape[2]
        pun = punning()
        step = power_of_two(w, pun)
        flat = words.reshape(k, -1)
        for c in range(nc):
            if top[c] == 0:
                continue
            new = bin_of_bits(top[c], shift, unit, w)
            old = bins[c]
            if new > old:
                if old != empty:
                    d = min(new - old, k)
                    for kk in range(k - 1, -1, -1):
                        for j in range(width):
                            words[kk, c, j] = words[kk - d, c, j] if kk >= d else 0.0
                bins[c] = new
            for r in range(nrows):
                slice_into(rows, r, u(starts[c]), u(lengths[c]), -bins[c] * w, step, flat,
                           u(c * width), k, pun)
        return True

    return SimpleNamespace(deposit_rows=deposit_rows)


def _numba_to_float(jit: Any, h: SimpleNamespace) -> SimpleNamespace:
    """Words back to floats."""
    # The jitted helpers as closure variables (Numba reads no attributes of h).
    power_of_two, punning, join_into = h.power_of_two, h.punning, h.join_into
    empty, u = EMPTY_BIN, np.uint64     # unsigned indices: see _numba_helpers

    @jit
    def to_float(words, bins, w, chunk, lo, hi, out):
        k = words.shape[0]
        pun = punning()
        step = power_of_two(w, pun)
        flat = words.reshape(k, -1)
        for c in range(lo // chunk, (hi - 1) // chunk + 1):
            j0 = max(lo - c * chunk, 0)
            j1 = min(hi - c * chunk, chunk)
            o = u(c * chunk + j0 - lo)
            b = bins[c]
            if b == empty:
                for j in range(u(j1 - j0)):
                    out[o + j] = 0.0
                continue
            join_into(flat, u(c * chunk + j0), k, u(j1 - j0), step, (b - k + 1) * w, out, o,
                      pun)

    return SimpleNamespace(to_float=to_float)


def _numba_exact_sum(jit: Any, h: SimpleNamespace) -> SimpleNamespace:
    """The exact sum of rows in one pass (a chunk's words kept in the cache)."""
    bin_of_bits, chunk_bits, power_of_two = h.bin_of_bits, h.chunk_bits, h.power_of_two
    punning, slice_into, join_into = h.punning, h.slice_into, h.join_into
    u = np.uint64

    @jit
    def exact_sum(rows, bits, mask, shift, inf, unit, starts, lengths, k, w, lo, hi, out):
        nrows = u(rows.shape[0])
        pun = punning()
        step = power_of_two(w, pun)
        width = max(1, lengths.max() if lengths.size else 1)
        acc = np.empty((k, width))       # one chunk's words
        zero = u(0)
        for c in range(starts.size):
            a, n = starts[c], lengths[c]
            if a + n <= lo or a >= hi:
                continue
            ua, un = u(a), u(n)
            m = 0
            for r in range(nrows):
                v = chunk_bits(bits, r, mask, ua, un)
                if v > m:
                    m = v
            if (m >> shift) >= inf:     # the first row holding a non-finite value
                for r in range(nrows):
                    if (chunk_bits(bits, r, mask, zero, u(bits.shape[1])) >> shift) >= inf:
                        return r
            i0, i1 = max(a, lo), min(a + n, hi)
            if m == 0:
                for i in range(u(i1 - i0)):
                    out[u(i0 - lo) + i] = 0.0
                continue
            b = bin_of_bits(m, shift, unit, w)
            for kk in range(k):
                for j in range(un):
                    acc[kk, j] = 0.0
            for r in range(nrows):
                slice_into(rows, r, ua, un, -b * w, step, acc, zero, k, pun)
            join_into(acc, u(i0 - a), k, u(i1 - i0), step, (b - k + 1) * w, out, u(i0 - lo),
                      pun)
        return -1

    return SimpleNamespace(exact_sum=exact_sum)


def _numba_squares(jit: Any, h: SimpleNamespace) -> SimpleNamespace:
    """A shard's squares summed into the norm's words."""
    power_of_two = h.power_of_two
    punning = h.punning

    @jit
    def square_words(x, e, w, out):
        # The slices of each rounded square at the bin of 2**-e, summed as integers
        # (each below 2**w: an int64 holds 2**(63 - w) of them; the integer sum
        # vectorises where a float one would keep its order).
        pun = punning()
        step = power_of_two(w, pun)
        inside = -1022 <= e <= 1023
        f = power_of_two(e, pun) if inside else 1.0
        s0 = 0
        s1 = 0
        s2 = 0
        for j in range(x.size):
            v = np.float64(x[j])
            t = v * v * f if inside else math.ldexp(v * v, e)
            s = np.trunc(t)
            s0 += np.int64(s)
            t = (t - s) * step
            s = np.trunc(t)
            s1 += np.int64(s)
            s2 += np.int64(np.trunc((t - s) * step))
        out[0] = s0
        out[1] = s1
        out[2] = s2

    return SimpleNamespace(square_words=square_words)


def _cuda() -> Any:
    """The CUDA kernels (`mpishard.kernels.deposit_cuda`; compiled by CuPy at
    their first launch)."""
    return deposit_cuda
