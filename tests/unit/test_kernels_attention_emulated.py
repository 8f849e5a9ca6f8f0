"""The fused causal attention (mpishard/kernels/attention.py): its NumPy twin against
the softmax written out, and its CUDA source run on the CPU against the twin.

No GPU is needed: as in tests/unit/test_kernels_emulated.py, the kernels' C++ is
compiled with g++ against tests/support/cuda_emulation/shim.h (a block's threads
are std::threads; ``__syncthreads``, ``__syncwarp`` and each warp's shuffles are
barriers), so the tiles, the online softmax, the clamped rows past the end and
the index arithmetic of the token-major layout run as written, thread by thread.
Sizes are odd on purpose: tokens not a multiple of a block's rows or of the
32-key tile, head widths not a multiple of 32 (a lane's last column missing).
Forward and backward against the twin: float64 to 1e-11, float32 to 2e-5. What
this cannot check (NVRTC, CuPy's launch, the speed) is the ``gpu`` tests'
(tests/unit/test_kernels_attention.py). Plain pytest; skipped without a C++20
compiler.
"""

from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

import numpy as np
import pytest
from cuda_emulated import HERE, ptr
from cuda_emulated import build as emulated_build

from mpishard.kernels import attention as att

DTYPES = [np.float64, np.float32]


def tol(dtype):
    return dict(rtol=2e-5, atol=2e-5) if dtype == np.float32 else dict(rtol=1e-11, atol=1e-12)


def qkv(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(shape).astype(dtype) for _ in range(4))


def written_out(q, k, v, dout, scale):
    """Attention and its gradients by the textbook formulas, head-major, float64."""
    qh, kh, vh, oh = (a.astype(np.float64).transpose(0, 2, 1, 3) for a in (q, k, v, dout))
    t = q.shape[1]
    s = scale * qh @ kh.transpose(0, 1, 3, 2)
    s[..., np.triu(np.ones((t, t), bool), 1)] = -np.inf
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dp = oh @ vh.transpose(0, 1, 3, 2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) * scale
    heads = (p @ vh, ds @ kh, ds.transpose(0, 1, 3, 2) @ qh, p.transpose(0, 1, 3, 2) @ oh)
    return tuple(a.transpose(0, 2, 1, 3) for a in heads)


def twin(q, k, v, dout, scale):
    b, t, h, _ = q.shape
    out, dq, dk, dv = (np.empty_like(q) for _ in range(4))
    lse, delta = np.empty((b, h, t), q.dtype), np.empty((b, h, t), q.dtype)
    att.causal_attention(q, k, v, scale, out, lse)
    att.causal_attention_backward(dout, q, k, v, out, lse, scale, dq, dk, dv, delta)
    return out, lse, dq, dk, dv, delta


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 7, 3, 5), (1, 40, 2, 33), (1, 1, 1, 1)])
def test_twin_against_the_written_out_softmax(dtype, shape):
    q, k, v, dout = qkv(shape, dtype, sum(shape))
    out, lse, dq, dk, dv, _ = twin(q, k, v, dout, 0.4)
    for got, want in zip((out, dq, dk, dv), written_out(q, k, v, dout, 0.4)):
        np.testing.assert_allclose(got, want, **tol(dtype))
    # lse: the log-sum-exp of row i's first i + 1 scaled scores.
    s = 0.4 * np.einsum("bihd,bjhd->bhij", q.astype(np.float64), k.astype(np.float64))
    i = shape[1] - 1
    want = np.log(np.exp(s[:, :, i, :]).sum(-1))
    np.testing.assert_allclose(lse[:, :, i], want, **tol(dtype))


def test_twin_refuses_mismatched_shapes():
    q = np.zeros((1, 4, 2, 3))
    with pytest.raises(ValueError, match=r"expecting lse of shape \(1, 2, 4\), got \(1, 4, 2\)"):
        att.causal_attention(q, q, q, 1.0, np.empty_like(q), np.empty((1, 4, 2)))
    with pytest.raises(ValueError, match="one shape"):
        att.causal_attention(q, q[:, :3], q, 1.0, np.empty_like(q), np.empty((1, 2, 4)))


