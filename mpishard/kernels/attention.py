"""Causal self-attention as one kernel pair: a fused forward and its backward.

``out = softmax(mask(scale * q k^T)) v`` per head, with query ``i`` seeing keys
``j <= i``. The arrays are token-major ``(batch, tokens, heads, head_dim)``: the
layout of a ``(batch * tokens, heads * head_dim)`` projection, so
[`CausalSelfAttention`][mpishard.nn.CausalSelfAttention] passes its projections
and its context buffer as they are, without head-major copies.

The CUDA forward is flash-attention's: a block takes ``ROWS`` queries of one head
and walks the keys in tiles of 32 (one a lane), keeping each row's running maximum,
sum and weighted sum of values (online softmax), so the ``(tokens, tokens)``
scores are never stored; it saves each row's log-sum-exp for the backward. The
backward recomputes the probabilities tile by tile from it, in two kernels that
add in a fixed order (no atomics, the same bits in every run): one block per
query tile for ``dq`` (it also writes ``delta = rowsum(dout * out)``), then one
per key tile for ``dk`` and ``dv``. Products on CUDA cores, float32 or float64
(no tensor cores: ``tf32`` does not apply here); compiled by NVRTC at the first
call, with multiply-adds contracted.

The NumPy twin (same signature) materialises the scores and the softmax: it is
the kernels' reference and their fallback (it allocates; the layer's own NumPy
path is its older chain of calls into preallocated buffers). Which runs is
[`attention_fused_on`][mpishard.kernels.attention.attention_fused_on]'s choice:
the CuPy kernels when the fused kernels are on
([`fused_on`][mpishard.kernels.select.fused_on]), ``MPISHARD_GPU_ATTENTION`` is not
``0`` and a block's tiles fit 48 KiB of shared memory (``head_dim`` up to 64 in
float64, 128 in float32 at least). Pure: no MPI.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ..backend import array_namespace
from .cuda_device import WARP_FUNCTIONS
from .select import fused_on

__all__ = [
    "SHARED_BYTES",
    "THREADS",
    "attention_fused_on",
    "causal_attention",
    "causal_attention_backward",
    "kernel_source",
    "rows_per_warp",
]

#: Threads of a block: 4 warps.
THREADS = 128
#: Static shared memory a block may use (the CUDA limit without opting in).
SHARED_BYTES = 48 * 1024
_WARPS = THREADS // 32
_TILE = 32
_KERNELS = ("ms_attention_fwd", "ms_attention_bwd_dq", "ms_attention_bwd_dkdv")


def _shared_bytes(name: str, itemsize: int, head_dim: int, rpw: int) -> int:
    """Shared memory of kernel ``name`` (the arrays its source declares)."""
    rows, hd, pad = _WARPS * rpw, head_dim, head_dim + 1
    values = {
        "ms_attention_fwd": rows * hd + _TILE * pad + _TILE * hd + rows * _TILE,
        "ms_attention_bwd_dq": 2 * rows * hd + 2 * _TILE * pad + rows * _TILE,
        "ms_attention_bwd_dkdv": 2 * rows * hd + 2 * _TILE * pad + 2 * rows * _TILE + 2 * _TILE,
    }[name]
    return values * itemsize


def rows_per_warp(name: str, dtype: Any, head_dim: int) -> int | None:
    """Rows a warp of kernel ``name`` takes (4, 2 or 1: the most whose tiles fit
    `SHARED_BYTES`), or None when not even one does."""
    itemsize = np.dtype(dtype).itemsize
    for rpw in (4, 2, 1):
        if _shared_bytes(name, itemsize, head_dim, rpw) <= SHARED_BYTES:
            return rpw
    return None


def _attention_opted_in() -> bool:
    return os.environ.get("MPISHARD_GPU_ATTENTION", "1").strip() not in ("", "0")


def attention_fused_on(xp: Any, dtype: Any, head_dim: int) -> bool:
    """True when [`causal_attention`][mpishard.kernels.attention.causal_attention] and its
    backward run the CUDA kernels for arrays of ``xp``, ``dtype`` and ``head_dim``."""
    if xp is np or not fused_on(xp) or not _attention_opted_in():
        return False
    if np.dtype(dtype).name not in ("float32", "float64") or head_dim < 1:
        return False
    return all(rows_per_warp(name, dtype, head_dim) is not None for name in _KERNELS)


def _check(q: Any, k: Any, v: Any, out: Any, lse: Any) -> tuple[int, int, int, int]:
    if q.ndim != 4 or k.shape != q.shape or v.shape != q.shape or out.shape != q.shape:
        raise ValueError(f"expecting q, k, v and out of one shape (batch, tokens, heads, "
                         f"head_dim), got {q.shape}, {k.shape}, {v.shape}, {out.shape}")
    b, t, h, hd = q.shape
    if tuple(lse.shape) != (b, h, t):
        raise ValueError(f"expecting lse of shape {(b, h, t)}, got {tuple(lse.shape)}")
    return b, t, h, hd


def _fused(xp: Any, arrays: tuple[Any, ...], head_dim: int) -> bool:
    dtype = arrays[0].dtype
    return (attention_fused_on(xp, dtype, head_dim)
            and all(a.dtype == dtype and a.flags.c_contiguous for a in arrays))


def causal_attention(q: Any, k: Any, v: Any, scale: float, out: Any, lse: Any) -> Any:
    """``out = softmax(mask(scale * q k^T)) v`` by head, query ``i`` seeing keys
    ``j <= i``; ``lse`` ``(batch, heads, tokens)`` gets each row's log-sum-exp of
    the scaled scores (the backward's input). ``q``, ``k``, ``v``, ``out``:
    ``(batch, tokens, heads, head_dim)``. Returns ``out``. Local.

    Raises:
        ValueError: shapes that do not match.
    """
    xp = _namespace(out)
    b, t, h, hd = _check(q, k, v, out, lse)
    if _fused(xp, (q, k, v, out, lse), hd):
        if q.size:
            kernel, rows = _kernel(xp, "ms_attention_fwd", out.dtype, hd)
            kernel((-(-t // rows) * b * h,), (THREADS,),
                   (q, k, v, out, lse, np.int32(t), np.int32(h), out.dtype.type(scale)))
        return out
    qh, kh, vh = (a.transpose(0, 2, 1, 3) for a in (q, k, v))
    s = xp.matmul(qh, kh.transpose(0, 1, 3, 2)) * scale
    s = xp.where(xp.triu(xp.ones((t, t), dtype=bool), 1), -np.inf, s)
    m = xp.max(s, axis=-1, keepdims=True) if t else xp.zeros(s.shape[:-1] + (1,), s.dtype)
    e = xp.exp(s - m)
    z = xp.sum(e, axis=-1, keepdims=True)
    out[...] = xp.matmul(e / z, vh).transpose(0, 2, 1, 3)
    lse[...] = (m + xp.log(z))[..., 0]
    return out


def causal_attention_backward(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any,
                              scale: float, dq: Any, dk: Any, dv: Any,
                              delta: Any) -> tuple[Any, Any, Any]:
    """The gradients of [`causal_attention`][mpishard.kernels.attention.causal_attention]
    for ``dout``, from its ``out`` and ``lse``: ``p = exp(scale q k^T - lse)``
    (masked), ``ds = p (dout v^T - delta)`` with ``delta = rowsum(dout * out)``
    (written to ``delta``, ``(batch, heads, tokens)``), ``dq = scale ds k``,
    ``dk = scale ds^T q``, ``dv = p^T dout``. All of ``(batch, tokens, heads,
    head_dim)`` but ``lse`` and ``delta``. Returns ``(dq, dk, dv)``. Local.

    Raises:
        ValueError: shapes that do not match.
    """
    xp = _namespace(dq)
    b, t, h, hd = _check(q, k, v, out, lse)
    for name, a in (("dout", dout), ("dq", dq), ("dk", dk), ("dv", dv)):
        if a.shape != q.shape:
            raise ValueError(f"expecting {name} of shape {q.shape}, got {a.shape}")
    if tuple(delta.shape) != tuple(lse.shape):
        raise ValueError(f"expecting delta of shape {lse.shape}, got {delta.shape}")
    if _fused(xp, (dout, q, k, v, out, lse, dq, dk, dv, delta), hd):
        if q.size:
            args = (np.int32(t), np.int32(h), dq.dtype.type(scale))
            kernel, rows = _kernel(xp, "ms_attention_bwd_dq", dq.dtype, hd)
            kernel((-(-t // rows) * b * h,), (THREADS,), (q, k, v, out, dout, lse, delta, dq)
                   + args)
            kernel, rows = _kernel(xp, "ms_attention_bwd_dkdv", dq.dtype, hd)
            kernel((-(-t // rows) * b * h,), (THREADS,), (q, k, v, dout, lse, delta, dk, dv)
                   + args)
        return dq, dk, dv
    qh, kh, vh, oh = (a.transpose(0, 2, 1, 3) for a in (q, k, v, dout))
    s = xp.matmul(qh, kh.transpose(0, 1, 3, 2)) * scale
    p = xp.where(xp.triu(xp.ones((t, t), dtype=bool), 1), 0, xp.exp(s - lse[..., None]))
    delta[...] = xp.sum(dout * out, axis=-1).transpose(0, 2, 1)
    ds = p * (xp.matmul(oh, vh.transpose(0, 1, 3, 2)) - delta[..., None])
    dq[...] = (xp.matmul(ds, kh) * scale).transpose(0, 2, 1, 3)
    dk[...] = (xp.matmul(ds.transpose(0, 1, 3, 2), qh) * scale).transpose(0, 2, 1, 3)
    dv[...] = xp.matmul(p.transpose(0, 1, 3, 2), oh).transpose(0, 2, 1, 3)
    return dq, dk, dv


# --- the CUDA side ----------------------------------------------------------------------

def _namespace(a: Any) -> Any:
    """``numpy`` or the module of ``a`` (CuPy), without importing CuPy."""
    return np if isinstance(a, np.ndarray) else array_namespace(a)


def kernel_source(dtype: Any, head_dim: int, rpw: int) -> str:
    """The CUDA source for ``dtype``, ``head_dim`` and ``rpw`` rows a warp."""
    ctype = {"float32": "float", "float64": "double"}.get(np.dtype(dtype).name)
    if ctype is None:
        raise TypeError(f"expecting float32 or float64 arrays, got {np.dtype(dtype)}")
    return (_SOURCE.replace("__TYPE__", ctype).replace("__HD__", str(int(head_dim)))
            .replace("__RPW__", str(int(rpw))))


# The three kernels share the layout: a block of 4 warps takes ROWS = 4 * RPW rows
# (queries, or keys for dk/dv) of one (batch, head); the other side walks in
# tiles of 32, one a lane. Blocks are numbered tile-fastest within a head.
_SOURCE = r"""
typedef __TYPE__ T;
""" + WARP_FUNCTIONS + r"""
#define HD __HD__
#define RPW __RPW__
#define ROWS (4 * RPW)
#define TILE 32
#define DW ((HD + 31) / 32)

__device__ __forceinline__ float ms_ninf(float) { return __int_as_float((int)0xff800000u); }
__device__ __forceinline__ double ms_ninf(double) {
    return __longlong_as_double((long long)0xfff0000000000000ull);
}

// Where row i of head bh % heads of batch bh / heads starts in (batch, t, heads, HD).
__device__ __forceinline__ long long row_at(int bh, int heads, int t, int i) {
    const long long b = bh / heads, h = bh % heads;
    return ((b * t + i) * heads + h) * HD;
}

__device__ __forceinline__ int clamp_row(int i, int t) { return i < t ? i : t - 1; }

// Rows [r0, r0 + N) of head bh of a and of b (clamped to t - 1) into sa and sb, by
// the block's threads. WA, WB: the shared arrays' row lengths (HD, or HD + 1 padded).
template <int N, int WA, int WB>
__device__ __forceinline__ void load_rows(T (*sa)[WA], T (*sb)[WB], const T* __restrict__ a,
        const T* __restrict__ b, const int bh, const int heads, const int t, const int r0) {
    for (int e = threadIdx.x; e < N * HD; e += blockDim.x) {
        const long long at = row_at(bh, heads, t, clamp_row(r0 + e / HD, t)) + e % HD;
        sa[e / HD][e % HD] = a[at];
        sb[e / HD][e % HD] = b[at];
    }
}

// acc[r][c] += sum over the tile's j of w[warp * RPW + r][j] * s[j][d], d = lane + 32 c
// (columns < HD): the warp's rows times a tile of 32 rows in shared memory.
template <int W>
__device__ __forceinline__ void accumulate(T (&acc)[RPW][DW], T (*w)[TILE], T (*s)[W],
        const int warp, const int lane) {
    for (int j = 0; j < TILE; ++j) {
        for (int c = 0; c < DW; ++c) {
            const int d = lane + 32 * c;
            if (d >= HD) continue;
            const T sd = s[j][d];
            for (int r = 0; r < RPW; ++r) acc[r][c] += w[warp * RPW + r][j] * sd;
        }
    }
}

// Forward: queries [q0, q0 + ROWS) of head bh, keys in tiles of 32 up to the last
// query; warp w owns rows w * RPW + r, lane j key k0 + j of the tile and the
// columns lane + 32 c of the rows' outputs. Rows past t compute row t - 1 and
// are not written.
extern "C" __global__ void ms_attention_fwd(
        const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
        T* __restrict__ out, T* __restrict__ lse, const int t, const int heads,
        const T scale) {
    __shared__ T sq[ROWS][HD];
    __shared__ T sk[TILE][HD + 1];      // padded: lane j reads row j, column d
    __shared__ T sv[TILE][HD];
    __shared__ T sp[ROWS][TILE];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int tiles = (t + ROWS - 1) / ROWS;
    const int bh = blockIdx.x / tiles;
    const int q0 = (tiles - 1 - (int)(blockIdx.x % tiles)) * ROWS;   // longest first
    const int last = clamp_row(q0 + ROWS - 1, t);
    for (int e = threadIdx.x; e < ROWS * HD; e += blockDim.x) {
        sq[e / HD][e % HD] = q[row_at(bh, heads, t, clamp_row(q0 + e / HD, t)) + e % HD];
    }
    T m[RPW], l[RPW], acc[RPW][DW];
    for (int r = 0; r < RPW; ++r) {
        m[r] = ms_ninf((T)0);
        l[r] = 0;
        for (int c = 0; c < DW; ++c) acc[r][c] = 0;
    }
    for (int k0 = 0; k0 <= last; k0 += TILE) {
        __syncthreads();            // every warp is done with the previous tile
        load_rows<TILE>(sk, sv, k, v, bh, heads, t, k0);
        __syncthreads();
        const int key = k0 + lane;
        T s[RPW];                       // the warp's rows' scores for this lane's key
        for (int r = 0; r < RPW; ++r) s[r] = 0;
        for (int d = 0; d < HD; ++d) {
            const T kd = sk[lane][d];   // read once for the RPW rows
            for (int r = 0; r < RPW; ++r) s[r] += sq[warp * RPW + r][d] * kd;
        }
        for (int r = 0; r < RPW; ++r) {
            const int row = warp * RPW + r, i = clamp_row(q0 + row, t);
            const T sr = s[r] * scale;
            const bool seen = key <= i;
            // Key 0 is seen by every row: the maximum is finite from the first tile.
            const T mt = warp_max(seen ? sr : ms_ninf(sr));
            const T mn = mt > m[r] ? mt : m[r];
            const T alpha = ms_exp(m[r] - mn);
            const T p = seen ? ms_exp(sr - mn) : (T)0;
            l[r] = l[r] * alpha + p;               // this lane's part of the row's sum
            for (int c = 0; c < DW; ++c) acc[r][c] *= alpha;
            m[r] = mn;
            sp[row][lane] = p;
        }
        __syncwarp();
        accumulate(acc, sp, sv, warp, lane);
    }
    for (int r = 0; r < RPW; ++r) {
        const int row = warp * RPW + r, i = q0 + row;
        const T total = warp_sum(l[r]);
        if (i < t) {
            const long long at = row_at(bh, heads, t, i);
            for (int c = 0; c < DW; ++c) {
                const int d = lane + 32 * c;
                if (d < HD) out[at + d] = acc[r][c] / total;
            }
            if (lane == 0) lse[(long long)bh * t + i] = m[r] + ms_log(total);
        }
    }
}

// Backward, dq: queries [q0, q0 + ROWS) of head bh, as the forward; also writes
// delta = rowsum(dout * out), which the dk/dv kernel reads.
extern "C" __global__ void ms_attention_bwd_dq(
        const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
        const T* __restrict__ out, const T* __restrict__ dout, const T* __restrict__ lse,
        T* __restrict__ delta, T* __restrict__ dq, const int t, const int heads,
        const T scale) {
    __shared__ T sq[ROWS][HD];
    __shared__ T sdo[ROWS][HD];
    __shared__ T sk[TILE][HD + 1];
    __shared__ T sv[TILE][HD + 1];
    __shared__ T sds[ROWS][TILE];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int tiles = (t + ROWS - 1) / ROWS;
    const int bh = blockIdx.x / tiles;
    const int q0 = (tiles - 1 - (int)(blockIdx.x % tiles)) * ROWS;
    const int last = clamp_row(q0 + ROWS - 1, t);
    load_rows<ROWS>(sq, sdo, q, dout, bh, heads, t, q0);
    T lrow[RPW], drow[RPW], acc[RPW][DW];
    for (int r = 0; r < RPW; ++r) {
        const int row = warp * RPW + r, i = clamp_row(q0 + row, t);
        const long long at = row_at(bh, heads, t, i);
        T a = 0;
        for (int c = 0; c < DW; ++c) {
            const int d = lane + 32 * c;
            if (d < HD) a += dout[at + d] * out[at + d];
        }
        drow[r] = warp_sum(a);
        lrow[r] = lse[(long long)bh * t + i];
        if (lane == 0 && q0 + row < t) delta[(long long)bh * t + i] = drow[r];
        for (int c = 0; c < DW; ++c) acc[r][c] = 0;
    }
    for (int k0 = 0; k0 <= last; k0 += TILE) {
        __syncthreads();
        load_rows<TILE>(sk, sv, k, v, bh, heads, t, k0);
        __syncthreads();
        const int key = k0 + lane;
        T s[RPW], dp[RPW];
        for (int r = 0; r < RPW; ++r) s[r] = dp[r] = 0;
        for (int d = 0; d < HD; ++d) {
            const T kd = sk[lane][d], vd = sv[lane][d];
            for (int r = 0; r < RPW; ++r) {
                s[r] += sq[warp * RPW + r][d] * kd;
                dp[r] += sdo[warp * RPW + r][d] * vd;
            }
        }
        for (int r = 0; r < RPW; ++r) {
            const int row = warp * RPW + r, i = clamp_row(q0 + row, t);
            const T p = key <= i ? ms_exp(s[r] * scale - lrow[r]) : (T)0;
            sds[row][lane] = p * (dp[r] - drow[r]);
        }
        __syncwarp();
        accumulate(acc, sds, sk, warp, lane);
    }
    for (int r = 0; r < RPW; ++r) {
        const int i = q0 + warp * RPW + r;
        if (i >= t) continue;
        const long long at = row_at(bh, heads, t, i);
        for (int c = 0; c < DW; ++c) {
            const int d = lane + 32 * c;
            if (d < HD) dq[at + d] = acc[r][c] * scale;
        }
    }
}

// Backward, dk and dv: keys [j0, j0 + ROWS) of head bh; queries from the tile
// holding j0 to the end, in tiles of 32 (lane i: query i0 + i).
extern "C" __global__ void ms_attention_bwd_dkdv(
        const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
        const T* __restrict__ dout, const T* __restrict__ lse, const T* __restrict__ delta,
        T* __restrict__ dk, T* __restrict__ dv, const int t, const int heads,
        const T scale) {
    __shared__ T sk[ROWS][HD];
    __shared__ T sv[ROWS][HD];
    __shared__ T sq[TILE][HD + 1];
    __shared__ T sdo[TILE][HD + 1];
    __shared__ T sp[ROWS][TILE];
    __shared__ T sds[ROWS][TILE];
    __shared__ T sl[TILE];
    __shared__ T sd[TILE];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int tiles = (t + ROWS - 1) / ROWS;
    const int bh = blockIdx.x / tiles;
    const int j0 = (int)(blockIdx.x % tiles) * ROWS;      // the first keys: most queries
    load_rows<ROWS>(sk, sv, k, v, bh, heads, t, j0);
    T ak[RPW][DW], av[RPW][DW];
    for (int r = 0; r < RPW; ++r) {
        for (int c = 0; c < DW; ++c) ak[r][c] = av[r][c] = 0;
    }
    for (int i0 = j0 / TILE * TILE; i0 < t; i0 += TILE) {
        __syncthreads();
        load_rows<TILE>(sq, sdo, q, dout, bh, heads, t, i0);
        if (threadIdx.x < TILE) {
            const long long at = (long long)bh * t + clamp_row(i0 + threadIdx.x, t);
            sl[threadIdx.x] = lse[at];
            sd[threadIdx.x] = delta[at];
        }
        __syncthreads();
        const int query = i0 + lane;
        T s[RPW], dp[RPW];
        for (int r = 0; r < RPW; ++r) s[r] = dp[r] = 0;
        for (int d = 0; d < HD; ++d) {
            const T qd = sq[lane][d], od = sdo[lane][d];
            for (int r = 0; r < RPW; ++r) {
                s[r] += qd * sk[warp * RPW + r][d];
                dp[r] += od * sv[warp * RPW + r][d];
            }
        }
        for (int r = 0; r < RPW; ++r) {
            const int row = warp * RPW + r, key = j0 + row;
            const T p = (query < t && key <= query) ? ms_exp(s[r] * scale - sl[lane]) : (T)0;
            sp[row][lane] = p;
            sds[row][lane] = p * (dp[r] - sd[lane]);
        }
        __syncwarp();
        for (int i = 0; i < TILE; ++i) {
            for (int c = 0; c < DW; ++c) {
                const int d = lane + 32 * c;
                if (d >= HD) continue;
                const T od = sdo[i][d], qd = sq[i][d];
                for (int r = 0; r < RPW; ++r) {
                    av[r][c] += sp[warp * RPW + r][i] * od;
                    ak[r][c] += sds[warp * RPW + r][i] * qd;
                }
            }
        }
    }
    for (int r = 0; r < RPW; ++r) {
        const int key = j0 + warp * RPW + r;
        if (key >= t) continue;
        const long long at = row_at(bh, heads, t, key);
        for (int c = 0; c < DW; ++c) {
            const int d = lane + 32 * c;
            if (d < HD) {
                dk[at + d] = ak[r][c] * scale;
                dv[at + d] = av[r][c];
            }
        }
    }
}
"""

_RAW: dict[tuple[int, str, str, int], tuple[Any, int]] = {}


def _kernel(xp: Any, name: str, dtype: Any, head_dim: int) -> tuple[Any, int]:
    """The RawKernel ``name`` for ``dtype`` and ``head_dim`` and the rows of its
    blocks, made once; CuPy compiles it at its first launch and caches the binary."""
    dtype = np.dtype(dtype)
    key = (id(xp), name, dtype.name, int(head_dim))
    found = _RAW.get(key)
    if found is None:
        rpw = rows_per_warp(name, dtype, head_dim)
        if rpw is None:
            raise ValueError(f"head_dim={head_dim} in {dtype}: the tiles of {name} do not fit "
                             f"{SHARED_BYTES} bytes of shared memory")
        found = _RAW[key] = (xp.RawKernel(kernel_source(dtype, head_dim, rpw), name),
                             _WARPS * rpw)
    return found
