"""Peak memory per rank of training on rank-local rows, against gathering them everywhere.

    python benchmarks/bench_local_data.py --ranks 2 --rows 25000,100000,400000 --features 64

For each number of rows per rank and each mode, starts ``mpirun -n RANKS`` of
this script as a worker. Every rank makes its own ``rows`` x ``features``
float64 rows (a simulation's part), then trains a small MLP with DDP for
``--steps`` steps of global batch ``--batch``:

* ``local``: on ``LocalDataset(x, y, config)``; each batch's rows move by
  ``Alltoallv`` (O(local rows + batch) per rank);
* ``replicated``: the rows gathered onto every rank first (one ``Allgather``
  into preallocated arrays: the cheapest form of what a user had to do
  before), then ``optimize(model, (X, Y))``.

Prints one JSON line per run: the peak resident memory of the ranks (max over
ranks) before the data was made, at the end, and the difference, next to the
bytes of the local rows and of the union. Peak RSS (``ru_maxrss``) is per
process, so each run is a fresh job.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def worker(args: argparse.Namespace) -> None:
    import numpy as np
    from mpi4py import MPI

    from mpishard import ShardingConfiguration
    from mpishard.data import LocalDataset
    from mpishard.nn import MLP
    from mpishard.optim import Adam
    from mpishard.strategies import DDPOptimizer
    from mpishard.train import peak_rss_bytes

    comm = MPI.COMM_WORLD
    config = ShardingConfiguration(comm)
    model = MLP([args.features, 16, 4], activation="tanh", dtype=np.float64, seed=1)
    opt = DDPOptimizer(Adam(lr=1e-3), config, model=model)
    before = peak_rss_bytes()
    rng = np.random.default_rng(comm.rank)
    x = rng.standard_normal((args.rows, args.features))
    y = rng.integers(0, 4, args.rows)
    if args.mode == "local":
        data = LocalDataset(x, y, config)
    else:   # the least a copy everywhere costs: one Allgather into the union's arrays
        X = np.empty((comm.size * args.rows, args.features))
        Y = np.empty(comm.size * args.rows, dtype=y.dtype)
        comm.Allgather(x, X)
        comm.Allgather(y, Y)
        del x, y
        data = (X, Y)
    result = opt.optimize(model, data, epochs=1, batch_size=args.batch, max_steps=args.steps)
    peaks = comm.gather((before, peak_rss_bytes()), root=0)
    if comm.rank == 0:
        row_bytes = args.features * 8 + 8
        print(json.dumps({
            "bench": "local_data", "mode": args.mode, "ranks": comm.size,
            "rows_per_rank": args.rows, "features": args.features, "batch": args.batch,
            "steps": result.steps, "local_rows_mib": args.rows * row_bytes / 2**20,
            "union_rows_mib": comm.size * args.rows * row_bytes / 2**20,
            "rss_before_data_mib": max(b for b, _ in peaks) / 2**20,
            "peak_rss_mib": max(p for _, p in peaks) / 2**20,
            "peak_minus_before_mib": max(p - b for b, p in peaks) / 2**20,
            "samples_per_s": result.samples_per_second}), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rows", default="25000,100000,400000",
                        help="rows per rank, comma-separated")
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--modes", default="local,replicated")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="local", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.rows = int(args.rows)
        worker(args)
        return 0
    env = dict(os.environ)
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    flags = os.environ.get("MPISHARD_MPIRUN_FLAGS", "--oversubscribe").split()
    for rows in (int(r) for r in args.rows.split(",")):
        for mode in args.modes.split(","):
            cmd = ["mpirun", *flags, "-n", str(args.ranks), sys.executable, __file__,
                   "--worker", "--mode", mode, "--rows", str(rows),
                   "--features", str(args.features), "--batch", str(args.batch),
                   "--steps", str(args.steps)]
            proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, timeout=600)
            if proc.returncode != 0:
                print(proc.stdout, file=sys.stderr)
                return 1
            print(proc.stdout.strip().splitlines()[-1], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
