"""The binned sum of reproducible mode (:mod:`mpishard.reprosum`) without MPI: any
order and grouping of the deposits gives the same bits, within a bound of
``math.fsum``'s exact sum (the same bits at any world size, under ``mpirun``:
``tests/mpi/test_reproducible.py``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from mpishard.reprosum import (
    CHUNK,
    NORM_WORD_BITS,
    NORM_WORDS,
    WORD_BITS,
    BinnedAccumulator,
    ScalarSum,
    bin_of,
    fixed_bin_sum,
    words_for,
    words_to_float,
)


def wide_vectors(dtype, count, n, seed):
    """Vectors with exponents over a wide range, both signs, zeros and subnormals."""
    rng = np.random.default_rng(seed)
    span = 100 if dtype == np.float32 else 600
    xs = []
    for _ in range(count):
        x = rng.standard_normal(n) * np.exp2(rng.integers(-span // 2, span // 2, n))
        x[rng.random(n) < 0.05] = 0.0
        x = x.astype(dtype)
        if dtype == np.float64:
            x[:3] = [5e-324, -2.5e-320, 1e-310]     # subnormals
            # A chunk of subnormals and one of huge values: bins beyond a float64 factor.
            x[CHUNK:2 * CHUNK] = rng.integers(-9, 9, CHUNK) * 5e-324
            if n >= 3 * CHUNK:
                x[2 * CHUNK:2 * CHUNK + 9] = rng.standard_normal(9) * 1e305
        xs.append(x)
    xs.append(np.zeros(n, dtype=dtype))            # an all-zero deposit
    return xs


def binned(xs, order, groups, dtype, n):
    """Sum ``xs`` in ``order``, cut into ``groups`` (ranks), reduced like the library does."""
    accs = []
    for group in groups:
        acc = BinnedAccumulator(n, dtype, extras=1)
        for i in group:
            assert acc.deposit(xs[order[i]], [float(xs[order[i]][-1]) * 7])
        accs.append(acc)
    bins = np.max([a.bins for a in accs], axis=0)          # Allreduce(MAX)
    for acc in accs:
        acc.realign(bins)
    total = BinnedAccumulator(n, dtype, extras=1)
    total.bins[...] = bins
    total.words[...] = sum(a.words for a in accs)          # Allreduce(SUM): exact integers
    out = np.empty(n, dtype=dtype)
    total.to_float(out)
    return out, total.extra_value(0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_binned_sum_ignores_order_and_grouping(dtype):
    n, count = 3 * CHUNK + 17, 13
    xs = wide_vectors(dtype, count, n, seed=1)
    ref, ref_extra = binned(xs, list(range(len(xs))), [range(len(xs))], dtype, n)
    rng = np.random.default_rng(7)
    for _ in range(6):
        order = rng.permutation(len(xs))
        cuts = sorted(rng.choice(np.arange(1, len(xs)), size=3, replace=False))
        groups = [range(a, b) for a, b in zip([0, *cuts], [*cuts, len(xs)])]
        out, extra = binned(xs, order, groups, dtype, n)
        assert out.tobytes() == ref.tobytes()
        assert extra == ref_extra
    # A non-trivial test: plain float summation does depend on the order here.
    plain = [np.sum(np.array(xs)[rng.permutation(len(xs))], axis=0, dtype=dtype)
             for _ in range(4)]
    assert any(p.tobytes() != plain[0].tobytes() for p in plain[1:])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_binned_sum_error_bound_against_exact_sum(dtype):
    n, count = 2 * CHUNK, 40
    xs = wide_vectors(dtype, count, n, seed=2)
    out, _ = binned(xs, list(range(len(xs))), [range(len(xs))], dtype, n)
    wide = np.array(xs, dtype=np.float64)
    exact = np.array([math.fsum(wide[:, j]) for j in range(n)])
    # The bound of mpishard.reprosum: output rounding, the float64 conversion, and
    # per deposit less than 2 M 2**(-(K-1)W), M the chunk's largest magnitude.
    k = words_for(dtype)
    chunk_max = np.repeat(np.abs(wide).max(axis=0).reshape(-1, CHUNK).max(axis=1), CHUNK)
    ulp = np.spacing(np.abs(exact).astype(dtype)).astype(np.float64)
    bound = (ulp + 2.0 ** -51 * np.abs(wide).sum(axis=0)
             + len(xs) * 2 * chunk_max * 2.0 ** (-(k - 1) * WORD_BITS))
    error = np.abs(out.astype(np.float64) - exact)
    assert np.all(error <= bound), np.max(error / bound)
    # Where a chunk's values are of one scale (gradients), it is the output's rounding.
    same = [rng_x for rng_x in (np.random.default_rng(4).standard_normal((count, n)))]
    same = [x.astype(dtype) for x in same]
    out, _ = binned(same, list(range(count)), [range(count)], dtype, n)
    exact = np.array([math.fsum(float(x[j]) for x in same) for j in range(n)])
    assert np.all(np.abs(out - exact) <= np.spacing(np.abs(exact).astype(dtype)))


def test_tensor_bits_do_not_depend_on_offset_or_block(monkeypatch):
    """Chunks restart at every segment (tensor): a tensor sums to the same bits
    inside the whole vector and alone (a pipeline stage's vector), whatever the
    working block of the deposit."""
    import mpishard.reprosum as reprosum

    rng = np.random.default_rng(6)
    lengths = [300, 1000, 77]
    xs = [(rng.standard_normal(sum(lengths)) * np.exp2(rng.integers(-30, 30, sum(lengths))))
          .astype(np.float32) for _ in range(9)]
    results = []
    for block in (CHUNK, 3 * CHUNK, 1 << 20):
        monkeypatch.setattr(reprosum, "BLOCK_ELEMENTS", block)
        whole = BinnedAccumulator(sum(lengths), np.float32, segments=lengths)
        alone = BinnedAccumulator(lengths[1], np.float32)
        for x in xs:
            whole.deposit(x)
            alone.deposit(x[300:1300])
        a, b = np.empty(sum(lengths), np.float32), np.empty(lengths[1], np.float32)
        whole.to_float(a)
        alone.to_float(b)
        assert a[300:1300].tobytes() == b.tobytes()
        part = np.empty(500, np.float32)
        whole.to_float(part, 250, 750)      # a range across segments (a ZeRO-2 shard)
        assert part.tobytes() == a[250:750].tobytes()
        results.append(a.tobytes())
    assert results[0] == results[1] == results[2]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fast_deposit_paths_give_the_general_bits(dtype, monkeypatch):
    """The host deposit's fast paths (bit maximum, one scale per block of one bin)
    against the general ones: the same words and bins."""
    import mpishard.reprosum as reprosum

    rng = np.random.default_rng(8)
    n = 5 * CHUNK + 17
    # First a tiny one: its bins' scale 2**152 is beyond float32 (float64 arithmetic).
    xs = [(rng.standard_normal(n) * 1e-36).astype(dtype)] + wide_vectors(dtype, 4, n, seed=9)
    xs[0][:2 * CHUNK] = 0.0      # a block of zeros: skipped
    xs += [rng.standard_normal(n).astype(dtype) * 3, np.full(n, -0.0, dtype=dtype),
           (rng.standard_normal(n) * 1e-300).astype(dtype)]
    got = []
    for fast in (True, False):
        monkeypatch.setattr(reprosum, "_FAST", fast)
        monkeypatch.setattr(reprosum, "BLOCK_ELEMENTS", 2 * CHUNK)
        acc = BinnedAccumulator(n, dtype, segments=[2 * CHUNK, n - 2 * CHUNK])
        snapshots = []
        for x in xs:
            assert acc.deposit(x)
            snapshots.append(acc.words.tobytes())   # a later rise may drop words
        bad = xs[1].copy()
        bad[CHUNK + 3] = np.nan
        assert not acc.deposit(bad)          # refused on either path
        got.append((snapshots, acc.bins.tobytes()))
    assert got[0] == got[1]


def test_binned_sum_edges():
    acc = BinnedAccumulator(5, np.float32)
    assert not acc.deposit(np.array([1, 2, np.nan, 4, 5], dtype=np.float32))
    assert acc.deposits == 0 and (acc.words == 0).all()
    out = np.ones(5, dtype=np.float32)
    acc.to_float(out)
    assert (out == 0).all()                                 # nothing deposited: zeros
    acc.capacity = 2
    acc.deposit(np.ones(5, dtype=np.float32))
    acc.deposit(np.ones(5, dtype=np.float32))
    with pytest.raises(ValueError, match="at most 2 deposits"):
        acc.deposit(np.ones(5, dtype=np.float32))
    assert bin_of(0.0) < bin_of(2.0 ** -1074) < bin_of(1.0) < bin_of(2.0 ** 1000)
    assert bin_of(2.0 ** WORD_BITS - 1) == 0 and bin_of(2.0 ** WORD_BITS) == 1
    with pytest.raises(ValueError, match="extra values"):
        acc.deposit(np.ones(5, dtype=np.float32), [1.0])


def test_scalar_sum_is_a_one_element_accumulator():
    """ScalarSum (the loss's sum, in Python floats) gives the words, bins and value
    of a BinnedAccumulator of one float64 element, realigned alike."""
    rng = np.random.default_rng(12)
    values = list(rng.standard_normal(40) * np.exp2(rng.integers(-300, 300, 40)))
    values[5:8] = [0.0, -0.0, 5e-324]
    for order in (values, values[::-1]):
        acc, one = BinnedAccumulator(1, np.float64), ScalarSum()
        for v in order:
            assert acc.deposit(np.array([v])) and one.deposit(float(v))
            assert (one.bin, one.words) == (int(acc.bins[0]), acc.words[:, 0, 0].tolist())
        top = one.bin + 2
        acc.realign(np.array([top]))
        one.realign(top)
        assert one.words == acc.words[:, 0, 0].tolist()
        out = np.empty(1)
        acc.to_float(out)
        assert one.value() == out[0]
    assert not one.deposit(math.nan) and not one.deposit(-math.inf)


def test_fixed_bin_sum_of_squares_any_partition():
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(5000) * np.exp2(rng.integers(-20, 20, 5000))).astype(np.float32)
    top = bin_of(float(np.max(np.abs(x).astype(np.float64) ** 2)), NORM_WORD_BITS)
    scratch, slices = np.empty(300), np.empty(300)

    def total(pieces):
        words = [0.0] * NORM_WORDS
        for p in pieces:
            for k, w in enumerate(fixed_bin_sum(p, top, scratch, slices, square=True)):
                words[k] += w
        return words_to_float(words, top, NORM_WORD_BITS)

    whole = total([x])
    for parts in (2, 3, 7):
        cuts = np.linspace(0, x.size, parts + 1).astype(int)
        assert total([x[a:b] for a, b in zip(cuts[:-1], cuts[1:])]) == whole
    exact = math.fsum(float(v) ** 2 for v in x)
    largest = float(np.max(np.abs(x).astype(np.float64) ** 2))
    # Per element less than 2 * largest * 2**(-(K-1)W), and the float conversion.
    assert abs(whole - exact) <= x.size * 2 * largest * 2.0 ** (-2 * NORM_WORD_BITS) \
        + 4 * 2.0 ** -52 * exact
