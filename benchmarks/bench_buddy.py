"""What ZeRO-2's buddy copies cost (mpishard.recovery.ShardBuddy).

Run under MPI (``mpirun -n 4 python benchmarks/bench_buddy.py --widths 1024 2048``):
for each MLP width, two ZeRO-2 strategies with Adam on two copies of the model,
one plain and one with a buddy (the copies of the neighbour's shard, its own shard
from before each update, one exchange a step), trained in alternation; prints one
JSON line per width (rank 0): parameters, the copies' bytes per rank against the
state's and the parameters', the median seconds of a plain step and of a step with
the copies (the slowest rank's, over ``--repeat`` rounds), and their ratio.
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
from mpishard.parallel import ZeRO2Core
from mpishard.recovery import ShardBuddy


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
        plain_model = MLP([64, width, width, 64], dtype=np.float32, seed=1)
        model = MLP([64, width, width, 64], dtype=np.float32, seed=1)
        plain = ZeRO2Core(Adam(lr=1e-3), config, model=plain_model,
                               reduce_method="reduce_scatter")
        opt = ZeRO2Core(Adam(lr=1e-3), config, model=model, reduce_method="reduce_scatter")
        x = rng.standard_normal((args.rows // world.size, 64)).astype(np.float32)
        y = rng.integers(0, 64, args.rows // world.size)
        buddy = ShardBuddy(opt)
        plain_steps, steps, exchanges = [], [], []
        for _ in range(args.repeat + 1):
            world.barrier()
            t0 = time.perf_counter()
            plain.train_step(x, y)
            t1 = time.perf_counter()
            world.barrier()
            t2 = time.perf_counter()
            opt.train_step(x, y)      # with the copy of its shard from before the update
            t3 = time.perf_counter()
            buddy.exchange()
            t4 = time.perf_counter()
            plain_steps.append(world.allreduce_scalar(t1 - t0, op="max"))
            steps.append(world.allreduce_scalar(t4 - t2, op="max"))
            exchanges.append(world.allreduce_scalar(t4 - t3, op="max"))
        assert np.array_equal(plain_model.params, model.params)   # the copies change nothing
        if world.rank == 0:
            plain_s, with_s = statistics.median(plain_steps[1:]), statistics.median(steps[1:])
            print(json.dumps({"ranks": world.size, "params": int(model.params.size),
                              "buddy_bytes_per_rank": buddy.nbytes,
                              "state_bytes_per_rank": sum(v.nbytes for v in opt.state.values()),
                              "param_bytes_per_rank": int(model.params.nbytes),
                              "step_s": plain_s, "step_with_copies_s": with_s,
                              "exchange_s": statistics.median(exchanges[1:]),
                              "ratio": with_s / plain_s}), flush=True)
    config.free()


if __name__ == "__main__":
    main()
