"""ZeRO-3 against ZeRO-2 and DDP: memory per rank and step time (JSON lines on rank 0).

    flock /tmp/mpishard-bench.lock mpirun -n 4 python benchmarks/bench_zero3.py
    flock /tmp/mpishard-bench.lock mpirun -n 2 python benchmarks/bench_zero3.py --what step
    flock /tmp/mpishard-bench.lock python benchmarks/bench_zero3.py --cluster --link-gbit 1

``--what memory``: each strategy trains a few steps of the large MLP of
``bench_strategies.py`` (1024-4096-4096-1024-10, 25.2M parameters, float32, Adam,
batch 64 per rank) and of GPTs of two depths, and reports the most bytes any rank
holds (``memory_report()``: parameters, gathered parameters, gradients, optimizer
state, buffers, the peak since attach, and the most parameter bytes gathered at
once) with the model's activations, against ``--budget-mib`` per rank. The
deeper GPT is sized so that DDP's parameters, gradients and Adam state do not fit
the budget. From the two depths each strategy's bytes are a line, ``a *
parameters + c``: ``parameters_that_fit`` is ``(budget - c) / a``. Note: the
model is built whole on every rank and sharded when the strategy attaches it; the
figures are what stays resident for training. ZeRO-3's lines add the two
ratios of the issue's target: ``resident_over_shard_plus_two_buckets`` (the
shard and the gather buffers over the shard and the two largest neighbouring
gather buckets, what prefetch needs at once) and
``state_over_shards_plus_two_buckets`` (the peak of parameters, gradients,
state and buffers over the shards of the three and those two buckets: the
gradient buffers, ``gradient_buffer_bytes``, are the difference; they are
bounded by the bucket, or the largest piece a layer writes whole, since the
gradient is handed over by piece: ``mpishard.nn.handover``). ``--deep-layers`` adds a deep GPT for
the ZeRO-3 variants only. Options are the strategies' defaults
(``bucket_mb="auto"`` for ZeRO-3) unless ``--bucket-mb`` is given.

``--what step``: step time of ZeRO-2 and of ZeRO-3 with prefetch, without, and
keeping what the forward gathered, the variants alternating step by step over
``--rounds`` rounds of ``--steps`` steps each (so a slow spell of the machine
hits all alike); min and median of the per-step times (the slowest rank's), with
the parts of the step (medians).

``--cluster``: the namespace cluster (``scripts/cluster-local.sh``; root) with
its links capped at ``--link-gbit``; for each layout NODESxRANKS of
``--layouts`` it runs itself under ``mpirun`` across the nodes: the link and
flat-allreduce lines of ``bench_nodes.py`` (the cost model's calibration), then
ZeRO-2 and ZeRO-3 (prefetch on and off) steps of an MLP of ``--step-mib`` MiB
(float64), alternating, as ``{"kind": "zero_step", ...}`` lines that
``mpishard plan --validate`` predicts.

Set OMP_NUM_THREADS (the script defaults it to cores / ranks).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

_ranks = int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("PMI_SIZE", "1")))
_threads = str(max(1, (os.cpu_count() or 1) // _ranks))
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, _threads)

REPO = Path(__file__).resolve().parents[1]
CLUSTER = REPO / "scripts" / "cluster-local.sh"
MLP_LARGE = [1024, 4096, 4096, 1024, 10]
BATCH_PER_RANK = 64
# GPT: vocabulary, sequence, width, heads; the depth varies.
GPT_SHAPE = (512, 64, 256, 8)
GPT_ROWS = 8                 # sequences per rank
#: name -> (strategy, options)
VARIANTS = {
    "ddp": ("ddp", {}),
    "zero2": ("zero2", {}),
    "zero3": ("zero3", {}),
    "zero3-no-prefetch": ("zero3", {"prefetch": False}),
    "zero3-keep": ("zero3", {"keep_gathered": True}),
}


def _mpi():
    import mpishard  # noqa: F401  (limits BLAS threads before NumPy loads)

    # isort: split
    from mpi4py import MPI

    return MPI


def emit(record: dict) -> None:
    if _mpi().COMM_WORLD.rank == 0:
        print(json.dumps(record), flush=True)


def make_strategy(name: str, config, model, bucket_mb: float | None):
    from mpishard.optim import Adam
    from mpishard.strategies import STRATEGIES

    kind, options = VARIANTS[name]
    entry = STRATEGIES[kind]
    if entry.cost.reduce_scatter:   # pinned: "auto" would time the two at every attach
        options = {"reduce_method": "reduce_scatter", **options}
    if bucket_mb is not None:
        options = {"bucket_mb": bucket_mb, **options}
    return entry.public_class(Adam(lr=1e-4), config, model=model, **options)


def make_model(kind: str, layers: int = 0):
    import numpy as np

    from mpishard.nn import GPT, MLP

    if kind == "mlp":
        return MLP(MLP_LARGE, dtype=np.float32, seed=0)
    vocab, seq, d, heads = GPT_SHAPE
    return GPT(vocab, seq, d, heads, layers, dtype=np.float32, seed=0)


def batch_of(kind: str, rank: int):
    import numpy as np

    rng = np.random.default_rng(rank)
    if kind == "mlp":
        return (rng.standard_normal((BATCH_PER_RANK, MLP_LARGE[0])).astype(np.float32),
                rng.integers(0, MLP_LARGE[-1], BATCH_PER_RANK))
    vocab, seq = GPT_SHAPE[:2]
    x = rng.integers(0, vocab, (GPT_ROWS, seq))
    return x, np.roll(x, -1, axis=1)


# --- memory ----------------------------------------------------------------------------------
def memory(args) -> None:
    from mpishard import ShardingConfiguration
    from mpishard.flat import unit_ranges

    comm = _mpi().COMM_WORLD
    budget = args.budget_mib * 2**20
    # GPT depths: the deeper one does not fit the budget under DDP (16 bytes a parameter).
    models = [("mlp", 0), ("gpt", args.gpt_layers[0]), ("gpt", args.gpt_layers[1])]
    if args.deep_layers:
        models.append(("gpt", args.deep_layers))
    lines: dict[str, list[tuple[int, int]]] = {}
    for kind, layers in models:
        deep = kind == "gpt" and layers not in args.gpt_layers
        for name in args.variants:
            if deep and not name.startswith("zero3"):
                continue
            config = ShardingConfiguration(comm)
            model = make_model(kind, layers)
            n, itemsize = model.layout.size, model.params.itemsize
            largest = max(len(u) for u in unit_ranges(model.layout)) * itemsize
            dist = make_strategy(name, config, model, args.bucket_mb)
            x, y = batch_of(kind, comm.rank)
            for _ in range(args.memory_steps):
                dist.train_step(x, y)
            report = dist.memory_report()
            acts = model.activation_bytes()
            mine = {**report, "activations": acts}
            worst = {k: max(v for v in comm.allgather(val) if v is not None)
                     for k, val in mine.items()}
            shard = -(-n // comm.size) * itemsize
            total = worst["peak"] + worst["activations"]
            label = kind + (f"-{layers}-layers" if layers else "")
            record = {"kind": "memory", "model": label,
                      "parameters": n, "ranks": comm.size, "strategy": name,
                      "dtype": "float32", "memory": worst, "peak_with_activations": total,
                      "budget_bytes": budget, "fits": total <= budget,
                      "shard_bytes": shard, "largest_layer_bytes": largest}
            if name.startswith("zero3"):
                resident = worst["parameters"] + worst["gathered"]
                record["resident_parameter_bytes"] = resident
                record["resident_over_shard_plus_largest_layer"] = resident / (shard + largest)
                record.update(_two_buckets(dist, worst, shard, itemsize, resident))
            emit(record)
            if kind == "gpt" and not deep:
                lines.setdefault(name, []).append((n, total))
            del dist, model
            config.free()
    # Each strategy's bytes as a line in the parameters: what fits the budget.
    for name, points in lines.items():
        (n1, b1), (n2, b2) = points
        slope = (b2 - b1) / (n2 - n1)
        fixed = b1 - slope * n1
        emit({"kind": "fits_in_budget", "ranks": comm.size, "strategy": name,
              "budget_bytes": budget, "bytes_per_parameter": slope, "fixed_bytes": fixed,
              "parameters_that_fit": int((budget - fixed) / slope),
              "from": f"GPT of {args.gpt_layers[0]} and {args.gpt_layers[1]} layers"})


def _two_buckets(dist, worst: dict, shard: int, itemsize: int, resident: int) -> dict:
    """ZeRO-3's ratios against the shards and two gather buckets (the two largest
    neighbouring ones: what prefetch holds at once)."""
    gather = dist.core.gather
    if gather is None:
        return {}
    sizes = [len(b) for b in gather.ranges]
    pair = max((a + b for a, b in zip(sizes, sizes[1:])), default=sizes[0]) * itemsize
    shards = worst["parameters"] + worst["optimizer_state"] + shard   # + the gradient's
    grads = dist.core.buckets
    return {"gather_bucket_elements": dist.core.placement.gather_elements,
            "bucket_elements": dist.core.bucket_elements, "two_gather_buckets_bytes": pair,
            "gradient_buckets": len(grads.ranges),
            "gradient_buffer_bytes": sum(int(b.nbytes) for b in grads.buffers),
            "resident_over_shard_plus_two_buckets": resident / (shard + pair),
            "state_over_shards_plus_two_buckets": worst["peak"] / (shards + pair)}


# --- step time --------------------------------------------------------------------------------
def step_time(args) -> None:
    from mpishard import ShardingConfiguration

    comm = _mpi().COMM_WORLD
    names = ["zero2", "zero3", "zero3-no-prefetch", "zero3-keep"]
    for kind, layers in (("mlp", 0), ("gpt", args.gpt_layers[1])):
        if kind not in args.step_models:
            continue
        runs = {}
        for name in names:
            config = ShardingConfiguration(comm)
            model = make_model(kind, layers)
            dist = make_strategy(name, config, model, args.bucket_mb)
            runs[name] = (config, model, dist, [], {k: [] for k in dist.timings})
        x, y = batch_of(kind, comm.rank)
        for name in names:                      # warm-up: buffers, workspaces
            for _ in range(2):
                runs[name][2].train_step(x, y)
        for _ in range(args.rounds):
            for _ in range(args.steps):
                for name in names:              # alternating, step by step
                    _, _, dist, times, parts = runs[name]
                    dist.reset_timings()
                    comm.Barrier()
                    t0 = time.perf_counter()
                    dist.train_step(x, y)
                    times.append(comm.allreduce(time.perf_counter() - t0, op=_mpi().MAX))
                    for k, v in dist.timings.items():
                        parts[k].append(comm.allreduce(v, op=_mpi().MAX))
        base = statistics.median(runs["zero2"][3])
        base_min = min(runs["zero2"][3])
        for name in names:
            config, model, dist, times, parts = runs[name]
            emit({"kind": "step", "model": kind + (f"-{layers}-layers" if layers else ""),
                  "parameters": model.layout.size, "ranks": comm.size, "variant": name,
                  "steps": len(times), "min_s": min(times), "median_s": statistics.median(times),
                  "median_over_zero2": statistics.median(times) / base,
                  "min_over_zero2": min(times) / base_min,
                  "parts_median_s": {k: statistics.median(v) for k, v in parts.items()},
                  "memory_peak": dist.memory_report()["peak"]})
        for config, *_ in runs.values():
            config.free()


# --- the namespace cluster ----------------------------------------------------------------------
def cluster_worker(args) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_nodes
    import numpy as np

    from mpishard import ShardingConfiguration
    from mpishard.nn import MLP
    from mpishard.optim import SGD
    from mpishard.strategies import ZeRO2Optimizer, ZeRO3Optimizer

    # The calibration lines of bench_nodes.py (links, flat and hierarchical reductions).
    bench_nodes._worker(argparse.Namespace(mib=[args.step_mib], repeats=args.repeats,
                                           ddp_steps=0, ddp_mib=args.step_mib,
                                           link_gbit=args.link_gbit))
    config = ShardingConfiguration()
    world, nodes = config.world, config.groups.nodes
    layout = f"{nodes.nodes}x{world.size // nodes.nodes}" + ("" if nodes.contiguous else "rr")
    # A flat allgather of the same bytes (the cost model calibrates allgather_cost
    # from the one-node run's, against its flat allreduce).
    buf = np.ones(int(args.step_mib * (1 << 17)))
    counts = [len(r) for r in np.array_split(np.arange(buf.size), world.size)]
    best = float("inf")
    for round_ in range(args.repeats + 1):
        world.barrier()
        t0 = time.perf_counter()
        world.Allgatherv(buf, counts)
        if round_:
            best = min(best, time.perf_counter() - t0)
    best = world.allreduce_scalar(best, op="max")
    if world.rank == 0:
        print(json.dumps({"layout": layout, "link_gbit": args.link_gbit, "kind": "reduction",
                          "op": "allgather", "way": "flat", "mib": args.step_mib,
                          "seconds": best, "busbw_gbs": (world.size - 1) / world.size
                          * buf.nbytes / best / 1e9}), flush=True)
    width = int((args.step_mib * (1 << 17) / 3) ** 0.5)
    sizes = [64, width, width, width, 10]
    local = 32
    rng = np.random.default_rng(world.rank)
    x = rng.standard_normal((local, 64))
    y = rng.integers(0, 10, local)
    variants = {"zero2": (ZeRO2Optimizer, {}), "zero3": (ZeRO3Optimizer, {}),
                "zero3-no-prefetch": (ZeRO3Optimizer, {"prefetch": False})}
    runs = {}
    for name, (cls, options) in variants.items():
        model = MLP(sizes, activation="relu", dtype=np.float64, seed=1)
        runs[name] = (model, cls(SGD(lr=1e-3), config, model=model, bucket_mb=1.0,
                                 reduce_method="reduce_scatter", **options), [])
    for _, dist, _ in runs.values():
        for _ in range(2):
            dist.train_step(x, y)
    for _ in range(args.cluster_steps):
        for _, dist, times in runs.values():
            world.barrier()
            t0 = time.perf_counter()
            dist.train_step(x, y)
            times.append(world.allreduce_scalar(time.perf_counter() - t0, op="max"))
    for name, (model, _, times) in runs.items():
        if world.rank == 0:
            print(json.dumps({
                "layout": layout, "link_gbit": args.link_gbit, "kind": "zero_step",
                "strategy": name.split("-")[0], "prefetch": name != "zero3-no-prefetch",
                "parameters": model.layout.size, "gradient_mib": model.layout.size * 8 / 2**20,
                "global_batch": local * world.size, "seconds_per_step": statistics.median(times),
                "min_s": min(times), "steps": len(times)}), flush=True)


def cluster_driver(args) -> int:
    env_file = Path(os.environ.get("MPISHARD_CLUSTER_DIR", "/run/mpishard-cluster")) / "env"
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_nodes import _sourced

    # The namespaces are the machine's, not this job's: `start` with another shape
    # stops a cluster that another job (a test run) may be using. Refuse instead.
    status = subprocess.run(["bash", str(CLUSTER), "status"], capture_output=True, text=True)
    if "] up" in status.stdout:
        sys.stderr.write("bench_zero3.py --cluster: a namespace cluster is up already (another "
                         "job's?); stop it (scripts/cluster-local.sh stop) once it is idle\n")
        return 3
    base = dict(os.environ)
    base.update(_sourced(REPO / "scripts" / "mpienv.sh"))
    worker = [sys.executable, str(Path(__file__).resolve()), "--cluster-worker",
              "--step-mib", str(args.step_mib), "--repeats", str(args.repeats),
              "--cluster-steps", str(args.cluster_steps), "--link-gbit", str(args.link_gbit)]
    for layout in args.layouts:
        nodes, per = (int(v) for v in layout.split("x"))
        cap = [] if not args.link_gbit else ["--link-gbit", str(args.link_gbit)]
        subprocess.run(["bash", str(CLUSTER), "start", "--nodes", str(nodes), "--slots",
                        str(per), *cap], check=True, stdout=subprocess.DEVNULL)
        try:
            env = {**base, **_sourced(env_file)}
            command = [*shlex.split(env["MPISHARD_CLUSTER_EXEC"]), "mpirun",
                       *shlex.split(env["MPISHARD_CLUSTER_MPIRUN_FLAGS"]),
                       "-n", str(nodes * per), *worker]
            proc = subprocess.run(command, env=env, text=True, capture_output=True,
                                  timeout=args.timeout)
            sys.stdout.write("".join(line + "\n" for line in proc.stdout.splitlines()
                                     if line.startswith("{")))
            sys.stdout.flush()
            if proc.returncode != 0:
                sys.stderr.write(proc.stdout + proc.stderr)
                return proc.returncode
        finally:
            subprocess.run(["bash", str(CLUSTER), "stop"], stdout=subprocess.DEVNULL)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--what", default="memory,step", type=lambda s: s.split(","))
    parser.add_argument("--variants", default="ddp,zero2,zero3,zero3-no-prefetch",
                        type=lambda s: s.split(","))
    parser.add_argument("--budget-mib", type=float, default=80.0)
    parser.add_argument("--gpt-layers", default="4,10",
                        type=lambda s: [int(v) for v in s.split(",")])
    parser.add_argument("--bucket-mb", type=float, default=None,
                        help="every strategy's bucket_mb (default: each one's own)")
    parser.add_argument("--deep-layers", type=int, default=32,
                        help="a deep GPT for the ZeRO-3 variants (0: none)")
    parser.add_argument("--memory-steps", type=int, default=2)
    parser.add_argument("--step-models", default="mlp,gpt", type=lambda s: s.split(","))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--cluster", action="store_true")
    parser.add_argument("--layouts", default="1x4,4x1,2x2", type=lambda s: s.split(","))
    parser.add_argument("--link-gbit", type=float, default=1.0)
    parser.add_argument("--step-mib", type=float, default=8.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cluster-steps", type=int, default=6)
    parser.add_argument("--timeout", type=float, default=550)
    parser.add_argument("--cluster-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.cluster_worker:
        cluster_worker(args)
        return 0
    if args.cluster:
        return cluster_driver(args)
    if "memory" in args.what:
        memory(args)
    if "step" in args.what:
        step_time(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
