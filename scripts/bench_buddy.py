"""What ZeRO-2's buddy copy costs (mpishard.parallel.recovery.ShardBuddy).

Run under MPI (``mpirun -n 4 python scripts/bench_buddy.py --widths 1024 2048``):
for each MLP width, a ZeRO-2 strategy with Adam; prints one JSON line per width
(rank 0): parameters, the copy's bytes per rank (one more optimizer-state shard),
the median seconds of one exchange with the neighbours, and of one training step
without it, over ``--repeat`` repetitions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mpishard  # noqa: F401  (thread limits before NumPy)

# isort: split
import numpy as np

from mpishard import ShardingConfiguration
from mpishard.nn import MLP
from mpishard.optim import Adam
from mpishard.parallel import ZeRO2Optimizer
from mpishard.parallel.recovery import ShardBuddy


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--widths", type=int, nargs="+", default=[512, 1024, 2048])
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--rows", type=int, default=64)
    args = p.parse_args()
    config = ShardingConfiguration()
    world = config.world
    rng = np.random.default_rng(0)
    for width in args.widths:
        model = MLP([64, width, width, 64], dtype=np.float32, seed=1)
        opt = ZeRO2Optimizer(Adam(lr=1e-3), config, model=model, reduce_method="reduce_scatter")
        x = rng.standard_normal((args.rows // world.size, 64)).astype(np.float32)
        y = rng.integers(0, 64, args.rows // world.size)
        buddy = ShardBuddy(opt)
        steps, exchanges = [], []
        for _ in range(args.repeat + 1):
            world.barrier()
            t0 = time.perf_counter()
            opt.train_step(x, y)
            t1 = time.perf_counter()
            buddy.exchange()
            t2 = time.perf_counter()
            steps.append(world.allreduce_scalar(t1 - t0, op="max"))
            exchanges.append(world.allreduce_scalar(t2 - t1, op="max"))
        if world.rank == 0:
            print(json.dumps({"ranks": world.size, "params": int(model.params.size),
                              "buddy_bytes_per_rank": buddy.nbytes,
                              "state_bytes_per_rank": sum(v.nbytes for v in opt.state.values()),
                              "step_s": statistics.median(steps[1:]),
                              "exchange_s": statistics.median(exchanges[1:])}), flush=True)
    config.free()


if __name__ == "__main__":
    main()
