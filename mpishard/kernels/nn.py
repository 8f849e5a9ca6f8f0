"""The layers' hot path as kernels: bias + activation, layer norm, softmax
cross-entropy, causal attention's softmax; the embedding's scatter-add.

Each operation is one function here. Its NumPy twin is the layers' reference
code (a chain of ``xp`` calls into preallocated buffers; it runs for NumPy and,
unless the fused kernels are on, for CuPy); its fused version is one CUDA
kernel per pass over the data, written for CuPy (``ElementwiseKernel`` for the
elementwise maps, ``RawKernel`` with one thread block per row for the row
reductions), compiled at its first call and cached (in the process, and by
CuPy on disk). Which runs is
[`mpishard.kernels.select.fused_on`][mpishard.kernels.select.fused_on]'s choice for the array's
library: the CuPy kernels are on by default since they passed their ``gpu`` tests on an H100
(tests/unit/test_kernels_nn.py); ``MPISHARD_GPU_KERNELS=0`` turns them off.

The fused versions need C-contiguous arrays (the layers' own buffers are);
given others they fall back to the twin. The matrix products around them stay
cuBLAS calls. The row kernels are compiled with ``--fmad=false``: no multiply
and add contracted into one rounding the twin does not make.

`scatter_add_rows` is not a choice: on CuPy arrays it is always its
kernel, since ``cupyx.scatter_add`` adds repeated ids with atomics, in an order
that changes from run to run (the embedding's gradient, and with it the bits of
reproducible mode, changed between two runs on an H100). Pure: no MPI.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..backend import array_namespace
from .cuda_device import WARP_FUNCTIONS
from .select import fused_on

__all__ = [
    "ACTIVATIONS",
    "activation_backward",
    "bias_activation",
    "causal_softmax",
    "causal_softmax_backward",
    "gpu_kernels_on",
    "layer_norm_backward",
    "layer_norm_forward",
    "scatter_add_rows",
    "softmax_cross_entropy",
]

#: The activations `bias_activation` knows.
ACTIVATIONS = ("relu", "gelu", "tanh")

# GELU, tanh approximation: y = 0.5 h (1 + tanh(C (h + A h^3))).
GELU_C = math.sqrt(2.0 / math.pi)
GELU_A = 0.044715


def gpu_kernels_on(xp: Any) -> bool:
    """True when the fused CUDA kernels run for arrays of ``xp``."""
    return xp is not np and fused_on(xp)


def _contiguous(*arrays: Any) -> bool:
    return all(a is None or a.flags.c_contiguous for a in arrays)


# --- bias + activation ---------------------------------------------------------------

def bias_activation(kind: str, x: Any, bias: Any, y: Any, scratch: dict[str, Any]) -> Any:
    """``y = act(x + bias)`` for ``kind`` in `ACTIVATIONS`; ``bias`` (one
    value per column) may be None. ``x`` may be left holding ``x + bias``
    (GELU's backward reads it). ``scratch``: the twin's buffers of ``x``'s
    shape (``"t"``, ``"s"`` for GELU; ``t`` keeps ``tanh(u)`` for the backward).
    Returns ``y``. Local."""
    xp = _namespace(y)
    if gpu_kernels_on(xp) and _contiguous(x, y):
        kernel = _bias_act_kernel(xp, kind, bias is not None)
        if bias is None:
            kernel(x, y)
        elif kind == "gelu":
            kernel(bias, x, y)       # x is written: it holds x + bias after
        else:
            kernel(x, bias, y)
        return y
    if bias is not None:
        x += bias
    if kind == "relu":
        return xp.maximum(x, 0, out=y)
    if kind == "tanh":
        return xp.tanh(x, out=y)
    if kind != "gelu":
        raise ValueError(f"expecting an activation among {ACTIVATIONS}, got {kind!r}")
    t, s = scratch["t"], scratch["s"]
    xp.multiply(x, x, out=s)
    s *= GELU_A
    s += 1.0
    s *= x
    s *= GELU_C                      # s = u
    xp.tanh(s, out=t)                # kept for backward
    xp.add(t, 1.0, out=y)
    y *= x
    y *= 0.5
    return y


def activation_backward(kind: str, dy: Any, x: Any, y: Any, scratch: dict[str, Any]) -> Any:
    """``dy *= act'(x)`` in place, from the forward's input ``x`` (GELU, after
    the bias) or output ``y`` (ReLU, Tanh); ``scratch``: the twin's buffers
    (``"mask"`` for ReLU, ``"s"`` for Tanh, ``"t"``, ``"s"``, ``"s2"`` for GELU).
    Returns ``dy``. Local."""
    xp = _namespace(dy)
    if gpu_kernels_on(xp) and _contiguous(dy, x, y):
        kernel = _act_backward_kernel(xp, kind)
        kernel(x if kind == "gelu" else y, dy)
        return dy
    if kind == "relu":
        # A masked store, not dy * mask: multiplying by a bool array makes NumPy
        # cast it through an iteration buffer on every call.
        mask = scratch["mask"]
        xp.less_equal(y, 0, out=mask)
        xp.copyto(dy, 0, where=mask)
        return dy
    if kind == "tanh":
        s = scratch["s"]
        xp.multiply(y, y, out=s)
        xp.subtract(1.0, s, out=s)
        dy *= s
        return dy
    # dy/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2)
    t, s, s2 = scratch["t"], scratch["s"], scratch["s2"]
    xp.multiply(t, t, out=s)
    xp.subtract(1.0, s, out=s)
    s *= x
    xp.multiply(x, x, out=s2)
    s2 *= 3.0 * GELU_A
    s2 += 1.0
    s *= s2
    s *= GELU_C
    s += t
    s += 1.0
    s *= 0.5
    dy *= s
    return dy


# --- layer norm ------------------------------------------------------------------------

def layer_norm_forward(x: Any, weight: Any, bias: Any, eps: float, y: Any, xhat: Any,
                       mean: Any, rstd: Any, tmp: Any) -> Any:
    """Row-wise ``y = (x - mean) / sqrt(var + eps) * weight + bias`` for 2-D ``x``
    (biased variance over the last axis); keeps ``xhat``, ``mean`` and ``rstd``
    (``(rows, 1)``) for the backward; ``tmp`` is the twin's scratch. Returns
    ``y``. Local."""
    xp = _namespace(y)
    rows, cols = x.shape
    if gpu_kernels_on(xp) and _contiguous(x, weight, bias, y, xhat, mean, rstd):
        if rows:
            _rows_kernel(xp, "ms_layer_norm_fwd", y.dtype)(
                (rows,), (_threads(cols),),
                (x, weight, bias, y, xhat, mean, rstd, np.int32(cols), y.dtype.type(eps)))
        return y
    xp.mean(x, axis=1, keepdims=True, out=mean)
    xp.subtract(x, mean, out=xhat)
    xp.multiply(xhat, xhat, out=tmp)
    xp.mean(tmp, axis=1, keepdims=True, out=rstd)
    rstd += eps
    xp.sqrt(rstd, out=rstd)
    xp.reciprocal(rstd, out=rstd)
    xhat *= rstd
    xp.multiply(xhat, weight, out=y)
    y += bias
    return y


def layer_norm_backward(dy: Any, weight: Any, xhat: Any, rstd: Any, g: Any, m1: Any,
                        m2: Any) -> Any:
    """The input gradient of `layer_norm_forward`, in place in ``dy``:
    ``rstd * (g - mean(g) - xhat * mean(g * xhat))`` with ``g = dy * weight``
    (row means). ``g``, ``m1``, ``m2`` (``(rows, 1)``) are the twin's scratch.
    Returns ``dy``. Local."""
    xp = _namespace(dy)
    rows, cols = dy.shape
    if gpu_kernels_on(xp) and _contiguous(dy, weight, xhat, rstd):
        if rows:
            _rows_kernel(xp, "ms_layer_norm_bwd", dy.dtype)(
                (rows,), (_threads(cols),), (dy, xhat, weight, rstd, np.int32(cols)))
        return dy
    xp.multiply(dy, weight, out=g)
    xp.mean(g, axis=1, keepdims=True, out=m1)
    xp.multiply(g, xhat, out=dy)
    xp.mean(dy, axis=1, keepdims=True, out=m2)
    xp.multiply(xhat, m2, out=dy)
    xp.subtract(g, dy, out=dy)
    dy -= m1
    dy *= rstd
    return dy


# --- softmax cross-entropy ------------------------------------------------------------

def softmax_cross_entropy(logits: Any, target: Any, buf: dict[str, Any]) -> tuple[Any, Any]:
    """Mean over rows of ``logsumexp(z_i) - z_i[y_i]`` and its gradient
    ``(softmax(z) - onehot(y)) / rows`` (into ``buf["grad"]``), returned as
    ``(loss, grad)``; the loss is a 0-d array of the backend. ``buf``: ``grad``,
    ``rowloss`` (``(rows,)``) and the twin's ``logp``, ``onehot``, ``rowmax``,
    ``sumexp``, ``rows``. A label outside ``[0, classes)``: NumPy raises
    IndexError, the fused kernel gives that row a NaN loss. Local."""
    xp = _namespace(logits)
    rows, cols = logits.shape
    scale = 1.0 / rows if rows else 0.0
    grad = buf["grad"]
    if gpu_kernels_on(xp) and _contiguous(logits, target, grad):
        rowloss = buf["rowloss"]
        if not rows:
            return xp.zeros((), dtype=grad.dtype), grad
        kernel = _rows_kernel(xp, "ms_softmax_xent", grad.dtype, np.dtype(target.dtype))
        kernel((rows,), (_threads(cols),),
               (logits, target, grad, rowloss, np.int32(cols), grad.dtype.type(scale)))
        return xp.sum(rowloss) * scale, grad
    p, logp, onehot = grad, buf["logp"], buf["onehot"]
    rowmax, sumexp = buf["rowmax"], buf["sumexp"]
    xp.max(logits, axis=1, keepdims=True, out=rowmax)
    xp.subtract(logits, rowmax, out=logp)
    xp.exp(logp, out=p)
    xp.sum(p, axis=1, keepdims=True, out=sumexp)
    p /= sumexp                                    # softmax
    xp.log(sumexp, out=sumexp)
    logp -= sumexp                                 # log-softmax
    # A one-hot matrix instead of a gather: filling a buffer allocates
    # nothing, fancy-index reads would allocate a result every step.
    onehot.fill(0)
    onehot[buf["rows"], target] = 1
    loss = xp.vdot(onehot.ravel(), logp.ravel()) * -scale
    p -= onehot
    p *= scale
    return loss, p


# --- causal attention's softmax -------------------------------------------------------

def causal_softmax(p: Any, scale: float, mask: Any, rows: Any) -> Any:
    """In place over the last axis of the scores ``p`` ``(..., t, t)``: query
    ``i`` (the second-last index) keeps keys ``j <= i``:
    ``p[i, j] = softmax_j(scale * p[i, :i + 1])``, 0 for ``j > i``. ``mask``
    (``(t, t)``, True above the diagonal) and ``rows`` (``(..., t, 1)``) are the
    twin's. Returns ``p``. Local."""
    xp = _namespace(p)
    t = p.shape[-1]
    if gpu_kernels_on(xp) and _contiguous(p):
        if p.size:
            _rows_kernel(xp, "ms_causal_softmax", p.dtype)(
                (p.size // t,), (_threads(t),), (p, np.int32(t), p.dtype.type(scale)))
        return p
    # Shifted by the row maximum (the diagonal is never masked: it is finite).
    p *= scale
    xp.copyto(p, -np.inf, where=mask)
    xp.max(p, axis=-1, keepdims=True, out=rows)
    p -= rows
    xp.exp(p, out=p)
    xp.sum(p, axis=-1, keepdims=True, out=rows)
    p /= rows
    return p


def causal_softmax_backward(dp: Any, p: Any, scale: float, rows: Any) -> Any:
    """The scores' gradient from the probabilities' ``dp``, in place:
    ``dp = scale * p * (dp - sum_j(dp * p))`` by row (0 above the diagonal,
    where ``p`` is 0). The twin overwrites ``p``; ``rows`` is its scratch.
    Returns ``dp``. Local."""
    xp = _namespace(dp)
    t = dp.shape[-1]
    if gpu_kernels_on(xp) and _contiguous(dp, p):
        if dp.size:
            _rows_kernel(xp, "ms_causal_softmax_bwd", dp.dtype)(
                (dp.size // t,), (_threads(t),), (dp, p, np.int32(t), dp.dtype.type(scale)))
        return dp
    dp *= p
    xp.sum(dp, axis=-1, keepdims=True, out=rows)
    p *= rows
    dp -= p
    dp *= scale
    return dp


# --- the embedding's scatter-add ---------------------------------------------------------

def scatter_add_rows(out: Any, ids: Any, rows: Any) -> Any:
    """``out[ids[i]] += rows[i]`` for ``i = 0, 1, ...`` in that order, repeated
    ids included: ``out`` ``(V, d)``, ``ids`` ``(n,)`` integers in ``[0, V)``,
    ``rows`` ``(n, d)``. NumPy: ``numpy.add.at``. CuPy: the ids sorted stably,
    then one thread per element of ``out`` adds its id's rows in ``i`` order
    (the twin's additions, the twin's bits, the same in every run). Returns
    ``out``. Local."""
    xp = _namespace(out)
    if xp is np:
        np.add.at(out, ids, rows)
        return out
    n = int(ids.shape[0])
    vocab, d = int(out.shape[0]), int(out.shape[1])
    if n == 0 or out.size == 0:
        return out
    if not out.flags.c_contiguous:
        raise ValueError("expecting a C-contiguous output table, got a strided view")
    rows = xp.ascontiguousarray(rows)
    order = xp.argsort(ids)                      # stable: i order within an id
    bounds = xp.searchsorted(ids[order], xp.arange(vocab + 1, dtype=ids.dtype))
    threads = 256
    _rows_kernel(xp, "ms_scatter_add_rows", out.dtype)(
        (-(-out.size // threads),), (threads,),
        (out, rows, order.astype(np.int64, copy=False), bounds.astype(np.int64, copy=False),
         np.int64(out.size), np.int32(d)))
    return out


# --- the CUDA side ----------------------------------------------------------------------

def _namespace(a: Any) -> Any:
    """``numpy`` or the module of ``a`` (CuPy), without importing CuPy."""
    return np if isinstance(a, np.ndarray) else array_namespace(a)


def _threads(cols: int) -> int:
    """Threads of a row's block: a whole number of warps, up to 256 (a thread
    takes every 256th element of a longer row)."""
    return min(256, 32 * max(1, -(-cols // 32)))


_ELEMENTWISE: dict[tuple[int, str, bool], Any] = {}


def _bias_act_kernel(xp: Any, kind: str, bias: bool) -> Any:
    key = (id(xp), kind, bias)
    kernel = _ELEMENTWISE.get(key)
    if kernel is not None:
        return kernel
    c, a = repr(GELU_C), repr(GELU_A)
    body = {
        # NaN passes through (h <= 0 is false for NaN), as NumPy's maximum.
        "relu": "y = (h <= (T)0) ? (T)0 : h;",
        "tanh": "y = tanh(h);",
        "gelu": f"y = (T)0.5 * h * ((T)1 + tanh((T){c} * (h + (T){a} * h * h * h)));",
    }.get(kind)
    if body is None:
        raise ValueError(f"expecting an activation among {ACTIVATIONS}, got {kind!r}")
    if not bias:
        kernel = xp.ElementwiseKernel("T x", "T y", "const T h = x; " + body,
                                      f"ms_{kind}_fwd")
    elif kind == "gelu":
        # x is an output too: it keeps x + bias, which the backward reads.
        kernel = xp.ElementwiseKernel("T b", "T x, T y", "const T h = x + b; x = h; " + body,
                                      "ms_bias_gelu_fwd")
    else:
        kernel = xp.ElementwiseKernel("T x, T b", "T y", "const T h = x + b; " + body,
                                      f"ms_bias_{kind}_fwd")
    _ELEMENTWISE[key] = kernel
    return kernel


def _act_backward_kernel(xp: Any, kind: str) -> Any:
    key = (id(xp), kind + "-backward", False)
    kernel = _ELEMENTWISE.get(key)
    if kernel is not None:
        return kernel
    c, a3 = repr(GELU_C), repr(3.0 * GELU_A)
    a = repr(GELU_A)
    body = {
        # dy = 0 where y <= 0: the twin's mask (NaN keeps its gradient).
        "relu": "if (v <= (T)0) dy = (T)0;",
        "tanh": "dy = dy * ((T)1 - v * v);",
        "gelu": (f"const T t = tanh((T){c} * (v + (T){a} * v * v * v)); "
                 f"dy = dy * ((T)0.5 * ((T)1 + t) + (T)0.5 * v * ((T)1 - t * t) * (T){c}"
                 f" * ((T)1 + (T){a3} * v * v));"),
    }.get(kind)
    if body is None:
        raise ValueError(f"expecting an activation among {ACTIVATIONS}, got {kind!r}")
    kernel = xp.ElementwiseKernel("T v", "T dy", body, f"ms_{kind}_bwd")
    _ELEMENTWISE[key] = kernel
    return kernel


#: C types of the label dtypes the cross-entropy kernel reads.
_LABEL_TYPES = {"int8": "signed char", "int16": "short", "int32": "int", "int64": "long long",
                "uint8": "unsigned char", "uint16": "unsigned short", "uint32": "unsigned int",
                "uint64": "unsigned long long"}

# One thread block per row. Block reductions: a warp reduces by shuffles, warp
# leaders meet in shared memory, warp 0 reduces their values; every thread gets
# the result. The block size is a whole number of warps (_threads).
_ROW_SOURCE = r"""
typedef __TYPE__ T;
typedef __LABEL__ L;
""" + WARP_FUNCTIONS + r"""
__device__ __forceinline__ float ms_sqrt(float v) { return sqrtf(v); }
__device__ __forceinline__ double ms_sqrt(double v) { return sqrt(v); }
__device__ __forceinline__ float ms_nan(float) { return __int_as_float(0x7fc00000); }
__device__ __forceinline__ double ms_nan(double) {
    return __longlong_as_double(0x7ff8000000000000LL);
}

// The sum of v over the block, on every thread. sh: 33 values of shared memory.
__device__ T block_sum(T v, T* sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int warps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();            // every thread has read the previous result from sh
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < warps ? sh[lane] : (T)0;
        v = warp_sum(v);
        if (lane == 0) sh[32] = v;
    }
    __syncthreads();
    return sh[32];
}

// The maximum of v over the block, on every thread.
__device__ T block_max(T v, T* sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int warps = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < warps ? sh[lane] : sh[0];
        v = warp_max(v);
        if (lane == 0) sh[32] = v;
    }
    __syncthreads();
    return sh[32];
}

// Layer norm of row blockIdx.x: y = xhat * w + b, xhat = (x - mean) * rstd.
extern "C" __global__ void ms_layer_norm_fwd(
        const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b,
        T* __restrict__ y, T* __restrict__ xhat, T* __restrict__ mean_out,
        T* __restrict__ rstd_out, const int cols, const T eps) {
    __shared__ T sh[33];
    const long long base = (long long)blockIdx.x * cols;
    const T* xr = x + base;
    T s = 0;
    for (int j = threadIdx.x; j < cols; j += blockDim.x) s += xr[j];
    const T mean = block_sum(s, sh) / (T)cols;
    T v = 0;
    for (int j = threadIdx.x; j < cols; j += blockDim.x) {
        const T d = xr[j] - mean;
        v += d * d;
    }
    const T r = (T)1 / ms_sqrt(block_sum(v, sh) / (T)cols + eps);
    for (int j = threadIdx.x; j < cols; j += blockDim.x) {
        const T h = (xr[j] - mean) * r;
        xhat[base + j] = h;
        y[base + j] = h * w[j] + b[j];
    }
    if (threadIdx.x == 0) {
        mean_out[blockIdx.x] = mean;
        rstd_out[blockIdx.x] = r;
    }
}

// Layer norm's input gradient of row blockIdx.x, in place in dy:
// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * w.
extern "C" __global__ void ms_layer_norm_bwd(
        T* dy, const T* __restrict__ xhat, const T* __restrict__ w,
        const T* __restrict__ rstd, const int cols) {
    __shared__ T sh[33];
    const long long base = (long long)blockIdx.x * cols;
    T a = 0, c = 0;
    for (int j = threadIdx.x; j < cols; j += blockDim.x) {
        const T g = dy[base + j] * w[j];
        a += g;
        c += g * xhat[base + j];
    }
    const T m1 = block_sum(a, sh) / (T)cols;
    const T m2 = block_sum(c, sh) / (T)cols;
    const T r = rstd[blockIdx.x];
    // Each thread rewrites only the elements it read above: in place is safe.
    for (int j = threadIdx.x; j < cols; j += blockDim.x) {
        const T g = dy[base + j] * w[j];
        dy[base + j] = r * (g - m1 - xhat[base + j] * m2);
    }
}

// Softmax cross-entropy of row blockIdx.x: grad = (softmax(z) - onehot) * scale,
// rowloss = logsumexp(z) - z[label] (NaN for a label outside [0, cols)).
extern "C" __global__ void ms_softmax_xent(
        const T* __restrict__ z, const L* __restrict__ label, T* __restrict__ grad,
        T* __restrict__ rowloss, const int cols, const T scale) {
    __shared__ T sh[33];
    const long long base = (long long)blockIdx.x * cols;
    const T* zr = z + base;
    T m = zr[0];
    for (int j = threadIdx.x; j < cols; j += blockDim.x) m = zr[j] > m ? zr[j] : m;
    m = block_max(m, sh);
    T s = 0;
    for (int j = threadIdx.x; j < cols; j += blockDim.x) s += ms_exp(zr[j] - m);
    s = block_sum(s, sh);
    const long long k = (long long)label[blockIdx.x];
    const T inv = (T)1 / s;
    for (int j = threadIdx.x; j < cols; j += blockDim.x) {
        const T p = ms_exp(zr[j] - m) * inv;
        grad[base + j] = (j == k ? p - (T)1 : p) * scale;
    }
    if (threadIdx.x == 0) {
        rowloss[blockIdx.x] = (k >= 0 && k < cols) ? ms_log(s) + m - zr[k] : ms_nan((T)0);
    }
}

// Causal softmax of score row blockIdx.x of (..., t, t), in place: query i =
// row % t keeps keys j <= i, p[j] = exp(scale p[j] - max) / sum, 0 above.
extern "C" __global__ void ms_causal_softmax(T* p, const int t, const T scale) {
    __shared__ T sh[33];
    const long long row = blockIdx.x;
    const int i = (int)(row % t);
    T* pr = p + row * t;
    T m = pr[0] * scale;
    for (int j = threadIdx.x; j <= i; j += blockDim.x) {
        const T v = pr[j] * scale;
        m = v > m ? v : m;
    }
    m = block_max(m, sh);
    T s = 0;
    for (int j = threadIdx.x; j <= i; j += blockDim.x) s += ms_exp(pr[j] * scale - m);
    const T inv = (T)1 / block_sum(s, sh);
    // Each thread rewrites only the elements it read above: in place is safe.
    for (int j = threadIdx.x; j < t; j += blockDim.x) {
        pr[j] = j <= i ? ms_exp(pr[j] * scale - m) * inv : (T)0;
    }
}

// Its backward, in place in dp: ds = scale * p * (dp - sum_j dp p), 0 above.
extern "C" __global__ void ms_causal_softmax_bwd(
        T* dp, const T* __restrict__ p, const int t, const T scale) {
    __shared__ T sh[33];
    const long long row = blockIdx.x;
    const int i = (int)(row % t);
    const long long base = row * t;
    T a = 0;
    for (int j = threadIdx.x; j <= i; j += blockDim.x) a += dp[base + j] * p[base + j];
    a = block_sum(a, sh);
    for (int j = threadIdx.x; j < t; j += blockDim.x) {
        dp[base + j] = j <= i ? scale * p[base + j] * (dp[base + j] - a) : (T)0;
    }
}

// out[r, j] += rows[order[k], j] for k in [bounds[r], bounds[r + 1]), k rising:
// one thread per element of out (scatter_add_rows).
extern "C" __global__ void ms_scatter_add_rows(
        T* out, const T* __restrict__ rows, const long long* __restrict__ order,
        const long long* __restrict__ bounds, const long long size, const int d) {
    const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= size) return;
    const long long r = t / d, j = t - r * d;
    T acc = out[t];
    for (long long k = bounds[r]; k < bounds[r + 1]; ++k) acc += rows[order[k] * d + j];
    out[t] = acc;
}
"""

_RAW: dict[tuple[int, str, str, str], Any] = {}


def _rows_kernel(xp: Any, name: str, dtype: Any, label: Any = None) -> Any:
    """The RawKernel ``name`` for floating ``dtype`` (and label ``dtype``), made
    once; CuPy compiles it at its first launch and caches the binary."""
    dtype = np.dtype(dtype)
    label_name = "int64" if label is None else np.dtype(label).name
    key = (id(xp), name, dtype.name, label_name)
    kernel = _RAW.get(key)
    if kernel is None:
        if dtype.name not in ("float32", "float64"):
            raise TypeError(f"expecting float32 or float64 arrays, got {dtype}")
        if label_name not in _LABEL_TYPES:
            raise TypeError(f"expecting integer labels, got dtype {label_name}")
        source = (_ROW_SOURCE.replace("__TYPE__", "float" if dtype.name == "float32"
                                      else "double")
                  .replace("__LABEL__", _LABEL_TYPES[label_name]))
        kernel = _RAW[key] = xp.RawKernel(source, name, options=("--fmad=false",))
    return kernel
