"""The CUDA source of the row kernels (mpishard/kernels/nn.py), run on the CPU.

No GPU is needed: the kernels' C++ is compiled with g++ against a stand-in for
the CUDA built-ins (tests/support/cuda_emulation/shim.h: a block's threads are
std::threads, ``__syncthreads`` and each warp's shuffles are barriers), so the
block reductions, the in-place updates and the index arithmetic run as written,
thread by thread, and are compared with the NumPy twins (float64 to 1e-11,
float32 to 2e-5). What this cannot check: NVRTC's view of the source, CuPy's
launch of it, and the ElementwiseKernels (CuPy writes their loops): those are
the ``gpu`` tests of tests/test_kernels_nn.py. Plain pytest; skipped without a
C++20 compiler.
"""

from __future__ import annotations

import ctypes
import functools
import shutil
import types
from pathlib import Path

import numpy as np
import pytest
from cuda_emulated import HERE, ptr
from cuda_emulated import build as emulated_build

from mpishard.kernels import nn as k
from mpishard.nn.losses import SoftmaxCrossEntropy

TYPES = {np.float32: "float", np.float64: "double"}


@functools.cache
def build(ctype: str, label: str, folder: str) -> ctypes.CDLL:
    source = k._ROW_SOURCE.replace("__TYPE__", ctype).replace("__LABEL__", label)
    code = ('#include "shim.h"\n' + source.replace('extern "C"', "")
            + (HERE / "launch.inc").read_text())
    out = Path(folder) / f"rows_{ctype}_{label.replace(' ', '_')}"
    return emulated_build(code, out)


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.skip("no g++ to compile the kernels' source for the CPU")
    folder = str(tmp_path_factory.mktemp("cuda_emulation"))
    return lambda dtype, label="long long": build(TYPES[dtype], label, folder)


def scalar(dtype, value):
    return (ctypes.c_float if dtype == np.float32 else ctypes.c_double)(value)


def tol(dtype):
    return dict(rtol=2e-5, atol=2e-5) if dtype == np.float32 else dict(rtol=1e-11, atol=1e-12)


# (rows, cols, threads): warps of one and several, rows shorter and longer than the
# block (each thread then takes every blockDim-th element), the block the library
# launches (k._threads) for the longest.
SHAPES = [(3, 1, 32), (4, 31, 32), (2, 100, 64), (2, 300, 64), (2, 700, k._threads(700))]


@pytest.mark.parametrize("dtype", TYPES)
@pytest.mark.parametrize("rows, cols, threads", SHAPES)
def test_layer_norm(kernels, dtype, rows, cols, threads):
    lib = kernels(dtype)
    rng = np.random.default_rng(cols)
    x = (2 + rng.standard_normal((rows, cols))).astype(dtype)
    w, b = rng.standard_normal(cols).astype(dtype), rng.standard_normal(cols).astype(dtype)
    dy = rng.standard_normal((rows, cols)).astype(dtype)
    y, xhat, tmp = (np.empty_like(x) for _ in range(3))
    mean, rstd, m2 = (np.empty((rows, 1), dtype) for _ in range(3))
    k.layer_norm_forward(x, w, b, 1e-5, y, xhat, mean, rstd, tmp)
    want_mean = mean.copy()   # the twin's backward uses it as scratch
    dx = dy.copy()
    k.layer_norm_backward(dx, w, xhat, rstd, tmp, mean, m2)
    y2, xhat2 = np.empty_like(x), np.empty_like(x)
    mean2, rstd2 = np.empty((rows, 1), dtype), np.empty((rows, 1), dtype)
    lib.ln_fwd(rows, threads, ptr(x), ptr(w), ptr(b), ptr(y2), ptr(xhat2), ptr(mean2),
               ptr(rstd2), cols, scalar(dtype, 1e-5))
    dx2 = dy.copy()
    lib.ln_bwd(rows, threads, ptr(dx2), ptr(xhat2), ptr(w), ptr(rstd2), cols)
    for want, got in ((y, y2), (xhat, xhat2), (want_mean, mean2), (rstd, rstd2), (dx, dx2)):
        np.testing.assert_allclose(got, want, **tol(dtype))


@pytest.mark.parametrize("dtype", TYPES)
@pytest.mark.parametrize("rows, cols, threads", SHAPES)
def test_softmax_cross_entropy(kernels, dtype, rows, cols, threads):
    lib = kernels(dtype)
    rng = np.random.default_rng(cols + 1)
    z = (8 * rng.standard_normal((rows, cols))).astype(dtype)
    labels = rng.integers(0, cols, rows).astype(np.int64)
    loss = SoftmaxCrossEntropy()
    loss.build(np, dtype)
    value, grad = k.softmax_cross_entropy(z, labels, loss.allocate(rows, cols))
    grad2, rowloss = np.empty_like(z), np.empty(rows, dtype)
    lib.xent(rows, threads, ptr(z), ptr(labels), ptr(grad2), ptr(rowloss), cols,
             scalar(dtype, 1.0 / rows))
    np.testing.assert_allclose(grad2, grad, **tol(dtype))
    assert rowloss.sum() / rows == pytest.approx(float(value), rel=tol(dtype)["rtol"])


