"""Step time of reproducible mode over the default mode, same job, same model.

Run under mpirun; prints one JSON line per configuration on rank 0::

    mpirun -n 2 python benchmarks/bench_reproducible.py                   # every model
    mpirun -n 4 python benchmarks/bench_reproducible.py --models small gpt --rounds 9

Models: ``small`` (MLP 784-1024-1024-10, ~1.9M parameters) and ``large`` (MLP
1024-4096-4096-1024-10, ~25M) of ``bench_strategies.py``, 64 rows per rank,
Adam; ``gpt``: the GPT of ``mpishard train --example gpt`` (vocabulary 97,
context 64, width 64, 4 heads, 2 blocks, ~0.1M parameters) on random tokens,
its global batch of 32 rows, AdamW and clipping at 1.0 as that command trains
it. Each in float32 and float64, DDP and ZeRO-2 (reduce-scatter), with the
library's default units (``--sizes 1,2,4`` sets ``reproducible_sizes``,
``--unit-rows`` the rows; ``rank``: one unit per rank).

Three modes are built side by side in the same job and alternate ``--rounds``
times (a round: ``--steps`` steps of one mode), so a slowdown of a shared machine
hits them alike: ``default``; ``units``, the default mode run in the
reproducible units (a backward per unit, under ``no_sync`` for DDP: one
reduction; ZeRO-2 reduces each unit to its shards): the units' compute without
the reproducible sums, a floor for the reproducible step; ``reproducible``.
``<mode>_s`` is the slowest rank's mean step of a round, its minimum and median
over the rounds; ``ratio`` is reproducible over default
and ``units_ratio`` units over default (of the minima, and of the medians).
``parts_s`` says where a step's time goes (means over every round, per step,
on rank 0): ``forward_backward`` (one forward/backward per unit in the units
and reproducible modes), ``deposit`` (copying units' gradients aside, or
depositing them into words), ``communication`` (the gradient's reduction: the
units' exchange or the words' reduction and the DDP gather, in reproducible
mode), ``conversion`` (the binned sum back to floats), ``optimizer`` and
``gather`` (ZeRO-2's parameter Allgatherv).

``--device cuda`` puts models and batches on each rank's GPU (CuPy); the deposit
runs as the CUDA kernels of ``mpishard.kernels.deposit_cuda`` (the default;
``kernels`` in the record), or with ``MPISHARD_GPU_KERNELS=0`` as the NumPy
twin's CuPy calls. ``scripts/gpu-check.sh`` runs it so.

Set OMP_NUM_THREADS (the script defaults it to cores / ranks) so ranks do not
fight over cores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import numpy as np  # noqa: E402

# Sets each rank's BLAS threads before NumPy loads, and names the models.
from bench_strategies import BATCH_PER_RANK, MODELS  # noqa: E402
from mpi4py import MPI  # noqa: E402

from mpishard import ShardingConfiguration  # noqa: E402
from mpishard.kernels import fused_on  # noqa: E402
from mpishard.nn import GPT, MLP  # noqa: E402
from mpishard.optim import Adam, AdamW  # noqa: E402
from mpishard.parallel.repro import unit_rows_for  # noqa: E402
from mpishard.strategies import DDPOptimizer, ZeRO2Optimizer  # noqa: E402

#: Alternated in every round: the default step, the same in unit-sized micro-batches
#: (the units' compute without the reproducible sums: a floor), reproducible mode.
MODES = ("default", "units", "reproducible")
PARTS = ("forward_backward", "deposit", "communication", "conversion", "optimizer", "gather")
#: The GPT of `mpishard train --example gpt`: its model, batch and options.
GPT_MODEL = {"vocab": 97, "seq_len": 64, "d_model": 64, "heads": 4, "layers": 2}
GPT_BATCH = 32


def emit(record: dict) -> None:
    if MPI.COMM_WORLD.rank == 0:
        print(json.dumps(record), flush=True)


def build(name, dtype, kind, mode, unit_rows, sizes, xp):
    """A strategy and one step's closure for this rank in ``mode`` (``default``,
    ``units``: the default mode run as the reproducible units, one backward per
    unit and one reduction, or ``reproducible``); the global batch."""
    world = MPI.COMM_WORLD
    reproducible = mode == "reproducible"
    config = ShardingConfiguration(world, reproducible=reproducible,
                                   unit_rows=unit_rows if reproducible else None,
                                   reproducible_sizes=sizes if reproducible else None)
    rng = np.random.default_rng(world.rank)
    if name == "gpt":
        g = GPT_MODEL
        model = GPT(g["vocab"], g["seq_len"], g["d_model"], g["heads"], g["layers"],
                    dtype=dtype, seed=0, xp=xp)
        total = GPT_BATCH
        local = total // world.size
        x = rng.integers(0, g["vocab"], (local, g["seq_len"])).astype(np.int32)
        y = np.roll(x, -1, axis=1)
        optimizer, options = AdamW(lr=3e-3), {"max_grad_norm": 1.0}
    else:
        widths = MODELS[name]
        model = MLP(widths, dtype=dtype, seed=0, xp=xp)
        local = BATCH_PER_RANK
        total = local * world.size
        x = rng.standard_normal((local, widths[0])).astype(dtype)
        y = rng.integers(0, widths[-1], local)
        optimizer, options = Adam(lr=1e-4), {}
    x, y = xp.asarray(x), xp.asarray(y)
    cls = DDPOptimizer if kind == "ddp" else ZeRO2Optimizer
    extra = {} if kind == "ddp" else {"reduce_method": "reduce_scatter"}
    strategy = cls(optimizer, config, model=model, **options, **extra)
    start = world.rank * local
    r = unit_rows_for(total, unit_rows, sizes)
    pieces = [(x[a:a + r], y[a:a + r], start + a) for a in range(0, local, r)]

    def step() -> None:
        strategy.backward(x, y, batch_start=start, global_rows=total)
        strategy.step()

    def units() -> None:
        # ZeRO-2 has no no_sync(): it reduces every unit to the shards.
        with strategy.no_sync() if kind == "ddp" else contextlib.nullcontext():
            for xu, yu, first in pieces[:-1]:
                strategy.backward(xu, yu, batch_start=first, global_rows=total)
        xu, yu, first = pieces[-1]
        strategy.backward(xu, yu, batch_start=first, global_rows=total)
        strategy.step()

    return config, strategy, units if mode == "units" else step, total


def timed_round(strategy, step, steps: int, xp) -> float:
    """Mean step seconds of one round (the slowest rank's; a device's work done)."""
    world = MPI.COMM_WORLD
    world.Barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    if xp is not np:
        xp.cuda.get_current_stream().synchronize()
    return world.allreduce((time.perf_counter() - t0) / steps, op=MPI.MAX)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["small", "large", "gpt"],
                        choices=sorted(MODELS) + ["gpt"])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "float64"])
    parser.add_argument("--strategies", nargs="+", default=["ddp", "zero2"],
                        choices=["ddp", "zero2"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--unit-rows", default=None,
                        help="rows per unit, or 'rank': one unit per rank")
    parser.add_argument("--sizes", type=lambda v: tuple(int(s) for s in v.split(",")),
                        default=None, help="reproducible_sizes, e.g. 1,2,4 (instead of "
                        "the default units)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: models and batches on the rank's GPU (CuPy)")
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    if args.device == "cuda":
        import cupy as xp
        xp.cuda.Device(world.rank % xp.cuda.runtime.getDeviceCount()).use()
    else:
        xp = np
    for name in args.models:
        for dtype_name in args.dtypes:
            dtype = np.dtype(dtype_name)
            for kind in args.strategies:
                unit_rows = args.unit_rows
                if unit_rows == "rank":
                    total = GPT_BATCH if name == "gpt" else BATCH_PER_RANK * world.size
                    unit_rows = total // world.size
                elif unit_rows is not None:
                    unit_rows = int(unit_rows)
                runs = {mode: build(name, dtype, kind, mode, unit_rows, args.sizes, xp)
                        for mode in MODES}
                for _, strategy, step, _ in runs.values():
                    step()                                   # warm-up (and JIT)
                    step()
                    strategy.reset_timings()
                    strategy.timings.pop("deposit", None)
                    strategy.timings.pop("conversion", None)
                times = {mode: [] for mode in runs}
                for _ in range(args.rounds):
                    for mode, (_, strategy, step, _) in runs.items():
                        times[mode].append(timed_round(strategy, step, args.steps, xp))
                total = runs["default"][3]
                rows = unit_rows_for(total, unit_rows, args.sizes)
                summary = {mode: {"min": min(t), "median": statistics.median(t)}
                           for mode, t in times.items()}
                count = args.rounds * args.steps
                record = {
                    "model": name, "parameters": int(runs["default"][1].model.params.size),
                    "dtype": dtype.name, "strategy": kind, "ranks": world.size,
                    "device": args.device, "kernels": "fused" if fused_on(xp) else "twin",
                    "global_batch": total, "unit_rows": rows, "units": total // rows,
                    "units_per_rank": total // rows / world.size,
                    **{f"{mode}_s": {k: round(v, 5) for k, v in summary[mode].items()}
                       for mode in MODES},
                    "ratio": {k: round(summary["reproducible"][k] / summary["default"][k], 3)
                              for k in ("min", "median")},
                    "units_ratio": {k: round(summary["units"][k] / summary["default"][k], 3)
                                    for k in ("min", "median")},
                    "parts_s": {mode: {k: round(strategy.timings.get(k, 0.0) / count, 5)
                                       for k in PARTS}
                                for mode, (_, strategy, _, _) in runs.items()},
                }
                emit(record)
                for config, _, _, _ in runs.values():
                    config.free()


if __name__ == "__main__":
    main()