def test_the_fused_path_is_off_for_numpy_and_for_tiles_too_large():
    assert not att.attention_fused_on(np, np.float32, 64)
    assert att.rows_per_warp("ms_attention_fwd", np.float32, 64) == 4
    assert att.rows_per_warp("ms_attention_bwd_dkdv", np.float64, 64) == 2
    assert att.rows_per_warp("ms_attention_bwd_dkdv", np.float32, 128) == 2
    assert att.rows_per_warp("ms_attention_bwd_dkdv", np.float64, 128) is None


# --- the CUDA source on the CPU ---------------------------------------------------------

# Every variant the tests run, compiled into one library (one g++ run: most of its
# time is the C++ headers): (dtype, head_dim, rows a warp).
VARIANTS = [("float64", 5, 4), ("float64", 40, 4), ("float64", 9, 2), ("float64", 9, 1),
            ("float32", 5, 4), ("float32", 40, 4)]


def build(folder: Path) -> ctypes.CDLL:
    code = ['#include "shim.h"\n#include "launcher.inc"\n']
    template = (HERE / "attention_launch.inc").read_text()
    for n, variant in enumerate(VARIANTS):
        source = att.kernel_source(*variant).replace('extern "C"', "")
        code.append(f"namespace v{n} {{\n{source}\n}}\n" + template.replace("__NS__", f"v{n}"))
    return emulated_build("".join(code), folder / "attention")


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    """``(dtype, head_dim, rpw) -> (fwd, dq, dkdv)``, the variant's entry points."""
    if shutil.which("g++") is None:
        pytest.skip("no g++ to compile the kernels' source for the CPU")
    lib = build(tmp_path_factory.mktemp("cuda_emulation"))

    def entry(dtype, head_dim, rpw):
        n = VARIANTS.index((np.dtype(dtype).name, head_dim, rpw))
        return tuple(getattr(lib, f"attn_{name}_v{n}") for name in ("fwd", "dq", "dkdv"))

    return entry


def emulated(entries, rpw, q, k, v, dout, scale):
    """The library's launch (grid, block, arguments) of the three kernels, on the CPU."""
    b, t, h, _ = q.shape
    dtype = q.dtype
    out, dq, dk, dv = (np.full_like(q, np.nan) for _ in range(4))
    lse, delta = np.full((b, h, t), np.nan, dtype), np.full((b, h, t), np.nan, dtype)
    grid = -(-t // (4 * rpw)) * b * h
    c = ctypes.c_float if dtype == np.float32 else ctypes.c_double
    fwd, dq_kernel, dkdv_kernel = entries
    fwd(grid, att.THREADS, *map(ptr, (q, k, v, out, lse)), t, h, c(scale))
    dq_kernel(grid, att.THREADS, *map(ptr, (q, k, v, out, dout, lse, delta, dq)), t, h,
              c(scale))
    dkdv_kernel(grid, att.THREADS, *map(ptr, (q, k, v, dout, lse, delta, dk, dv)), t, h,
                c(scale))
    return out, lse, dq, dk, dv, delta


# (batch, tokens, heads, head_dim): tokens past one block's 16 rows (21) and past
# one 32-key tile (70), a single token, head widths below a warp and above it (the
# lanes' second column partly missing).
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 21, 2, 5), (1, 70, 1, 40), (1, 1, 2, 5)])
def test_kernels_against_the_twin(kernels, dtype, shape):
    rpw = att.rows_per_warp("ms_attention_fwd", dtype, shape[3])
    assert rpw == 4
    entries = kernels(dtype, shape[3], rpw)
    q, k, v, dout = qkv(shape, dtype, 3 + sum(shape))
    got = emulated(entries, rpw, q, k, v, dout, 1 / np.sqrt(shape[3]))
    want = twin(q, k, v, dout, 1 / np.sqrt(shape[3]))
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv", "delta"), got, want):
        np.testing.assert_allclose(g, w, **tol(dtype), err_msg=name)


@pytest.mark.parametrize("rpw", [2, 1])
def test_fewer_rows_a_warp(kernels, rpw):
    """The blocks of 8 and 4 rows that wide heads in float64 get."""
    shape = (1, 19, 2, 9)
    entries = kernels(np.float64, shape[3], rpw)
    q, k, v, dout = qkv(shape, np.float64, rpw)
    got = emulated(entries, rpw, q, k, v, dout, 0.3)
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv", "delta"), got,
                          twin(q, k, v, dout, 0.3)):
        np.testing.assert_allclose(g, w, **tol(np.float64), err_msg=name)
