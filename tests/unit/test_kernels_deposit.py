"""The fused binned-sum kernels (mpishard.kernels.deposit) give their NumPy twins' bits.

Each kernel runs fused (Numba on the CPU; CuPy kernels on a GPU, marked ``gpu``)
and as its twin (the arithmetic of :mod:`mpishard.reprosum`) on the same values,
over the whole float range: signed zeros, subnormals, values near the largest
float64, all-zero chunks, tensors of a few elements, and NaN. No MPI.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from deposit_cases import SEGMENTS, vectors

import mpishard.kernels.deposit as kd
from mpishard.kernels import numba_available
from mpishard.reprosum import (
    CHUNK,
    NORM_WORD_BITS,
    BinnedAccumulator,
    ChunkGrid,
    bin_of,
    fixed_bin_sum,
)


@pytest.fixture
def fused(monkeypatch):
    """Run a block fused or as the twin: ``with_kernels(True)``."""
    if not numba_available():
        pytest.skip("Numba does not import here")

    def choose(on: bool) -> None:
        monkeypatch.setattr(kd, "fused_on", lambda xp: on)
    return choose


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_deposit_and_to_float_give_the_twin_bits(dtype, fused):
    n = sum(SEGMENTS)
    xs = vectors(dtype, 6, n, seed=1)
    got = []
    for on in (False, True):
        fused(on)
        acc = BinnedAccumulator(n, dtype, segments=SEGMENTS)
        states = []
        for x in xs:
            assert kd.deposit(acc, x)
            states.append((acc.words.tobytes(), acc.bins.tobytes()))
            rose = bool((acc.bins > np.frombuffer(states[0][1], np.int64)).any())
        bad = xs[1].copy()
        bad[CHUNK + 3] = np.nan
        assert not kd.deposit(acc, bad)                  # refused: nothing deposited
        bad[CHUNK + 3] = -np.inf
        assert not kd.deposit(acc, bad)
        assert (acc.words.tobytes(), acc.bins.tobytes()) == states[-1]
        assert rose                                      # words moved down on the way
        assert acc.deposits == len(xs)
        outs = []
        for start, stop in ((0, n), (0, 1), (CHUNK + 5, 3 * CHUNK + 20), (n - 300, n)):
            out = np.full(stop - start, 7, dtype=dtype)
            kd.to_float(acc, out, start, stop)
            outs.append(out.tobytes())
        got.append((states, outs))
    assert got[0] == got[1]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("count", [1, 2, 5])
def test_exact_sum_is_deposit_then_convert(dtype, count, fused):
    n = sum(SEGMENTS)
    rows = np.array(vectors(dtype, count, n, seed=4)[:count])
    results = []
    for on in (False, True):
        fused(on)
        grid = ChunkGrid(SEGMENTS)
        for lo, hi in ((0, n), (CHUNK // 2, n - 7)):
            out = np.full(hi - lo, 3, dtype=dtype)
            assert kd.exact_sum(grid, rows, out, lo, hi) == -1
            results.append(out.tobytes())
        bad = rows.copy()
        bad[-1, n - 2] = np.nan
        if count > 2:
            bad[1, 0] = np.inf
        out = np.empty(n, dtype=dtype)
        results.append(kd.exact_sum(grid, bad, out))
    half = len(results) // 2
    assert results[:half] == results[half:]
    assert results[-1] == (1 if count > 2 else count - 1)
    # Deposited one by one into an accumulator (in another order): the same bits.
    acc = BinnedAccumulator(n, dtype, segments=SEGMENTS)
    for r in reversed(range(count)):
        acc.deposit(rows[r])
    whole = np.empty(n, dtype=dtype)
    acc.to_float(whole)
    assert whole.tobytes() == results[0]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_deposit_rows_is_deposit_row_after_row(dtype, fused):
    n = sum(SEGMENTS)
    xs = vectors(dtype, 6, n, seed=11)
    got = []
    for on in (False, True):
        fused(on)
        acc = BinnedAccumulator(n, dtype, segments=SEGMENTS)
        assert kd.deposit_rows(acc, np.array(xs[:3])) == -1
        assert kd.deposit_rows(acc, np.array(xs[3:])) == -1     # rises on the way
        assert acc.deposits == len(xs)
        bad = np.array(xs[:3])
        bad[1, 7] = np.nan
        assert kd.deposit_rows(acc, bad) == 1                   # row 0 only went in
        got.append((acc.words.tobytes(), acc.bins.tobytes(), acc.deposits))
    one = BinnedAccumulator(n, dtype, segments=SEGMENTS)
    for x in xs + xs[:1]:
        one.deposit(x)
    assert got[0] == got[1] == (one.words.tobytes(), one.bins.tobytes(), len(xs) + 1)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_square_words_and_max_magnitude(dtype, fused):
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(5000) * np.exp2(rng.integers(-20, 20, 5000))).astype(dtype)
    top = bin_of(float(np.max(np.abs(x).astype(np.float64)) ** 2), NORM_WORD_BITS)
    scratch, slices = np.empty(300), np.empty(300)
    words = []
    for on in (False, True):
        fused(on)
        words.append(kd.square_words(x, top, scratch, slices))
        assert kd.max_magnitude(x) == float(np.max(np.abs(x)))
        assert kd.max_magnitude(x[:0]) == 0.0
        y = x.copy()
        y[7] = -np.inf
        assert kd.max_magnitude(y) == math.inf
        y[9] = np.nan
        assert math.isnan(kd.max_magnitude(y))
    assert words[0] == words[1] == fixed_bin_sum(x, top, scratch, slices, square=True)
    tiny = (rng.standard_normal(100) * 1e-160).astype(np.float64)    # bins beyond 2**1023
    top = bin_of(float(np.max(np.abs(tiny)) ** 2), NORM_WORD_BITS)
    fused(True)
    assert kd.square_words(tiny, top, scratch, slices) == fixed_bin_sum(
        tiny, top, scratch, slices, square=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cuda_kernels_give_the_twin_bits(dtype, monkeypatch):
    from backends import cupy_or_skip

    cp = cupy_or_skip()
    n = sum(SEGMENTS)
    xs = vectors(dtype, 5, n, seed=7)
    # The twin on the host.
    host = BinnedAccumulator(n, dtype, segments=SEGMENTS)
    for x in xs:
        host.deposit(x)
    ref = np.empty(n, dtype=dtype)
    host.to_float(ref)
    monkeypatch.setattr(kd, "fused_on", lambda xp: True)
    dev = BinnedAccumulator(n, dtype, cp, segments=SEGMENTS)
    for x in xs:
        assert kd.deposit(dev, cp.asarray(x))
    bad = cp.asarray(xs[1]).copy()
    bad[5] = cp.nan
    assert not kd.deposit(dev, bad)
    assert cp.asnumpy(dev.words).tobytes() == host.words.tobytes()
    assert cp.asnumpy(dev.bins).tobytes() == host.bins.tobytes()
    out = cp.empty(n, dtype=dtype)
    kd.to_float(dev, out)
    assert cp.asnumpy(out).tobytes() == ref.tobytes()
    part = cp.empty(2 * CHUNK, dtype=dtype)
    kd.to_float(dev, part, CHUNK + 5, 3 * CHUNK + 5)
    assert cp.asnumpy(part).tobytes() == ref[CHUNK + 5:3 * CHUNK + 5].tobytes()
    # Rows at once (bins rise on the way), and a non-finite row: nothing deposited.
    more = np.array([x * np.asarray(2.0 ** 45, dtype=dtype) for x in xs[:3]])
    more[np.abs(more) > 1e300] = 0.0
    for x in more:
        host.deposit(x)
    assert kd.deposit_rows(dev, cp.asarray(more)) == -1
    assert cp.asnumpy(dev.words).tobytes() == host.words.tobytes()
    assert cp.asnumpy(dev.bins).tobytes() == host.bins.tobytes()
    rows = np.array(xs[:3])
    grid = ChunkGrid(SEGMENTS)
    want = np.empty(n - 9, dtype=dtype)
    assert kd._exact_sum_twin(grid, rows, want, 4, n - 5) == -1
    got = cp.empty(n - 9, dtype=dtype)
    assert kd.exact_sum(grid, cp.asarray(rows), got, 4, n - 5) == -1
    assert cp.asnumpy(got).tobytes() == want.tobytes()
    bad = rows.copy()
    bad[1, n - 3] = np.nan
    assert kd.exact_sum(grid, cp.asarray(bad), got, 4, n - 5) == 1
    # Squares: values whose squares stay finite (the cases' vectors reach 1e300),
    # as test_square_words_and_max_magnitude draws them.
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(5000) * np.exp2(rng.integers(-20, 20, 5000))).astype(dtype)
    top = bin_of(float(np.max(np.abs(x).astype(np.float64)) ** 2), NORM_WORD_BITS)
    scratch, slices = np.empty(300), np.empty(300)
    assert kd.square_words(cp.asarray(x), top, None, None) == fixed_bin_sum(
        x, top, scratch, slices, square=True)
