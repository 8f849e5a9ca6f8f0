"""The Numba kernels of `mpishard.kernels.deposit`: the binned sums on the CPU.

Imported only by `mpishard.kernels.deposit`, at the first fused call on NumPy
arrays (so ``import mpishard`` never imports Numba). The kernels are module-level
functions, compiled per argument types (a float32 and a float64 version each),
with ``cache=True``: the machine code is kept in ``__pycache__`` (or Numba's user
cache, or ``NUMBA_CACHE_DIR``, where that is not writable; where nothing is,
every process compiles), so only the first process on a machine compiles. They
close over nothing: a closure's cache key holds its cell contents (here other
kernels, whose identity differs in every process), so closures were compiled
again in every process and left new files in the cache each time.

The constants they read (`mpishard.reprosum.EMPTY_BIN`) are frozen into the
machine code; Numba invalidates its cache when this file changes, not when
``reprosum.py`` does (clear ``__pycache__`` after changing one). Pure: no MPI.
"""

from __future__ import annotations

import math

import numpy as np

from ..reprosum import EMPTY_BIN
from .select import import_numba

numba = import_numba()   # without Numba's colorama: no ESC[0m on stdout at exit

__all__ = ["deposit_rows", "exact_sum", "max_bits", "square_words", "to_float"]

_EMPTY = EMPTY_BIN       # the bin of a chunk holding no value
_U = np.uint64           # unsigned indices inside the per-chunk loops (see the helpers)


def _njit(**options):
    def decorate(fn):
        try:
            return numba.njit(cache=True, nogil=True, **options)(fn)
        except RuntimeError:  # "no locator available": nowhere writable to cache
            return numba.njit(nogil=True, **options)(fn)
    return decorate


_jit = _njit()
# Helpers are inlined into the kernels: no array views or calls per chunk.
_inline = _njit(inline="always")


# --------------------------------------------------------------------------- helpers
# The scalar helpers (inlined into the kernels) and ``max_bits``.
# In every kernel, indices inside the per-chunk loops are unsigned (np.uint64):
# a signed index makes Numba test it for wrap-around, which stops the loop from
# vectorising (5x slower). And no array views per chunk: each costs reference
# counting (atomics).

@_inline
def frexp_exponent(bits, shift, unit):
    # math.frexp(v)[1] of the non-negative float v whose bits are ``bits``.
    field = bits >> shift
    if field:
        return field + unit + shift
    return math.frexp(float(bits))[1] + unit


@_inline
def bin_of_bits(bits, shift, unit, w):
    if bits == 0:
        return _EMPTY
    return (frexp_exponent(bits, shift, unit) - 1) // w


@_jit
def max_bits(bits, mask):
    # IEEE floats without their sign order as their bits do: the largest
    # magnitude is an integer maximum (vectorised; NaN and inf come out on top).
    m = 0
    for j in range(bits.size):
        v = bits[j] & mask
        if v > m:
            m = v
    return m


@_inline
def chunk_bits(bits, r, mask, a, n):
    m = 0
    for j in range(n):
        v = bits[r, a + j] & mask
        if v > m:
            m = v
    return m


@_inline
def power_of_two(e, pun):
    # 2**e for -1022 <= e <= 1023 (a normal float64: exact), from its bits: a
    # call to ldexp per chunk cost 12 ns, a third of a float32 chunk's sum.
    # ``pun``: an int64 array of one element and its float64 view.
    pun[0][0] = (e + 1023) << 52
    return pun[1][0]


@_inline
def punning():
    bits = np.zeros(1, dtype=np.int64)
    return bits, bits.view(np.float64)


# --------------------------------------------------------------------------- slices
# A chunk of values into its K words, and K words back into values (inlined).

@_inline
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


@_inline
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


# --------------------------------------------------------------------------- deposit
# The deposit of rows into the words (a vector is one row).

@_jit
def deposit_rows(rows, bits, mask, shift, inf, unit, starts, lengths, words, bins, top,
                 w):
    # deposit() of each row, a chunk at a time: the chunk's words stay in the
    # cache for all the rows. False (nothing deposited) on a non-finite value.
    nc = starts.size
    nrows = _U(rows.shape[0])
    for c in range(nc):
        m = 0
        for r in range(nrows):
            v = chunk_bits(bits, r, mask, _U(starts[c]), _U(lengths[c]))
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
            if old != _EMPTY:
                d = min(new - old, k)
                for kk in range(k - 1, -1, -1):
                    for j in range(width):
                        words[kk, c, j] = words[kk - d, c, j] if kk >= d else 0.0
            bins[c] = new
        for r in range(nrows):
            slice_into(rows, r, _U(starts[c]), _U(lengths[c]), -bins[c] * w, step, flat,
                       _U(c * width), k, pun)
    return True


# --------------------------------------------------------------------------- to_float
# Words back to floats.

@_jit
def to_float(words, bins, w, chunk, lo, hi, out):
    k = words.shape[0]
    pun = punning()
    step = power_of_two(w, pun)
    flat = words.reshape(k, -1)
    for c in range(lo // chunk, (hi - 1) // chunk + 1):
        j0 = max(lo - c * chunk, 0)
        j1 = min(hi - c * chunk, chunk)
        o = _U(c * chunk + j0 - lo)
        b = bins[c]
        if b == _EMPTY:
            for j in range(_U(j1 - j0)):
                out[o + j] = 0.0
            continue
        join_into(flat, _U(c * chunk + j0), k, _U(j1 - j0), step, (b - k + 1) * w, out, o,
                  pun)


# --------------------------------------------------------------------------- exact_sum
# The exact sum of rows in one pass (a chunk's words kept in the cache).

@_jit
def exact_sum(rows, bits, mask, shift, inf, unit, starts, lengths, k, w, lo, hi, out):
    nrows = _U(rows.shape[0])
    pun = punning()
    step = power_of_two(w, pun)
    width = max(1, lengths.max() if lengths.size else 1)
    acc = np.empty((k, width))       # one chunk's words
    zero = _U(0)
    for c in range(starts.size):
        a, n = starts[c], lengths[c]
        if a + n <= lo or a >= hi:
            continue
        ua, un = _U(a), _U(n)
        m = 0
        for r in range(nrows):
            v = chunk_bits(bits, r, mask, ua, un)
            if v > m:
                m = v
        if (m >> shift) >= inf:     # the first row holding a non-finite value
            for r in range(nrows):
                if (chunk_bits(bits, r, mask, zero, _U(bits.shape[1])) >> shift) >= inf:
                    return r
        i0, i1 = max(a, lo), min(a + n, hi)
        if m == 0:
            for i in range(_U(i1 - i0)):
                out[_U(i0 - lo) + i] = 0.0
            continue
        b = bin_of_bits(m, shift, unit, w)
        for kk in range(k):
            for j in range(un):
                acc[kk, j] = 0.0
        for r in range(nrows):
            slice_into(rows, r, ua, un, -b * w, step, acc, zero, k, pun)
        join_into(acc, _U(i0 - a), k, _U(i1 - i0), step, (b - k + 1) * w, out, _U(i0 - lo),
                  pun)
    return -1


# --------------------------------------------------------------------------- squares
# A shard's squares summed into the norm's words.

@_jit
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
