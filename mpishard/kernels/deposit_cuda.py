"""The binned sums of `mpishard.kernels.deposit` as CUDA kernels, for CuPy arrays.

One thread block per chunk of `CHUNK` elements, one
thread per element: a block finds its chunk's largest magnitude (the integer
maximum of the values' bits, over every row), then each thread slices its
element of every row at the chunk's bin and adds the ``K`` slices in registers
(integers below ``2**53``: exact in any order). The arithmetic is the NumPy
twin's, operation for operation, in float64 (``--fmad=false``: no contraction
changes a rounding; the conversion's multiply by a power of two and its ``ldexp``
round as NumPy's), so the words, bins and results are the twin's bits.

``tests/unit/test_kernels_deposit.py``'s ``gpu`` test compares them with the twin
on a device (passed on an NVIDIA H100); ``tests/unit/test_kernels_deposit_emulated.py``
runs this source on the CPU (threads for a block's threads) against the twin.
Reached where [`mpishard.kernels.select.fused_on`][mpishard.kernels.select.fused_on] says so for
CuPy arrays (by default; ``MPISHARD_GPU_KERNELS=0`` turns them off). Pure: no MPI; CuPy is
never imported here, its arrays bring their module.
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
)

__all__ = ["SOURCE", "deposit", "deposit_rows", "exact_sum", "kernel_source", "square_words",
           "to_float"]

#: Threads of a block of `square_words`.
_SQUARE_THREADS = 256
#: The most blocks `square_words` launches (each thread takes every
#: ``blocks * threads``-th element).
_SQUARE_BLOCKS = 1024

SOURCE = r"""
typedef __TYPE__ T;
#define MS_SHIFT __SHIFT__
#define MS_INF __INF__LL
#define MS_UNIT __UNIT__
#define MS_EMPTY (-(1LL << 20))

__device__ __forceinline__ long long ms_bits(float v) {
    return (long long)(__float_as_int(v) & 0x7fffffff);
}
__device__ __forceinline__ long long ms_bits(double v) {
    return __double_as_longlong(v) & 0x7fffffffffffffffLL;
}

__device__ int ms_bit_length(unsigned long long v) {
    int p = 0;
    while (v) { v >>= 1; ++p; }
    return p;
}

// frexp's exponent of the float whose magnitude bits are m > 0 (a subnormal's
// from its bit length).
__device__ long long ms_exponent(long long m) {
    const long long field = m >> MS_SHIFT;
    return field ? field + MS_UNIT + MS_SHIFT : ms_bit_length((unsigned long long)m) + MS_UNIT;
}

__device__ long long ms_floordiv(long long a, long long b) {
    const long long q = a / b;
    return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}

// reprosum.bin_of of the magnitude whose bits are m.
__device__ long long ms_bin(long long m, int w) {
    return m == 0 ? MS_EMPTY : ms_floordiv(ms_exponent(m) - 1, w);
}

// 2**e for -1022 <= e <= 1023, from its bits.
__device__ __forceinline__ double ms_pow2(long long e) {
    return __longlong_as_double((e + 1023) << 52);
}

// v * 2**e, rounded once (as NumPy's multiply by a normal power of two or ldexp).
__device__ __forceinline__ double ms_scale(double v, long long e) {
    return (e >= -1022 && e <= 1023) ? v * ms_pow2(e) : ldexp(v, (int)e);
}

// The largest v over the block (blockDim.x a power of two); sh: blockDim.x values.
__device__ long long ms_block_max(long long v, long long* sh) {
    const int t = threadIdx.x;
    sh[t] = v;
    __syncthreads();
    for (int s = blockDim.x >> 1; s > 0; s >>= 1) {
        if (t < s && sh[t + s] > sh[t]) sh[t] = sh[t + s];
        __syncthreads();
    }
    const long long r = sh[0];
    __syncthreads();            // sh is written again by the next call
    return r;
}

// The largest magnitude's bits over the rows of element j of chunk c.
__device__ long long ms_element_top(const T* __restrict__ rows, long long nrows, long long ncols,
                                    long long a, long long n, int j) {
    long long m = 0;
    if (j < n)
        for (long long r = 0; r < nrows; ++r) {
            const long long v = ms_bits(rows[r * ncols + a + j]);
            m = v > m ? v : m;
        }
    return m;
}

