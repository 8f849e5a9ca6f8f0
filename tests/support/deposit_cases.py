"""Float vectors for the binned-sum kernels' tests (tests/unit/test_kernels_deposit*).

Values over the whole float range: both signs, signed zeros, subnormals, values
near the largest float64, all-zero chunks; sequences whose later vectors raise
chunks' bins.
"""

from __future__ import annotations

import numpy as np

from mpishard.reprosum import CHUNK

__all__ = ["SEGMENTS", "vectors", "wide"]

SEGMENTS = [3 * CHUNK + 17, 5, 2 * CHUNK, 300]


def wide(dtype, n, seed, scale_span=None):
    """Values with exponents over a wide range, both signs, zeros and extremes."""
    rng = np.random.default_rng(seed)
    span = scale_span or (100 if dtype == np.float32 else 600)
    x = rng.standard_normal(n) * np.exp2(rng.integers(-span // 2, span // 2, n))
    x[rng.random(n) < 0.05] = 0.0
    x[rng.random(n) < 0.02] = -0.0
    x = x.astype(dtype)
    if dtype == np.float64:
        x[:3] = [5e-324, -2.5e-320, 1e-310]
        x[CHUNK:2 * CHUNK] = rng.integers(-9, 9, CHUNK) * 5e-324
        x[2 * CHUNK:2 * CHUNK + 9] = rng.standard_normal(9) * 1e305
    else:
        x[:2] = [np.float32(1e-45), np.float32(-3e-39)]
    x[3 * CHUNK:3 * CHUNK + 17] = 0.0        # an all-zero tail chunk of a segment
    return x


def vectors(dtype, count, n, seed):
    """A deposit sequence whose later vectors raise chunks' bins (words move down)."""
    xs = [wide(dtype, n, seed + i) * np.asarray(2.0 ** i, dtype=dtype)
          for i in range(count)]
    xs.insert(2, np.zeros(n, dtype=dtype))
    xs.insert(3, np.full(n, -0.0, dtype=dtype))
    big = xs[0].copy()
    big[np.abs(big) > 1e290] = 0.0
    xs.append(big * np.asarray(2.0 ** 39, dtype=dtype))     # every chunk's bin rises
    return xs
