"""A ZeRO-3 recovery from a SIGKILLed rank (ULFM): its seconds, bytes moved and peak.

Each trial is one ``mpirun --with-ft ulfm -n N`` job of the fault-tolerant runtime
(``.venv-ft``): a float64 MLP of ``--layers`` hidden layers of ``--width``
(Adam) trained by ``ZeRO3Optimizer.optimize()`` with buddy copies; a seeded rank
SIGKILLs itself in its forward at a seeded step; the survivors recover in place.
Prints one JSON line per world size: the median over trials of the recovery's
seconds (``recover_in_place``, shrink included), its shrink, the bytes this
survivor sent to re-split the state (``moved_bytes``; None where the tree
measured has no such field: before 0.6 the survivors put the whole vectors
together with an ``Allreduce`` of all of them), and the peak of what the
recovery call allocated on a survivor (``tracemalloc``), beside the bytes of
the whole parameters with their Adam state and of one new shard of them.

Run (``source scripts/mpienv.sh`` first; the jobs import ``mpishard`` from the
working directory: run it from another checkout to measure that one):
``.venv/bin/python benchmarks/bench_zero3_recovery.py --sizes 4 8 --trials 3``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

JOB = r"""
import json, os, signal, time, tracemalloc
import numpy as np
from mpi4py import MPI
from mpishard import ShardingConfiguration
from mpishard.comm import ulfm
from mpishard.nn import MLP
from mpishard.optim import Adam
from mpishard.strategies import ZeRO3Optimizer
import mpishard.recovery.policy as policy

VICTIM, KILL, WIDTH, LAYERS = {victim}, {kill}, {width}, {layers}
rank, n = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size
BATCH = 2 * n * (n - 1)          # splits over N ranks and over the N - 1 survivors
rng = np.random.default_rng(0)
X, Y = rng.standard_normal((8 * BATCH, 16)), rng.integers(0, 4, 8 * BATCH)
model = MLP([16] + [WIDTH] * LAYERS + [4], activation="tanh", dtype=np.float64, seed=1)
config = ShardingConfiguration(MPI.COMM_WORLD, timeout=120, fault_tolerance="ulfm")
opt = ZeRO3Optimizer(Adam(lr=1e-3), config, model=model, bucket_mb=1, buddy_copies=True)
size = model.layout.size
if rank == VICTIM:
    real = model.forward_backward
    def forward_backward(*a, **k):
        if opt.step_count == KILL:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*a, **k)
    model.forward_backward = forward_backward
real_recover, peaks = policy.recover_in_place, []
def recover_in_place(*a, **k):
    tracemalloc.start()
    try:
        return real_recover(*a, **k)
    finally:
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
policy.recover_in_place = recover_in_place
result = opt.optimize(model, (X, Y), epochs=1, batch_size=BATCH, seed=3)
every = opt.config.world.allgather((peaks, result.recoveries))
if opt.config.world.rank == 0:
    print("RESULT " + json.dumps({{"every": every, "size": size,
                                  "shard": len(opt.core.shard)}}), flush=True)
ulfm.leave(0)
"""


def _trial(ft: Path, n: int, seed: int, width: int, layers: int) -> dict:
    victim, kill = seed % n, 2 + seed % 4
    code = JOB.format(victim=victim, kill=kill, width=width, layers=layers)
    cmd = [str(ft / "bin" / "mpirun"), "--with-ft", "ulfm", "--mca", "coll", "^han",
           "--oversubscribe", "-n", str(n), str(ft / "bin" / "python"), "-c", code]
    proc = subprocess.Popen(cmd, env=dict(os.environ, OMPI_MCA_mpi_yield_when_idle="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
    found = re.search(r"^RESULT (\{.*\})$", out, re.MULTILINE)
    if not found:
        raise RuntimeError(f"no result from the {n}-rank job:\n{out[-2000:]}")
    result = json.loads(found.group(1))
    recs = [r for _, recs in result["every"] for r in recs]
    return {"seconds": max(r["seconds"] for r in recs),
            "shrink": max(r["shrink_seconds"] for r in recs),
            "moved_bytes": max((r.get("moved_bytes") or 0 for r in recs), default=0) or None,
            "peak": max(p for peaks, _ in result["every"] for p in peaks),
            "whole_bytes": 3 * result["size"] * 8, "shard_bytes": 3 * result["shard"] * 8}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=16)
    args = parser.parse_args()
    ft = REPO / ".venv-ft"
    if not (ft / "bin" / "mpirun").exists():
        sys.exit("no .venv-ft/bin/mpirun: the fault-tolerant runtime (scripts/setup.sh --ft)")
    for n in args.sizes:
        trials = [_trial(ft, n, seed, args.width, args.layers) for seed in range(args.trials)]
        line = {"bench": "zero3_recovery", "world": n, "trials": len(trials),
                "tree": os.getcwd()}
        for key in ("seconds", "shrink", "peak"):
            line[key] = statistics.median(t[key] for t in trials)
        line["moved_bytes"] = trials[0]["moved_bytes"]
        line["whole_bytes"] = trials[0]["whole_bytes"]
        line["new_shard_bytes"] = trials[0]["shard_bytes"]
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