// The slices of rows[:, i] at bin b, summed over the rows into s[0..k).
__device__ void ms_slices(const T* __restrict__ rows, long long nrows, long long ncols,
                          long long i, long long b, int k, int w, double* s) {
    const double step = ms_pow2(w);
    const long long e = -b * w;
    s[0] = s[1] = s[2] = 0.0;
    for (long long r = 0; r < nrows; ++r) {
        double t = ms_scale((double)rows[r * ncols + i], e);
        double q = trunc(t);
        s[0] += q;
        t = (t - q) * step;
        if (k == 2) {
            s[1] += trunc(t);
        } else {
            q = trunc(t);
            s[1] += q;
            t = (t - q) * step;
            s[2] += trunc(t);
        }
    }
}

// Words top first (Horner in float64) times 2**((b - k + 1) * w), to T.
__device__ __forceinline__ T ms_join(double w0, double w1, double w2, long long b, int k, int w) {
    const double step = ms_pow2(w);
    double v = w0 * step + w1;
    if (k == 3) v = v * step + w2;
    return (T)ms_scale(v, (b - k + 1) * w);
}

// Pass 1 of a deposit: each chunk's largest magnitude over the rows (bits) into
// top[c]; *bad = 1 where one is not finite.
extern "C" __global__ void ms_chunk_top(
        const T* __restrict__ rows, const long long nrows, const long long ncols,
        const long long* __restrict__ starts, const long long* __restrict__ lengths,
        long long* __restrict__ top, int* __restrict__ bad) {
    __shared__ long long sh[1024];
    const long long c = blockIdx.x;
    const long long m = ms_block_max(
        ms_element_top(rows, nrows, ncols, starts[c], lengths[c], threadIdx.x), sh);
    if (threadIdx.x == 0) {
        top[c] = m;
        if ((m >> MS_SHIFT) >= MS_INF) *bad = 1;
    }
}

// Pass 2: raise each chunk's bin to its top's (moving the words down, dropping
// the lowest), then add every row's slices. words: k planes of `plane` doubles,
// chunk c's element j at c * blockDim.x + j.
extern "C" __global__ void ms_deposit(
        const T* __restrict__ rows, const long long nrows, const long long ncols,
        const long long* __restrict__ starts, const long long* __restrict__ lengths,
        const long long* __restrict__ top, double* __restrict__ words,
        long long* __restrict__ bins, const long long plane, const int k, const int w) {
    const long long c = blockIdx.x;
    const int j = threadIdx.x;
    const long long m = top[c];
    if (m == 0) return;             // zeros: nothing to add, the bin stays (whole block)
    const long long old = bins[c];
    const long long nb = ms_bin(m, w);
    double* wc = words + c * (long long)blockDim.x + j;
    if (nb > old && old != MS_EMPTY) {
        const long long d = nb - old < k ? nb - old : k;
        for (int kk = k - 1; kk >= 0; --kk)
            wc[kk * plane] = kk >= d ? wc[(kk - d) * plane] : 0.0;
    }
    __syncthreads();                // every thread has read bins[c]
    const long long b = nb > old ? nb : old;
    if (j == 0) bins[c] = b;
    if (j >= lengths[c]) return;
    double s[3];
    ms_slices(rows, nrows, ncols, starts[c] + j, b, k, w, s);
    wc[0] += s[0];
    wc[plane] += s[1];
    if (k == 3) wc[2 * plane] += s[2];
}

// Elements [plo, plo + count) of the padded words, converted into out.
extern "C" __global__ void ms_to_float(
        const double* __restrict__ words, const long long* __restrict__ bins,
        const long long plane, const int k, const int w, const int chunk,
        const long long plo, const long long count, T* __restrict__ out) {
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= count) return;
    const long long p = plo + i;
    const long long b = bins[p / chunk];
    out[i] = b == MS_EMPTY ? (T)0 : ms_join(words[p], words[plane + p],
                                             k == 3 ? words[2 * plane + p] : 0.0, b, k, w);
}

