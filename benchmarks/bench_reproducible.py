"""Step time of reproducible mode over the default mode, same job, same model.

Run under mpirun; prints one JSON line per measurement on rank 0::

    mpirun -n 2 python benchmarks/bench_reproducible.py                  # small model
    mpirun -n 4 python benchmarks/bench_reproducible.py --models small large --steps 10

For each model of ``bench_strategies.py`` (``small``: ~1.9M parameters, ``large``:
~25M), float32 and float64, DDP and ZeRO-2 (64 rows per rank, Adam), it times
``--steps`` steps in the default mode and in reproducible mode, alternating the
two ``--rounds`` times and keeping each one's best round (so a transient
slowdown of a shared machine hits both alike), and reports the slowest rank's
mean step time, the ratio, and where the time goes: ``forward_backward`` (the
units' compute; one call per unit in reproducible mode), ``deposit`` (slicing
each unit's gradient into the binned accumulator, and converting back),
``communication`` (the gradient reduction: the float words and the bins in
reproducible mode), ``optimizer`` and ``gather`` (ZeRO-2's parameter Allgatherv).
``--unit-rows`` sets the unit (default: the library's, ``B // gcd(B, 24)``;
``rank``: one unit per rank, the fewest a run at this size allows) and
``--batch-per-rank`` the rows per rank (64 by default, as bench_strategies.py):
the deposit costs the same per unit whatever its rows, so its share falls as
units grow (``--batch-per-rank 512 --unit-rows 64``). ``--compare-general`` adds
reproducible mode with the deposit's general paths (``general_*``: the deposit
before its fast paths), side by side in the same rounds.

Set OMP_NUM_THREADS (the script defaults it to cores / ranks) so ranks do not
fight over cores.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np  # noqa: E402

# Sets each rank's BLAS threads before NumPy loads, and names the models.
from bench_strategies import BATCH_PER_RANK, MODELS  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mpishard.reprosum as reprosum  # noqa: E402
from mpishard import ShardingConfiguration  # noqa: E402
from mpishard.nn import MLP  # noqa: E402
from mpishard.optim import Adam  # noqa: E402
from mpishard.parallel.repro import unit_rows_for  # noqa: E402
from mpishard.strategies import DDPOptimizer, ZeRO2Optimizer  # noqa: E402

PARTS = ("forward_backward", "deposit", "communication", "optimizer", "gather")


def emit(record: dict) -> None:
    if MPI.COMM_WORLD.rank == 0:
        print(json.dumps(record), flush=True)


def build(sizes, dtype, kind, reproducible, unit_rows, batch):
    world = MPI.COMM_WORLD
    config = ShardingConfiguration(world, reproducible=reproducible, unit_rows=unit_rows)
    model = MLP(sizes, dtype=dtype, seed=0)
    cls = DDPOptimizer if kind == "ddp" else ZeRO2Optimizer
    extra = {} if kind == "ddp" else {"reduce_method": "reduce_scatter"}
    strategy = cls(Adam(lr=1e-4), config, model=model, **extra)
    rng = np.random.default_rng(world.rank)
    x = rng.standard_normal((batch, sizes[0])).astype(dtype)
    y = rng.integers(0, sizes[-1], batch)
    start, total = world.rank * batch, world.size * batch

    def step() -> None:
        strategy.backward(x, y, batch_start=start, global_rows=total)
        strategy.step()

    return config, strategy, step


def timed_round(strategy, step, steps: int, fast: bool = True) -> tuple[float, dict[str, float]]:
    """Mean step seconds (slowest rank) and the mean breakdown per step; ``fast``
    False runs the deposit's general paths (the deposit before its fast paths)."""
    world = MPI.COMM_WORLD
    reprosum._FAST = fast
    strategy.reset_timings()
    world.Barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    mine = (time.perf_counter() - t0) / steps
    parts = {k: strategy.timings.get(k, 0.0) / steps for k in PARTS}
    return world.allreduce(mine, op=MPI.MAX), parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["small"], choices=sorted(MODELS))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "float64"])
    parser.add_argument("--strategies", nargs="+", default=["ddp", "zero2"],
                        choices=["ddp", "zero2"])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--unit-rows", default=None,
                        help="rows per unit, or 'rank': one unit per rank (batch-per-rank)")
    parser.add_argument("--compare-general", action="store_true",
                        help="also time reproducible mode with the deposit's general "
                             "paths (reprosum._FAST = False), side by side")
    parser.add_argument("--batch-per-rank", type=int, default=BATCH_PER_RANK)
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    if args.unit_rows is not None:
        args.unit_rows = (args.batch_per_rank if args.unit_rows == "rank"
                          else int(args.unit_rows))
    modes = {"default": True, "reproducible": True}
    if args.compare_general:
        modes["general"] = False
    for name in args.models:
        sizes = MODELS[name]
        for dtype_name in args.dtypes:
            dtype = np.dtype(dtype_name)
            for kind in args.strategies:
                runs = {mode: build(sizes, dtype, kind, mode != "default", args.unit_rows,
                                    args.batch_per_rank)
                        for mode in modes}
                for _, _, step in runs.values():
                    step()                                   # warm-up
                best = {mode: (float("inf"), {}) for mode in runs}
                for _ in range(args.rounds):
                    for mode, (_, strategy, step) in runs.items():
                        seconds, parts = timed_round(strategy, step, args.steps,
                                                     modes[mode])
                        if seconds < best[mode][0]:
                            best[mode] = (seconds, parts)
                total = world.size * args.batch_per_rank
                rows = unit_rows_for(total, args.unit_rows)
                record = {
                    "model": name, "parameters": int(runs["default"][1].model.params.size),
                    "dtype": dtype.name, "strategy": kind, "ranks": world.size,
                    "global_batch": total, "unit_rows": rows, "units": total // rows,
                    "default_step_s": round(best["default"][0], 5),
                    "reproducible_step_s": round(best["reproducible"][0], 5),
                    "ratio": round(best["reproducible"][0] / best["default"][0], 3),
                    **({"general_step_s": round(best["general"][0], 5),
                        "general_ratio": round(best["general"][0] / best["default"][0], 3),
                        "general_parts_s": {k: round(v, 5)
                                            for k, v in best["general"][1].items()}}
                       if "general" in best else {}),
                    "default_parts_s": {k: round(v, 5) for k, v in best["default"][1].items()},
                    "reproducible_parts_s": {k: round(v, 5)
                                             for k, v in best["reproducible"][1].items()},
                }
                emit(record)
                for config, _, _ in runs.values():
                    config.free()


if __name__ == "__main__":
    main()
