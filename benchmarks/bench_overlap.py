"""``overlap="auto"``: what the stand-in backward at attach chose, against the real steps.

Run under mpirun; prints JSON lines on rank 0::

    mpirun -n 2 python benchmarks/bench_overlap.py
    mpirun -n 4 python benchmarks/bench_overlap.py --sizes 784,2048,2048,10 --bucket-mb 1

For DDP and ZeRO-2 (MLP, float32, Adam, ``--batch-per-rank`` rows per rank) it
attaches with ``overlap="auto"`` and reports the measured choice and times
(``kind: "auto"``), then times ``--steps`` real steps with ``overlap=True`` and
``overlap=False``, alternating ``--rounds`` times and keeping each one's best
round (slowest rank's mean step), and says whether the choice was the faster
(``kind: "steps"``).
"""

from __future__ import annotations

import argparse
import json
import os
import time

_ranks = int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("PMI_SIZE", "1")))
_threads = str(max(1, (os.cpu_count() or 1) // _ranks))
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, _threads)

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from mpishard import ShardingConfiguration  # noqa: E402
from mpishard.nn import MLP  # noqa: E402
from mpishard.optim import Adam  # noqa: E402
from mpishard.strategies import DDPOptimizer, ZeRO2Optimizer  # noqa: E402

STRATEGIES = {"ddp": DDPOptimizer, "zero2": ZeRO2Optimizer}


def emit(record: dict) -> None:
    if MPI.COMM_WORLD.rank == 0:
        print(json.dumps(record), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="784,1024,1024,10")
    parser.add_argument("--batch-per-rank", type=int, default=64)
    parser.add_argument("--bucket-mb", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    sizes = [int(v) for v in args.sizes.split(",")]
    config = ShardingConfiguration(comm)
    rng = np.random.default_rng(comm.rank)
    x = rng.standard_normal((args.batch_per_rank, sizes[0])).astype(np.float32)
    y = rng.integers(0, sizes[-1], args.batch_per_rank)
    for name in args.strategies:
        cls = STRATEGIES[name]
        opts = {}
        for overlap in ("auto", True, False):
            t0 = time.perf_counter()
            opts[overlap] = cls(Adam(lr=1e-4), config, bucket_mb=args.bucket_mb,
                                model=MLP(sizes, dtype=np.float32, seed=0), overlap=overlap)
            attach = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
            if overlap == "auto":
                emit({"kind": "auto", "strategy": name, "ranks": comm.size,
                      "attach_s": attach, **opts[overlap].overlap_timings})
        best = {True: float("inf"), False: float("inf")}
        for _ in range(args.rounds):
            for overlap in (True, False):
                opt = opts[overlap]
                opt.train_step(x, y)              # warm
                comm.Barrier()
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    opt.train_step(x, y)
                seconds = comm.allreduce((time.perf_counter() - t0) / args.steps, op=MPI.MAX)
                best[overlap] = min(best[overlap], seconds)
        chosen = opts["auto"].bucketed
        emit({"kind": "steps", "strategy": name, "ranks": comm.size, "sizes": sizes,
              "bucket_mb": args.bucket_mb, "during_s": best[True], "after_s": best[False],
              "auto_chose": "during" if chosen else "after",
              "faster": "during" if best[True] < best[False] else "after"})


if __name__ == "__main__":
    main()
