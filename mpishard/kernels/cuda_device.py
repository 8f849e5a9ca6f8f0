"""CUDA device functions shared by the kernels' sources.

``WARP_FUNCTIONS`` is pasted into the sources of ``mpishard.kernels.nn`` (the
row kernels) and ``mpishard.kernels.attention``, after their ``typedef ... T;``.
No communication.
"""

from __future__ import annotations

__all__ = ["WARP_FUNCTIONS"]

#: ``ms_exp``/``ms_log`` for float and double, and ``warp_sum``/``warp_max`` of a
#: ``T`` over the 32 lanes of a warp (butterfly shuffles: every lane gets the result).
WARP_FUNCTIONS = r"""
__device__ __forceinline__ float ms_exp(float v) { return expf(v); }
__device__ __forceinline__ double ms_exp(double v) { return exp(v); }
__device__ __forceinline__ float ms_log(float v) { return logf(v); }
__device__ __forceinline__ double ms_log(double v) { return log(v); }

__device__ __forceinline__ T warp_sum(T v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ T warp_max(T v) {
    for (int o = 16; o > 0; o >>= 1) {
        const T w = __shfl_xor_sync(0xffffffffu, v, o);
        v = w > v ? w : v;
    }
    return v;
}
"""
