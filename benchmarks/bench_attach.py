"""Seconds to build a strategy on a model (its attach), by strategy and ``overlap``.

Run under mpirun; prints JSON lines on rank 0::

    for n in 2 4 8 16 32; do
        mpirun --oversubscribe -n $n python benchmarks/bench_attach.py
    done

Each build makes ``DDPOptimizer``, ``ZeRO2Optimizer`` or ``ZeRO3Optimizer`` with
``model=`` (an MLP, ``--sizes``, float32, Adam, the default 25 MiB buckets) on a
configuration made once, behind a barrier; its time is the slowest rank's. The
modes (``--modes``):

* ``ddp-measure``: ``overlap="measure"``, the stand-in backward at every
  attach, unbounded: what DDP's default ``"auto"`` did in 0.5 (before);
* ``ddp-auto``: DDP's default now (after): recorded, modelled or measured within
  the budget; each build forgets the decisions of the ones before, as a new job
  would (``ddp-auto-again`` keeps them: a second build, or a rebuild, on the
  same layout);
* ``ddp-budget``: ``"auto"`` with the model's rules switched off, so that it
  measures within its budget (``--budget``): what a job across nodes without a
  record pays at most;
* ``zero2``, ``zero3``: their default (``overlap=True``: no decision to make).

Each mode: ``--builds`` builds (after one not counted), min and median, and how
the last one decided (``source``, ``decision``, ``decide_s``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

_ranks = int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("PMI_SIZE", "1")))
_threads = str(max(1, (os.cpu_count() or 1) // _ranks))
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, _threads)

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mpishard.parallel.overlap as overlap  # noqa: E402
from mpishard import ShardingConfiguration, __version__  # noqa: E402
from mpishard.nn import MLP  # noqa: E402
from mpishard.optim import Adam  # noqa: E402
from mpishard.strategies import DDPOptimizer, ZeRO2Optimizer, ZeRO3Optimizer  # noqa: E402

MODES = {
    "ddp-measure": (DDPOptimizer, {"overlap": "measure"}),
    "ddp-auto": (DDPOptimizer, {}),
    "ddp-auto-again": (DDPOptimizer, {}),
    "ddp-budget": (DDPOptimizer, {}),
    "zero2": (ZeRO2Optimizer, {}),
    "zero3": (ZeRO3Optimizer, {}),
}


def build_seconds(comm: MPI.Comm, config: ShardingConfiguration, mode: str,
                  sizes: list[int]) -> tuple[float, object]:
    """One build of ``mode``'s strategy: the slowest rank's seconds, and the strategy."""
    cls, options = MODES[mode]
    if mode != "ddp-auto-again":
        overlap.forget_decisions()
    model = MLP(sizes, dtype=np.float32, seed=0)
    comm.Barrier()
    t0 = time.perf_counter()
    dist = cls(Adam(lr=1e-3), config, model=model, **options)
    seconds = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
    return seconds, dist


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64,256,256,10")
    parser.add_argument("--builds", type=int, default=3)
    parser.add_argument("--budget", type=float, default=overlap.PROBE_BUDGET)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    sizes = [int(v) for v in args.sizes.split(",")]
    overlap.PROBE_BUDGET = args.budget
    t0 = time.perf_counter()
    config = ShardingConfiguration(comm)
    config_s = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
    for mode in args.modes:
        if mode == "ddp-budget":
            rules, overlap.modelled_overlap = overlap.modelled_overlap, lambda *a, **k: None
        times, dist = [], None
        for i in range(args.builds + 1):
            seconds, dist = build_seconds(comm, config, mode, sizes)
            if i:
                times.append(seconds)
        if mode == "ddp-budget":
            overlap.modelled_overlap = rules
        decided = dist.overlap_timings
        if comm.rank == 0:
            print(json.dumps({
                "bench": "attach", "version": __version__, "ranks": comm.size,
                "nodes": config.groups.nodes.nodes if config.groups.nodes else None,
                "mode": mode, "sizes": sizes, "builds": len(times),
                "min_s": round(min(times), 4), "median_s": round(statistics.median(times), 4),
                "config_s": round(config_s, 4),
                "attach_s_rank0": round(dist.core.attach_seconds, 4),
                "source": decided.get("source"), "decision": bool(dist.bucketed),
                "decide_s": (round(decided["seconds"], 4) if "seconds" in decided else None),
                "reason": decided.get("reason")}), flush=True)
    config.free()


if __name__ == "__main__":
    main()