// The binned sum of the rows, chunk c0 + blockIdx.x, its elements in [lo, hi)
// into out[i - lo]: the words stay in registers. *bad = 1 on a non-finite value.
extern "C" __global__ void ms_exact_sum(
        const T* __restrict__ rows, const long long nrows, const long long ncols,
        const long long* __restrict__ starts, const long long* __restrict__ lengths,
        const long long c0, const int k, const int w, const long long lo, const long long hi,
        T* __restrict__ out, int* __restrict__ bad) {
    __shared__ long long sh[1024];
    const long long c = c0 + blockIdx.x;
    const long long a = starts[c], n = lengths[c];
    const int j = threadIdx.x;
    const long long m = ms_block_max(ms_element_top(rows, nrows, ncols, a, n, j), sh);
    if ((m >> MS_SHIFT) >= MS_INF) {
        if (j == 0) *bad = 1;
        return;
    }
    const long long i = a + j;
    if (j >= n || i < lo || i >= hi) return;
    if (m == 0) {
        out[i - lo] = (T)0;
        return;
    }
    const long long b = ms_bin(m, w);
    double s[3];
    ms_slices(rows, nrows, ncols, i, b, k, w, s);
    out[i - lo] = ms_join(s[0], s[1], s[2], b, k, w);
}

// The 3 words of sum(x**2) at the bin of 2**-e (each square rounded to float64),
// added into out[0..3) as integers (slices below 2**w; 2**(63 - w) of them fit).
extern "C" __global__ void ms_square_words(
        const T* __restrict__ x, const long long n, const long long e, const int w,
        unsigned long long* __restrict__ out) {
    __shared__ long long sh[1024];
    const double step = ms_pow2(w);
    long long s0 = 0, s1 = 0, s2 = 0;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const double v = (double)x[i];
        double t = ms_scale(v * v, e);
        double q = trunc(t);
        s0 += (long long)q;
        t = (t - q) * step;
        q = trunc(t);
        s1 += (long long)q;
        s2 += (long long)trunc((t - q) * step);
    }
    long long part[3] = {s0, s1, s2};
    for (int kk = 0; kk < 3; ++kk) {        // a block sum in shared memory, then one atomic
        sh[threadIdx.x] = part[kk];
        __syncthreads();
        for (int s = blockDim.x >> 1; s > 0; s >>= 1) {
            if (threadIdx.x < s) sh[threadIdx.x] += sh[threadIdx.x + s];
            __syncthreads();
        }
        if (threadIdx.x == 0) atomicAdd(out + kk, (unsigned long long)sh[0]);
        __syncthreads();
    }
}
"""

# Per float type: C type, exponent shift, exponent field of inf/NaN, subnormal unit.
_TYPES = {"float32": ("float", 23, 0xFF, -149), "float64": ("double", 52, 0x7FF, -1074)}
_KERNELS: dict[tuple[int, str, str], Any] = {}


def kernel_source(dtype: Any) -> str:
    """`SOURCE` for float ``dtype`` (float32 or float64)."""
    ctype, shift, inf, unit = _TYPES[np.dtype(dtype).name]
    return (SOURCE.replace("__TYPE__", ctype).replace("__SHIFT__", str(shift))
            .replace("__INF__", str(inf)).replace("__UNIT__", str(unit)))


def _kernel(xp: Any, name: str, dtype: Any) -> Any:
    """The RawKernel ``name`` for ``dtype``, made once (compiled at its first launch)."""
    key = (id(xp), name, np.dtype(dtype).name)
    kernel = _KERNELS.get(key)
    if kernel is None:
        kernel = _KERNELS[key] = xp.RawKernel(kernel_source(dtype), name,
                                              options=("--fmad=false",))
    return kernel


def _on_device(grid: ChunkGrid, xp: Any) -> tuple[Any, Any]:
    """The grid's chunk starts and lengths on the device (copied once)."""
    key = ("device", id(xp))
    pair = grid.kernel_scratch.get(key)
    if pair is None:
        pair = grid.kernel_scratch[key] = (xp.asarray(grid.starts), xp.asarray(grid.lengths))
    return pair


def _scratch(acc: BinnedAccumulator) -> tuple[Any, Any]:
    """Per chunk the top's bits, and the non-finite flag, on the device."""
    pair = acc.kernel_scratch.get("device")
    if pair is None:
        xp = acc.xp
        pair = acc.kernel_scratch["device"] = (xp.zeros(max(acc.main_chunks, 1), dtype=np.int64),
                                               xp.zeros(1, dtype=np.int32))
    return pair


