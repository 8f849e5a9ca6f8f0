"""The CUDA binned-sum kernels (mpishard/kernels/deposit_cuda.py), run on the CPU.

No GPU is needed: the kernels' source is compiled with g++ against the stand-in
for the CUDA built-ins of tests/support/cuda_emulation (a block's threads are
std::threads, ``__syncthreads`` a barrier), and a stand-in for CuPy (NumPy's
functions and a ``RawKernel`` that calls the compiled kernel) runs the module's
own host code: the launches, grids, scratch arrays and flag reads as written.
Words, bins and results are compared bit for bit with the NumPy twin
(:mod:`mpishard.reprosum`). What this cannot check: NVRTC's view of the source,
CuPy's argument passing, a GPU's arithmetic; those are the ``gpu`` test of
tests/test_kernels_deposit.py. Plain pytest; skipped without a C++20 compiler.
"""

from __future__ import annotations

import ctypes
import functools
import re
import shutil
import types
from pathlib import Path

import numpy as np
import pytest
from cuda_emulated import HERE
from cuda_emulated import build as emulated_build
from deposit_cases import SEGMENTS, vectors

import mpishard.kernels.deposit as kd
import mpishard.kernels.deposit_cuda as kc
from mpishard.reprosum import (
    CHUNK,
    NORM_WORD_BITS,
    BinnedAccumulator,
    ChunkGrid,
    bin_of,
    fixed_bin_sum,
)

#: Kernel name -> the C entry point of deposit_launch.inc.
ENTRIES = {"ms_chunk_top": "chunk_top", "ms_deposit": "deposit", "ms_to_float": "to_float",
           "ms_exact_sum": "exact_sum", "ms_square_words": "square_words"}


@functools.cache
def compiled(source: str, folder: str) -> ctypes.CDLL:
    code = ('#include "shim.h"\n#include "deposit_shim.h"\n' + source.replace('extern "C"', "")
            + (HERE / "deposit_launch.inc").read_text())
    ctype = re.search(r"typedef (\w+) T;", source).group(1)
    out = Path(folder) / f"deposit_{ctype}"
    return emulated_build(code, out, ("-ffp-contract=off",))


def c_arg(value):
    if isinstance(value, np.ndarray):
        assert value.flags.c_contiguous
        return value.ctypes.data_as(ctypes.c_void_p)
    if isinstance(value, np.int64):
        return ctypes.c_longlong(int(value))
    if isinstance(value, np.int32):
        return ctypes.c_int(int(value))
    raise TypeError(f"an argument CuPy would not take as is: {value!r}")


def fake_cupy(folder: str) -> types.ModuleType:
    """NumPy's namespace with a RawKernel that runs the compiled source."""
    xp = types.ModuleType("emulated_cupy")
    xp.__dict__.update({k: v for k, v in np.__dict__.items() if not k.startswith("__")})

    class RawKernel:
        def __init__(self, source, name, options=()):
            assert "--fmad=false" in options        # no contraction may change a rounding
            self.entry = getattr(compiled(source, folder), ENTRIES[name])

        def __call__(self, grid, block, args):
            self.entry(ctypes.c_uint(grid[0]), ctypes.c_uint(block[0]), *map(c_arg, args))

    xp.RawKernel = RawKernel
    return xp


@pytest.fixture
def emulated(tmp_path, monkeypatch):
    """The emulated CuPy, with the kernels of kernels/deposit.py sent to CUDA."""
    if shutil.which("g++") is None:
        pytest.skip("no g++ to compile the kernels' source for the CPU")
    xp = fake_cupy(str(tmp_path))
    monkeypatch.setattr(kd, "fused_on", lambda namespace: True)
    monkeypatch.setattr(kd, "array_namespace", lambda a: xp)
    monkeypatch.setattr(kc, "array_namespace", lambda a: xp)
    monkeypatch.setattr(kc, "_KERNELS", {})
    return xp


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_deposit_rows_and_to_float(emulated, dtype):
    n = sum(SEGMENTS)
    xs = vectors(dtype, 5, n, seed=21)
    twin = BinnedAccumulator(n, dtype, segments=SEGMENTS)
    dev = BinnedAccumulator(n, dtype, emulated, segments=SEGMENTS)
    for batch in (xs[:1], xs[1:4], xs[4:]):               # later batches raise bins
        for x in batch:
            assert twin.deposit(x)
        assert kd.deposit_rows(dev, np.array(batch)) == -1
        assert dev.words.tobytes() == twin.words.tobytes()
        assert dev.bins.tobytes() == twin.bins.tobytes()
    bad = np.array(xs[:2])
    bad[1, CHUNK + 1] = np.inf
    assert kd.deposit_rows(dev, bad) == 1                 # the twin says where
    assert kd.deposit(dev, xs[0]) is True
    twin.deposit(bad[0])
    twin.deposit(xs[0])
    assert dev.words.tobytes() == twin.words.tobytes()
    for start, stop in ((0, n), (CHUNK + 5, 3 * CHUNK + 20), (n - 300, n)):
        want, got = np.empty(stop - start, dtype), np.full(stop - start, 7, dtype)
        twin.to_float(want, start, stop)
        kd.to_float(dev, got, start, stop)
        assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_exact_sum(emulated, dtype):
    n = sum(SEGMENTS)
    rows = np.array(vectors(dtype, 4, n, seed=22)[:4])
    grid = ChunkGrid(SEGMENTS)
    for lo, hi in ((0, n), (CHUNK // 2, n - 7), (3 * CHUNK + 17, 3 * CHUNK + 22)):
        want = np.empty(hi - lo, dtype)
        assert kd._exact_sum_twin(ChunkGrid(SEGMENTS), rows, want, lo, hi) == -1
        got = np.full(hi - lo, 3, dtype)
        assert kd.exact_sum(grid, rows, got, lo, hi) == -1
        assert got.tobytes() == want.tobytes(), (lo, hi)
    bad = rows.copy()
    bad[2, n - 1] = np.nan
    bad[3, 5] = -np.inf
    assert kd.exact_sum(grid, bad, np.empty(n, dtype)) == 2


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_square_words(emulated, dtype):
    rng = np.random.default_rng(23)
    x = (rng.standard_normal(3000) * np.exp2(rng.integers(-20, 20, 3000))).astype(dtype)
    top = bin_of(float(np.max(np.abs(x).astype(np.float64)) ** 2), NORM_WORD_BITS)
    scratch, slices = np.empty(300), np.empty(300)
    assert kd.square_words(x, top, scratch, slices) == fixed_bin_sum(
        x, top, scratch, slices, square=True)
