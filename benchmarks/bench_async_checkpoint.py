"""What an asynchronous checkpoint costs the training, beside the synchronous save.

Run it under mpirun (2 ranks in the issue's measurement); one JSON line per result::

    mpirun -n 2 python benchmarks/bench_async_checkpoint.py --folder /tmp/ckasync

For each model (``small``: MLP 64-256-256-10, 85 K parameters; ``25M``: MLP
1024-4096-4096-1024, 25.2 M parameters; float32, Adam) and strategy (DDP,
ZeRO-3):

* ``blocking``: the time ``save_checkpoint(..., asynchronous=True)`` holds the
  caller (the slowest rank's; the save is then committed, untimed), against a
  plain ``np.copyto`` of the same bytes (the rank's snapshot: its share of the
  parameters and of the optimizer state) into buffers made beforehand, and
  against the synchronous ``save_checkpoint``; ``ratio`` is blocking / copy;
* ``window``: the wall time of ``--steps`` optimizer steps (``optimize()``, one
  global batch of 16 rows per step) with one checkpoint at the middle step
  through a ``CheckpointManager`` (durable, keep 2), ``sync`` or ``async``
  (polled after every step, committed by the end of the window, which the time
  includes), against the same window with none; ``loss`` is
  ``window / none - 1`` (the throughput lost), ``steps_lost`` that in steps.

Variants alternate within each repeat (their order rotates), ``--repeats``
times; min and median are printed. Times are the slowest rank's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from typing import Any

import numpy as np
from mpi4py import MPI

from mpishard import ShardingConfiguration
from mpishard.checkpoint import CheckpointManager, background, save_checkpoint, wait_for_checkpoint
from mpishard.nn import MLP
from mpishard.optim import Adam
from mpishard.strategies import DDPOptimizer, ZeRO3Optimizer

WORLD = MPI.COMM_WORLD
MODELS = {"small": [64, 256, 256, 10], "25M": [1024, 4096, 4096, 1024]}
STRATEGIES = {"ddp": DDPOptimizer, "zero3": ZeRO3Optimizer}
BATCH = 16


def emit(record: dict[str, Any]) -> None:
    if WORLD.rank == 0:
        print(json.dumps(record), flush=True)


def slowest(seconds: float) -> float:
    return WORLD.allreduce(seconds, op=MPI.MAX)


def stats(xs: list[float]) -> dict[str, float]:
    return {"min": round(min(xs), 6), "median": round(statistics.median(xs), 6)}


def make(model_name: str, strategy_name: str):
    sizes = MODELS[model_name]
    model = MLP(sizes, activation="relu", seed=1, dtype=np.float32)
    strategy = STRATEGIES[strategy_name](Adam(lr=1e-4), ShardingConfiguration(WORLD))
    strategy.attach(model)
    rng = np.random.default_rng(0)
    rows = BATCH * 400
    x = rng.standard_normal((rows, sizes[0]), dtype=np.float32)
    y = rng.integers(0, sizes[-1], rows)
    return model, strategy, (x, y)


def blocking(model_name: str, strategy_name: str, folder: str, repeats: int) -> None:
    model, strategy, data = make(model_name, strategy_name)
    strategy.optimize(model, data, epochs=1, batch_size=BATCH, max_steps=2)
    path = os.path.join(folder, "blocking.h5")
    save_checkpoint(path, model, strategy, asynchronous=True)   # the buffers, made once
    wait_for_checkpoint()
    buffers = background._SNAPSHOT.buffers
    sources = [np.random.default_rng(1).standard_normal(b.shape).astype(b.dtype) for b in buffers]
    copies = [np.empty_like(b) for b in buffers]
    nbytes = sum(b.nbytes for b in buffers)
    times: dict[str, list[float]] = {"async": [], "copy": [], "sync": []}

    def run(kind: str) -> None:
        WORLD.Barrier()
        t0 = time.perf_counter()
        if kind == "async":
            save_checkpoint(path, model, strategy, asynchronous=True)
        elif kind == "sync":
            save_checkpoint(path, model, strategy)
        else:
            for s, c in zip(sources, copies):
                np.copyto(c, s)
        times[kind].append(slowest(time.perf_counter() - t0))
        wait_for_checkpoint()

    kinds = list(times)
    for r in range(repeats):
        for kind in kinds[r % 3:] + kinds[:r % 3]:
            run(kind)
    ratio = [a / c for a, c in zip(times["async"], times["copy"])]
    emit({"bench": "async_checkpoint", "what": "blocking", "model": model_name,
          "params": model.layout.size, "strategy": strategy_name, "ranks": WORLD.size,
          "snapshot_bytes_per_rank": nbytes, "repeats": repeats,
          **{f"{k}_s": stats(v) for k, v in times.items()}, "ratio": stats(ratio)})


def window(model_name: str, strategy_name: str, folder: str, steps: int, repeats: int) -> None:
    model, strategy, data = make(model_name, strategy_name)
    strategy.optimize(model, data, epochs=1, batch_size=BATCH, max_steps=2)   # warm
    times: dict[str, list[float]] = {"none": [], "sync": [], "async": []}

    def run(kind: str) -> None:
        sub = os.path.join(folder, f"window-{kind}")
        manager = None if kind == "none" else CheckpointManager(sub, keep=2,
                                                                async_=kind == "async")
        start = strategy.step_count
        middle = start + steps // 2

        def callback(step: int, loss: float) -> None:
            if manager is not None:
                if step == middle:
                    manager.save(model, strategy)
                manager.poll()

        WORLD.Barrier()
        t0 = time.perf_counter()
        strategy.optimize(model, data, epochs=10**6, batch_size=BATCH,
                          max_steps=start + steps, callback=callback)
        if manager is not None:
            manager.wait()
        times[kind].append(slowest(time.perf_counter() - t0))

    kinds = list(times)
    for r in range(repeats):
        for kind in kinds[r % 3:] + kinds[:r % 3]:
            run(kind)
    none = times["none"]
    for kind in ("sync", "async"):
        loss = [t / n - 1 for t, n in zip(times[kind], none)]
        emit({"bench": "async_checkpoint", "what": "window", "model": model_name,
              "params": model.layout.size, "strategy": strategy_name, "ranks": WORLD.size,
              "steps": steps, "checkpoint": kind, "repeats": repeats,
              "window_s": stats(times[kind]), "none_s": stats(none),
              "step_s": round(statistics.median(none) / steps, 6),
              "loss": stats(loss),
              "steps_lost": stats([x * steps for x in loss])})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", default="/tmp/mpishard-bench-async")
    parser.add_argument("--models", default="small,25M")
    parser.add_argument("--strategies", default="ddp,zero3")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--what", default="blocking,window")
    args = parser.parse_args()
    if WORLD.rank == 0:
        os.makedirs(args.folder, exist_ok=True)
    WORLD.Barrier()
    emit({"bench": "async_checkpoint", "what": "machine", "cpus": os.cpu_count(),
          "load_1min": round(os.getloadavg()[0], 2), "ranks": WORLD.size})
    for m in args.models.split(","):
        for s in args.strategies.split(","):
            if "blocking" in args.what:
                blocking(m, s, args.folder, args.repeats)
            if "window" in args.what:
                window(m, s, args.folder, args.steps, args.repeats)
    WORLD.Barrier()
    if WORLD.rank == 0:
        shutil.rmtree(args.folder, ignore_errors=True)


if __name__ == "__main__":
    main()
