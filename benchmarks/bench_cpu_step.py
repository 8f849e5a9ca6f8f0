"""The CPU training step against its physical limit, beside PyTorch, in one run.

The limit (issue 23): on a node of ``C`` cores, ``C`` ranks can at best each
run the whole single-process step of a one-core PyTorch process with fused
Adam, with no communication at all. So with 2 ranks of 64 rows the limit is
``2 * 64 / t1`` samples per second, ``t1`` that process's step on 64 rows,
and a strategy reaches ``(128 / t) / (128 / t1) = t1 / t`` of it.

Run it without mpirun (it starts every variant itself, in turn, each round),
with the Open MPI settings of ``scripts/mpienv.sh``::

    source scripts/mpienv.sh
    python benchmarks/bench_cpu_step.py                       # both models, 3 rounds
    python benchmarks/bench_cpu_step.py --models small --rounds 5

Variants, alternated round by round so that a slow minute of a shared machine
hits all of them alike: PyTorch single-process with 1 thread (64 rows: the
limit's basis) and 2 threads (128 rows, the global batch), PyTorch DDP (gloo, 2
processes of 1 thread, 64 rows each), and mpishard's DDP and ZeRO-2 at 2 ranks
with their defaults (``mpirun -n 2``: each rank takes its share of the cores).
PyTorch runs from ``--torch-python`` (default ``/work/torchenv/bin/python``), a
separate environment: it is never a dependency of mpishard. Each variant
prints one JSON line with the min and median step time over all timed steps of
all rounds and the fraction of the limit; mpishard's lines add the strategies'
own timings (forward+backward, communication, optimizer, gather; the slowest
rank's mean per step, and the fastest rank's for the communication).

An mpishard variant may name the kernels it runs with after a slash:
``mpishard_zero2/reference`` runs with ``MPISHARD_KERNELS=reference`` (the NumPy
twins: the step before the fused update), ``mpishard_zero2`` with the
environment's (``auto`` by default), and ``mpishard_zero2/before`` with the
mpishard of ``--before-tree`` (another checkout, say of the main branch)::

    python benchmarks/bench_cpu_step.py --variants torch_1thread,torch_2threads,\
torch_ddp_gloo,mpishard_ddp/reference,mpishard_ddp,mpishard_zero2/reference,mpishard_zero2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MODELS = {
    "small": [784, 1024, 1024, 10],            # ~1.9M parameters
    "large": [1024, 4096, 4096, 1024, 10],     # ~25M parameters
}
ROWS = 64          # per rank (and the one-core PyTorch process's batch)
RANKS = 2
HERE = os.path.abspath(__file__)


# --- workers: each prints one JSON line --------------------------------------------

def torch_worker(args: argparse.Namespace) -> None:
    """One PyTorch process (or one rank of PyTorch DDP when RANK is set)."""
    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    sizes = MODELS[args.model]
    layers: list = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(torch.nn.ReLU())
    net = torch.nn.Sequential(*layers)
    ddp = "RANK" in os.environ
    rank = int(os.environ.get("RANK", "0"))
    if ddp:
        import torch.distributed as dist
        dist.init_process_group("gloo")
        net = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.Adam(net.parameters(), lr=1e-4, fused=True)
    loss_fn = torch.nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(args.rows, sizes[0], generator=gen)
    y = torch.randint(0, sizes[-1], (args.rows,), generator=gen)

    def step() -> None:
        opt.zero_grad(set_to_none=False)
        loss_fn(net(x), y).backward()
        opt.step()

    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    if ddp:
        t = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)      # the slowest rank's step
        times = t.tolist()
        dist.destroy_process_group()
    if rank == 0:
        print(json.dumps({"times": times, "torch": torch.__version__,
                          "threads": torch.get_num_threads(),
                          "numpy": np.__version__}), flush=True)


def mpishard_worker(args: argparse.Namespace) -> None:
    """One rank of an mpishard strategy with its defaults (run under mpirun)."""
    import mpishard  # noqa: F401  (first: each rank takes its share of the cores)

    # isort: split
    import numpy as np
    from mpi4py import MPI

    from mpishard import ShardingConfiguration
    from mpishard.nn import MLP
    from mpishard.optim import Adam
    from mpishard.strategies import STRATEGIES

    comm = MPI.COMM_WORLD
    sizes = MODELS[args.model]
    rng = np.random.default_rng(comm.rank)
    x = rng.standard_normal((args.rows, sizes[0])).astype(np.float32)
    y = rng.integers(0, sizes[-1], args.rows)
    model = MLP(sizes, dtype=np.float32, seed=0)
    cls = STRATEGIES[args.strategy].public_class
    options = json.loads(args.options)
    dist = cls(Adam(lr=1e-4), ShardingConfiguration(), model=model, **options)
    for _ in range(args.warmup):
        dist.train_step(x, y)
    dist.reset_timings()
    comm.Barrier()
    times = np.empty(args.steps)
    for i in range(args.steps):
        t0 = time.perf_counter()
        dist.train_step(x, y)
        times[i] = time.perf_counter() - t0
    comm.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
    every = comm.gather({k: v / args.steps for k, v in dist.timings.items()}, root=0)
    if comm.rank == 0:
        slowest = {k: max(p[k] for p in every) for k in every[0]}
        fastest = {k: min(p[k] for p in every) for k in every[0]}
        record = {"times": times.tolist(), "timings_max": slowest, "timings_min": fastest,
                  "threads": os.environ.get("OMP_NUM_THREADS"),
                  "bucketed": bool(getattr(dist, "bucketed", False)),
                  "reduction": dist.reduction_timings.get("choice", "flat")}
        if args.strategy == "zero2":
            record["reduce_method"] = dist.reduce_method
        print(json.dumps(record), flush=True)


# --- the driver ----------------------------------------------------------------------

def run_variant(name: str, model: str, args: argparse.Namespace) -> dict:
    common = ["--model", model, "--steps", str(args.steps), "--warmup", str(args.warmup)]
    env = dict(os.environ)
    if name.startswith("torch"):
        threads = 2 if name == "torch_2threads" else 1
        rows = ROWS * RANKS if name == "torch_2threads" else ROWS
        cmd = [args.torch_python, HERE, "torch-worker", *common, "--threads", str(threads),
               "--rows", str(rows)]
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        if name == "torch_ddp_gloo":
            port = str(29500 + os.getpid() % 1000)
            procs = [subprocess.Popen(cmd, env={**env, "RANK": str(r), "WORLD_SIZE": str(RANKS),
                                                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port},
                                      stdout=subprocess.PIPE, text=True)
                     for r in range(RANKS)]
            outs = [p.communicate(timeout=args.timeout)[0] for p in procs]
            return _last_json(outs[0], name)
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        return _last_json(out.stdout, name, out.stderr)
    # "mpishard_zero2", "mpishard_zero2/reference" (MPISHARD_KERNELS) or, to
    # compare settings, "mpishard_zero2@{JSON options}".
    label, _, options = name.partition("@")
    label, _, kernels = label.partition("/")
    strategy = label.split("_", 1)[1]
    if kernels == "before":          # another tree's mpishard (the one before a change)
        if not args.before_tree:
            raise SystemExit(f"{name}: give --before-tree")
        env["PYTHONPATH"] = os.path.abspath(args.before_tree)
    elif kernels:
        env["MPISHARD_KERNELS"] = kernels
    cmd = ["mpirun", *args.mpirun_flags.split(), "-n", str(RANKS), args.python, HERE,
           "mpishard-worker", *common, "--strategy", strategy, "--rows", str(ROWS),
           "--options", options or args.options]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    return _last_json(out.stdout, name, out.stderr)


def _last_json(text: str, name: str, err: str = "") -> dict:
    for line in reversed(text.splitlines()):
        if "{" in line:       # after any escape codes the launcher put before it
            return json.JSONDecoder().raw_decode(line[line.index("{"):])[0]
    raise RuntimeError(f"{name} printed no result:\n{text}\n{err}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("role", nargs="?", default="driver",
                        choices=["driver", "torch-worker", "mpishard-worker"])
    parser.add_argument("--models", default="small,large")
    parser.add_argument("--model", default="small")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=0,
                        help="timed steps per run (default: 30 small, 8 large)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, default=ROWS)
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--options", default="{}",
                        help="JSON keyword arguments of the mpishard strategies")
    parser.add_argument("--variants", default="torch_1thread,mpishard_ddp,torch_2threads,"
                        "mpishard_zero2,torch_ddp_gloo",
                        help="comma-separated; an mpishard variant may carry its own "
                        "strategy options as NAME@JSON (separated by ';' then)")
    parser.add_argument("--before-tree", default="",
                        help="a checkout whose mpishard the variants NAME/before run "
                        "(for example the main branch, to compare a change with)")
    parser.add_argument("--torch-python", default="/work/torchenv/bin/python")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--mpirun-flags",
                        default=os.environ.get("MPISHARD_MPIRUN_FLAGS", "--oversubscribe"))
    parser.add_argument("--timeout", type=float, default=300)
    args = parser.parse_args()
    if args.role == "torch-worker":
        torch_worker(args)
        return 0
    if args.role == "mpishard-worker":
        mpishard_worker(args)
        return 0
    variants = args.variants.split(";" if "@" in args.variants else ",")
    for model in args.models.split(","):
        steps = args.steps or (30 if model == "small" else 8)
        run_args = argparse.Namespace(**{**vars(args), "steps": steps})
        results: dict[str, list[dict]] = {v: [] for v in variants}
        load_before = os.getloadavg()[0]     # other work on the machine (shared here)
        for rnd in range(args.rounds):
            # Rotate the order each round: no variant always runs after the same one.
            k = rnd % len(variants)
            for name in variants[k:] + variants[:k]:
                results[name].append(run_variant(name, model, run_args))
        load = [round(load_before, 2), round(os.getloadavg()[0], 2)]
        limit = _summary(results.get("torch_1thread", []))
        for name in variants:
            runs = results[name]
            times = [t for r in runs for t in r["times"]]
            s = _stats(times)
            rows = ROWS * (1 if name == "torch_1thread" else RANKS)
            record = {"model": model, "sizes": MODELS[model], "variant": name,
                      "rounds": len(runs), "steps_per_round": steps, "rows_per_step": rows,
                      **s, "samples_per_s_median": rows / (s["median_ms"] / 1e3),
                      "round_medians_ms": [_stats(r["times"])["median_ms"] for r in runs],
                      "load_average_1min_before_after": load}
            if limit is not None and name != "torch_1thread":
                # limit: RANKS one-core processes of ROWS rows, each at t1 per step.
                record["fraction_of_limit_min"] = (rows / s["min_ms"]) / (
                    RANKS * ROWS / limit["min_ms"])
                record["fraction_of_limit_median"] = (rows / s["median_ms"]) / (
                    RANKS * ROWS / limit["median_ms"])
            if name.startswith("mpishard"):
                record["timings_ms"] = _mean_parts([r["timings_max"] for r in runs])
                record["timings_min_rank_ms"] = _mean_parts([r["timings_min"] for r in runs])
                record["threads_per_rank"] = runs[0]["threads"]
                record["bucketed"] = runs[0]["bucketed"]
                record["reduction"] = [r["reduction"] for r in runs]
                record["kernels"] = name.partition("@")[0].partition("/")[2] or os.environ.get(
                    "MPISHARD_KERNELS", "auto")
                if "reduce_method" in runs[0]:
                    record["reduce_method"] = [r["reduce_method"] for r in runs]
            elif runs:
                record["torch"] = runs[0]["torch"]
                record["threads"] = runs[0]["threads"]
            print(json.dumps(record), flush=True)
    return 0


def _stats(times: list[float]) -> dict:
    return {"min_ms": round(min(times) * 1e3, 3),
            "median_ms": round(statistics.median(times) * 1e3, 3)}


def _summary(runs: list[dict]) -> dict | None:
    times = [t for r in runs for t in r["times"]]
    return _stats(times) if times else None


def _mean_parts(parts: list[dict]) -> dict:
    return {k: round(statistics.mean(p[k] for p in parts) * 1e3, 3) for k in parts[0]}


if __name__ == "__main__":
    sys.exit(main())
