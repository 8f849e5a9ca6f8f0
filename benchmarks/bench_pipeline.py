"""Pipeline bubble, activation memory and 3D-layout step times, as JSON lines.

    mpirun -n 2 python benchmarks/bench_pipeline.py      # pp=2: bubble per schedule and m
    mpirun -n 4 python benchmarks/bench_pipeline.py      # pp=4, and every 4-rank layout

Part 1 (``"bench": "bubble"``): a GPT cut into ``p = world`` stages, for GPipe and
1F1B and ``m`` micro-batches. Each stage times its own forward/backward work
(``busy``) inside the step's wall time; the measured bubble is
``1 - busy / wall``, averaged over the stages, beside the closed form
``(p - 1) / (m + p - 1)``. ``activation_mib`` is the most activation memory a
stage holds (its micro-batch slots' workspaces and receive buffers).

Part 2 (``"bench": "layout"``): the same model and global batch on every
``(tp, pp, dp)`` layout of the world size, DDP inside the data group; step
time and samples/s.

With more ranks than cores the stages share cores, so the bubble is distorted
(an idle stage frees its core for another): the records say ``oversubscribed``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import mpishard  # noqa: F401  (limits BLAS threads per rank before NumPy loads)

# isort: split
import numpy as np
from mpi4py import MPI

from mpishard import ShardingConfiguration
from mpishard.nn import GPT
from mpishard.optim import Adam
from mpishard.pipeline import bubble_fraction
from mpishard.strategies import HybridShardedModel, HybridShardedOptimizer


def emit(record: dict) -> None:
    if MPI.COMM_WORLD.rank == 0:
        print(json.dumps(record), flush=True)


def build(comm, tp, pp, micro, schedule, args):
    factory = functools.partial(GPT, args.vocab, args.seq, args.d_model, args.heads,
                                args.layers, dtype=np.float32, seed=0)
    config = ShardingConfiguration(comm, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    model = HybridShardedModel(factory, config, micro_batches=micro, schedule=schedule)
    opt = HybridShardedOptimizer(Adam(lr=1e-4), config, model=model)
    return config, model, opt


def run(comm, model, opt, config, args, batch):
    rng = np.random.default_rng(config.groups.coordinates.dp)
    local = batch // config.topology.dp
    x = rng.integers(0, args.vocab, (local, args.seq))
    y = np.roll(x, -1, axis=1)
    for _ in range(2):
        opt.train_step(x, y)
    runner = model.runner
    runner.busy_seconds = runner.step_seconds = 0.0
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        opt.train_step(x, y)
    wall = comm.allreduce((time.perf_counter() - t0) / args.steps, op=MPI.MAX)
    busy = runner.busy_seconds / max(runner.step_seconds, 1e-12)
    return wall, busy


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--batch", type=int, default=32, help="global batch")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--micro", default="1,2,4,8")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    p = comm.size
    base = {"ranks": p, "oversubscribed": p > (os.cpu_count() or 1),
            "model": f"GPT V={args.vocab} T={args.seq} d={args.d_model} h={args.heads} "
                     f"L={args.layers}", "dtype": "float32", "global_batch": args.batch,
            "threads_per_rank": os.environ.get("OMP_NUM_THREADS")}
    if p > 1:
        for schedule in ("gpipe", "1f1b"):
            for m in (int(v) for v in args.micro.split(",")):
                config, model, opt = build(comm, 1, p, m, schedule, args)
                wall, busy = run(comm, model, opt, config, args, args.batch)
                busy_all = comm.gather(busy, root=0)
                slots = comm.gather(model.runner.slots, root=0)
                act = comm.allreduce(model.runner.activation_bytes(), op=MPI.MAX)
                if comm.rank == 0:
                    emit({**base, "bench": "bubble", "schedule": schedule, "stages": p,
                          "micro_batches": m, "step_s": wall,
                          "bubble_measured": 1 - float(np.mean(busy_all)),
                          "bubble_closed_form": bubble_fraction(p, m),
                          "busy_per_stage": [round(b, 3) for b in busy_all],
                          "slots_per_stage": slots, "activation_mib": act / 2**20})
                config.free()
    layouts = [(tp, pp, p // (tp * pp)) for tp in (1, 2, 4) for pp in (1, 2, 4)
               if p % (tp * pp) == 0 and args.heads % tp == 0 and pp <= args.layers + 2]
    for tp, pp, dp in layouts:
        config, model, opt = build(comm, tp, pp, 4 if pp > 1 else 1, "1f1b", args)
        wall, _ = run(comm, model, opt, config, args, args.batch)
        params = comm.allreduce(model.params.size, op=MPI.MAX)
        emit({**base, "bench": "layout", "tp": tp, "pp": pp, "dp": dp, "step_s": wall,
              "samples_per_s": args.batch / wall, "max_params_per_rank": params})
        config.free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
