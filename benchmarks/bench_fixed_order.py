"""What a product of fixed summation order would cost against the BLAS.

Reproducible mode's bits depend on the BLAS kernels (the core type OpenBLAS picks
for the processor, its threads): docs/guide/reproducible.md, "Across machines".
A product whose every output element sums its reduction dimension in one fixed
order, one IEEE multiply and one add a term (no fused multiply-add, no
reassociation: Numba's defaults), gives the same bits on any processor. This
times such a loop (Numba, vectorised over the output's columns, so the order of
each element's sum does not depend on the vector width) against NumPy's BLAS on
one thread, at the shapes of a unit's products, and checks that the loop's
result equals a Python-level sum in the same order. One JSON line a shape::

    python benchmarks/bench_fixed_order.py
    python benchmarks/bench_fixed_order.py --shapes 8x1024x1024 64x1024x1024

Nothing in the library uses the loop: this measures what the option would cost.
"""

from __future__ import annotations

import argparse
import json
import time

import mpishard  # noqa: F401  (limits the BLAS threads before NumPy loads)

# isort: split
import numpy as np
from threadpoolctl import threadpool_info, threadpool_limits

from mpishard.kernels.select import import_numba

SHAPES = ("8x1024x1024", "64x1024x1024", "1024x8x1024")


def fixed_order_product():
    numba = import_numba()

    @numba.njit(nogil=True)
    def product(a, b, out):   # pragma: no cover - compiled
        """``out[i, j] = sum_k a[i, k] * b[k, j]``, ``k`` increasing."""
        m, k = a.shape
        for i in range(m):
            out[i, :] = 0
            for p in range(k):
                aip = a[i, p]
                for j in range(b.shape[1]):
                    out[i, j] += aip * b[p, j]
        return out

    return product


def best_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), help="MxKxN")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    product = fixed_order_product()
    blas = [p for p in threadpool_info() if p["user_api"] == "blas"][0]
    rng = np.random.default_rng(0)
    for dtype in (np.float32, np.float64):
        for shape in args.shapes:
            m, k, n = (int(v) for v in shape.split("x"))
            a = rng.standard_normal((m, k)).astype(dtype)
            b = rng.standard_normal((k, n)).astype(dtype)
            out = np.empty((m, n), dtype)
            product(a, b, out)
            i, j = m - 1, n - 1   # one element, summed in Python in the same order
            s = dtype(0)
            for p in range(k):
                s = dtype(s + dtype(a[i, p] * b[p, j]))
            with threadpool_limits(1, user_api="blas"):
                blas_ms = best_ms(lambda a=a, b=b: a @ b, args.repeats)
            loop_ms = best_ms(lambda a=a, b=b, out=out: product(a, b, out), args.repeats)
            print(json.dumps({
                "dtype": np.dtype(dtype).name, "shape": shape,
                "blas": f"{blas['internal_api']} {blas['version']} {blas.get('architecture')}",
                "blas_1_thread_ms": round(blas_ms, 3), "fixed_order_ms": round(loop_ms, 3),
                "ratio": round(loop_ms / blas_ms, 2), "order_checked": bool(out[i, j] == s),
            }), flush=True)


if __name__ == "__main__":
    main()
