"""Time the fused optimizer updates against unfused NumPy and the memory-bandwidth bound.

Prints one JSON line per measurement. The first line is the copy bandwidth of
this machine, measured with ``np.copyto`` between two arrays far larger than the
caches (bytes read + bytes written per second). Then, for each optimizer, size
and dtype: the fused ``update`` time, the time of a plain NumPy implementation
of the same formula, and the time the update would take if it moved its
compulsory bytes (read params, grads, state; write params, state) at the copy
bandwidth::

    python benchmarks/bench_optimizer.py                     # 1.9M and 25M float32
    python benchmarks/bench_optimizer.py --sizes 1000000 --chunk-sweep
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from mpishard.optim import SGD, Adam, AdamW, sum_of_squares

GRAD_SCALE = 0.5      # as a data-parallel average would pass


def timed(fn: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """(min, median) seconds of ``fn()`` over ``repeats`` runs, after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def copy_bandwidth(nbytes: int, repeats: int) -> float:
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    best, _ = timed(lambda: np.copyto(dst, src), repeats)
    return 2 * src.nbytes / best


# Plain NumPy, one temporary per operation: what one writes without fusing.

def naive_sgd(opt: SGD, p, g, state, step, lr, s):
    buf = state["momentum_buffer"]
    d = g * s
    buf *= opt.momentum
    buf += d
    p -= lr * buf


def naive_adam(opt: Adam, p, g, state, step, lr, s):
    b1, b2 = opt.betas
    m, v = state["exp_avg"], state["exp_avg_sq"]
    if isinstance(opt, AdamW):
        p *= 1 - lr * opt.weight_decay
    d = g * s
    m *= b1
    m += (1 - b1) * d
    v *= b2
    v += (1 - b2) * (d * d)
    denom = np.sqrt(v) / math.sqrt(1 - b2 ** step) + opt.eps
    p -= (lr / (1 - b1 ** step)) * (m / denom)


CASES = {
    "SGD(momentum=0.9)": (lambda: SGD(lr=0.01, momentum=0.9), naive_sgd, 5),
    "Adam": (lambda: Adam(lr=1e-3), naive_adam, 7),
    "AdamW": (lambda: AdamW(lr=1e-3), naive_adam, 7),
}


def bench_case(name: str, n: int, dtype: Any, bandwidth: float, repeats: int,
               chunk: int | None) -> dict[str, Any]:
    make, naive, arrays_moved = CASES[name]
    opt = make()
    if chunk is not None:
        opt.chunk_size = chunk
    rng = np.random.default_rng(0)
    p = rng.standard_normal(n).astype(dtype)
    g = rng.standard_normal(n).astype(dtype)
    state = opt.init_state(n, dtype, np)
    for a in state.values():
        a[:] = np.abs(rng.standard_normal(n)).astype(dtype)

    # The two implementations agree (one step from the same start).
    p0, p2, state2 = p.copy(), p.copy(), {k: a.copy() for k, a in state.items()}
    opt.update(p, g, state, 2, opt.lr, GRAD_SCALE)
    naive(opt, p2, g, state2, 2, opt.lr, GRAD_SCALE)
    # Relative to the size of the update (params near 0 make a per-element ratio meaningless).
    max_diff = float(np.max(np.abs(p - p2)) / np.max(np.abs(p2 - p0)))

    step = [2]

    def fused_step():
        step[0] += 1
        opt.update(p, g, state, step[0], opt.lr, GRAD_SCALE)

    def naive_step():
        step[0] += 1
        naive(opt, p, g, state, step[0], opt.lr, GRAD_SCALE)

    fused, fused_med = timed(fused_step, repeats)
    plain, plain_med = timed(naive_step, max(3, repeats // 3))
    nbytes = arrays_moved * n * np.dtype(dtype).itemsize
    bound = nbytes / bandwidth
    return {
        "optimizer": name, "n": n, "dtype": np.dtype(dtype).name,
        "chunk_size": opt.chunk_size,
        "fused_ms": round(fused * 1e3, 3), "fused_median_ms": round(fused_med * 1e3, 3),
        "naive_ms": round(plain * 1e3, 3), "naive_median_ms": round(plain_med * 1e3, 3),
        "speedup": round(plain / fused, 2),
        "bytes_moved": nbytes, "lower_bound_ms": round(bound * 1e3, 3),
        "fraction_of_bandwidth": round(bound / fused, 3),
        "naive_fraction_of_bandwidth": round(bound / plain, 3),
        "max_diff_vs_naive_over_update": max_diff,
    }


def bench_sum_of_squares(n: int, dtype: Any, bandwidth: float, repeats: int) -> dict[str, Any]:
    x = np.random.default_rng(0).standard_normal(n).astype(dtype)
    scratch = np.empty(1 << 16)
    fused, _ = timed(lambda: sum_of_squares(x, scratch), repeats)
    plain, _ = timed(lambda: float(np.sum(x.astype(np.float64) ** 2)), max(3, repeats // 3))
    bound = x.nbytes / bandwidth
    return {"function": "sum_of_squares", "n": n, "dtype": np.dtype(dtype).name,
            "fused_ms": round(fused * 1e3, 3), "naive_ms": round(plain * 1e3, 3),
            "speedup": round(plain / fused, 2), "bytes_moved": x.nbytes,
            "lower_bound_ms": round(bound * 1e3, 3),
            "fraction_of_bandwidth": round(bound / fused, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_900_000, 25_000_000])
    parser.add_argument("--dtypes", nargs="+", default=["float32"])
    parser.add_argument("--optimizers", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--chunk-sweep", action="store_true",
                        help="time Adam at chunk sizes 4K..1M instead")
    args = parser.parse_args()

    bandwidth = copy_bandwidth(256 << 20, 10)
    print(json.dumps({"copy_bandwidth_GBps": round(bandwidth / 1e9, 2),
                      "note": "np.copyto of 256 MiB: (read + written bytes) / time"}), flush=True)
    for dtype in args.dtypes:
        for n in args.sizes:
            if args.chunk_sweep:
                for rnd in range(2):     # two rounds: the spread shows the noise
                    for chunk in (1 << 12, 1 << 13, 1 << 14, 1 << 15, 1 << 16, 1 << 17,
                                  1 << 18, 1 << 20):
                        r = bench_case("Adam", n, dtype, bandwidth, args.repeats, chunk)
                        print(json.dumps({"round": rnd, **r}), flush=True)
                continue
            for name in args.optimizers:
                print(json.dumps(bench_case(name, n, dtype, bandwidth, args.repeats, None)),
                      flush=True)
            print(json.dumps(bench_sum_of_squares(n, dtype, bandwidth, args.repeats)),
                  flush=True)


if __name__ == "__main__":
    main()