def deposit_rows(acc: BinnedAccumulator, rows: Any) -> bool:
    """Deposit every row of ``rows`` (``(R, acc.size)``); False, depositing
    nothing, where a value is not finite. Two launches and one flag read."""
    xp = acc.xp
    rows = xp.ascontiguousarray(rows)
    chunks = acc.main_chunks
    if chunks == 0 or rows.shape[0] == 0:
        return True
    starts, lengths = _on_device(acc.grid, xp)
    top, bad = _scratch(acc)
    bad.fill(0)
    nrows, ncols = np.int64(rows.shape[0]), np.int64(rows.shape[1])
    _kernel(xp, "ms_chunk_top", rows.dtype)((chunks,), (acc.chunk,),
                                            (rows, nrows, ncols, starts, lengths, top, bad))
    if int(bad[0]):
        return False
    plane = np.int64(acc.words.shape[1] * acc.chunk)
    _kernel(xp, "ms_deposit", rows.dtype)(
        (chunks,), (acc.chunk,), (rows, nrows, ncols, starts, lengths, top, acc.words,
                                  acc.bins, plane, np.int32(acc.k), np.int32(acc.word_bits)))
    return True


def deposit(acc: BinnedAccumulator, source: Any) -> bool:
    """Deposit one vector (`deposit_rows` of one row)."""
    return deposit_rows(acc, source.reshape(1, -1))


def to_float(acc: BinnedAccumulator, plo: int, phi: int, out: Any) -> None:
    """Padded elements ``[plo, phi)`` of the sum into ``out``."""
    count = phi - plo
    if count <= 0:
        return
    threads = 256
    plane = np.int64(acc.words.shape[1] * acc.chunk)
    _kernel(acc.xp, "ms_to_float", out.dtype)(
        ((count + threads - 1) // threads,), (threads,),
        (acc.words, acc.bins, plane, np.int32(acc.k), np.int32(acc.word_bits),
         np.int32(acc.chunk), np.int64(plo), np.int64(count), out))


def exact_sum(grid: ChunkGrid, rows: Any, out: Any, lo: int, hi: int, k: int) -> int:
    """The binned sum of the rows, elements ``[lo, hi)`` into ``out``; -1, or the
    first row holding a non-finite value."""
    xp = array_namespace(rows)
    rows = xp.ascontiguousarray(rows)
    c0, c1 = (int(v) for v in np.searchsorted(grid.starts, [lo, hi], side="right"))
    c0 = max(c0 - 1, 0)             # the chunk holding lo
    if hi <= lo or c1 <= c0:
        return -1
    starts, lengths = _on_device(grid, xp)
    key = ("bad", id(xp))
    bad = grid.kernel_scratch.get(key)
    if bad is None:
        bad = grid.kernel_scratch[key] = xp.zeros(1, dtype=np.int32)
    bad.fill(0)
    _kernel(xp, "ms_exact_sum", rows.dtype)(
        (c1 - c0,), (grid.chunk,),
        (rows, np.int64(rows.shape[0]), np.int64(rows.shape[1]), starts, lengths,
         np.int64(c0), np.int32(k), np.int32(WORD_BITS), np.int64(lo), np.int64(hi), out, bad))
    if not int(bad[0]):
        return -1
    finite = xp.isfinite(rows).all(axis=1)
    return int(xp.argmin(finite))       # the first row that is not all finite


def square_words(x: Any, top_bin: int) -> list[float]:
    """The `NORM_WORDS` words of ``sum(x**2)`` at bin
    ``top_bin`` (not empty), as ``fixed_bin_sum(..., square=True)`` gives them."""
    xp = array_namespace(x)
    flat = xp.ascontiguousarray(x.reshape(-1))
    out = xp.zeros(NORM_WORDS, dtype=np.uint64)
    if top_bin != EMPTY_BIN and flat.size:
        blocks = min(_SQUARE_BLOCKS, -(-flat.size // _SQUARE_THREADS))
        _kernel(xp, "ms_square_words", flat.dtype)(
            (blocks,), (_SQUARE_THREADS,),
            (flat, np.int64(flat.size), np.int64(-top_bin * NORM_WORD_BITS),
             np.int32(NORM_WORD_BITS), out))
    words = out.view(np.int64)
    return [float(int(words[k])) for k in range(NORM_WORDS)]