def test_cross_entropy_with_byte_labels_and_a_bad_one(kernels):
    lib = kernels(np.float64, "unsigned char")
    z = np.random.default_rng(1).standard_normal((3, 4))
    labels = np.array([0, 4, 3], dtype=np.uint8)
    grad, rowloss = np.empty_like(z), np.empty(3)
    lib.xent(3, 32, ptr(z), ptr(labels), ptr(grad), ptr(rowloss), 4, ctypes.c_double(1 / 3))
    lse = np.log(np.exp(z).sum(axis=1))
    assert np.isnan(rowloss[1])
    np.testing.assert_allclose(rowloss[[0, 2]], lse[[0, 2]] - z[[0, 2], [0, 3]], rtol=1e-12)
    np.testing.assert_allclose(grad[1], np.exp(z[1] - lse[1]) / 3, rtol=1e-12)


@pytest.mark.parametrize("dtype", TYPES)
@pytest.mark.parametrize("t, threads", [(1, 32), (5, 32), (33, 32), (70, 64), (300, 64)])
def test_causal_softmax(kernels, dtype, t, threads):
    """Rows ``first..`` of the scores (the last ones: the longest causal rows;
    all of them for the small sizes) against the twin."""
    lib = kernels(dtype)
    rng = np.random.default_rng(t)
    s = rng.standard_normal((1, 2, t, t)).astype(dtype)
    dp = rng.standard_normal(s.shape).astype(dtype)
    mask = np.triu(np.ones((t, t), bool), 1)
    rows = np.empty(s.shape[:-1] + (1,), dtype)
    p = s.copy()
    k.causal_softmax(p, 0.3, mask, rows)
    want_p = p.copy()
    ds = dp.copy()
    k.causal_softmax_backward(ds, p, 0.3, rows)
    n = s.size // t
    first = max(0, n - 40)
    p2, ds2 = s.copy(), dp.copy()
    lib.set_first_block(first)
    try:
        lib.csm(n, threads, ptr(p2), t, scalar(dtype, 0.3))
        lib.csm_bwd(n, threads, ptr(ds2), ptr(p2), t, scalar(dtype, 0.3))
    finally:
        lib.set_first_block(0)
    flat = (p2.reshape(n, t)[first:], ds2.reshape(n, t)[first:])
    np.testing.assert_allclose(flat[0], want_p.reshape(n, t)[first:], **tol(dtype))
    np.testing.assert_allclose(flat[1], ds.reshape(n, t)[first:], **tol(dtype))


def _c_arg(value):
    if isinstance(value, np.ndarray):
        return ptr(value)
    if isinstance(value, np.int64):
        return ctypes.c_longlong(int(value))
    if isinstance(value, np.int32):
        return ctypes.c_int(int(value))
    raise TypeError(f"an argument CuPy would not take as is: {value!r}")


@pytest.mark.parametrize("dtype", TYPES)
@pytest.mark.parametrize("vocab, d, n", [(1, 1, 5), (7, 5, 40), (40, 33, 300)])
def test_scatter_add_rows(kernels, monkeypatch, dtype, vocab, d, n):
    """The library's host code (a stable argsort, as CuPy's is, the bounds, the
    launch) and the kernel, against ``numpy.add.at``: the same bits, repeated
    ids added in row order, ids never seen left alone."""
    lib = kernels(dtype)
    fake = types.SimpleNamespace(
        argsort=lambda a: np.argsort(a, kind="stable"), searchsorted=np.searchsorted,
        arange=np.arange, ascontiguousarray=np.ascontiguousarray)

    class RawKernel:
        def __init__(self, source, name, options=()):
            assert name == "ms_scatter_add_rows" and "--fmad=false" in options

        def __call__(self, grid, block, args):
            lib.scatter(grid[0], block[0], *map(_c_arg, args))

    fake.RawKernel = RawKernel
    monkeypatch.setattr(k, "_namespace", lambda a: fake)
    monkeypatch.setattr(k, "_RAW", {})
    rng = np.random.default_rng(vocab + n)
    out = rng.standard_normal((vocab, d)).astype(dtype)
    ids = rng.integers(0, max(1, vocab - 1), n)          # the last id never seen
    rows = (rng.standard_normal((n, d)) * np.exp2(rng.integers(-20, 20, (n, d)))).astype(dtype)
    want = out.copy()
    np.add.at(want, ids, rows)
    got = out.copy()
    assert k.scatter_add_rows(got, ids, rows) is got
    assert got.tobytes() == want.tobytes()
