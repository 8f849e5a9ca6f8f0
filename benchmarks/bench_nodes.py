"""Flat against hierarchical gradient reductions on the namespace cluster (JSON lines).

    python benchmarks/bench_nodes.py [--layouts 2x2,2x2rr,4x1] [--link-gbit 2] [--mib 4,32]

For each layout NODESxRANKS (suffix ``rr``: ranks placed round robin, ``--map-by
node``, instead of by slot) it starts ``scripts/cluster-local.sh`` with that many
nodes and the link cap, runs itself under ``mpirun`` across them (``--worker``),
prints what the ranks measured, and stops the cluster (also on an error). Each
line is one JSON object:

* ``{"kind": "link", ...}``: latency (8-byte ping-pong, half round trip) and
  bandwidth (ping-pong of ``--mib`` MiB) between two ranks of one node and two
  ranks of two nodes: the inputs of ``mpishard plan``.
* ``{"kind": "reduction", "op": "allreduce"|"reduce_scatter", "way": "flat"|
  "hierarchical", "mib", "seconds", "busbw_gbs"}``: best of ``--repeats``; bus
  bandwidth as nccl-tests define it: allreduce ``2 (P-1)/P bytes / t``,
  reduce-scatter ``(P-1)/P bytes / t``.
* ``{"kind": "choice", ...}``: what :func:`mpishard.comm.hierarchical.choose`
  picked for a bucket of the largest size, measuring the blocking calls and the
  non-blocking ones.
* ``{"kind": "ddp_step" | "zero2_step", ...}``: training steps of an MLP (buckets
  of 1 MiB) with the gradient reduced after the backward, flat and hierarchical,
  and (DDP) flat during the backward (``overlap``); seconds per step and
  samples/s; at 1x4 (one node) for the scaling efficiency. ZeRO-2 hierarchical
  needs the strategies' ``reducer`` (see the report of issue 15); DDP's is
  redirected without it.

Run as root on an otherwise idle machine: figures taken while other jobs share
its cores are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CLUSTER = REPO / "scripts" / "cluster-local.sh"


def _worker(args: argparse.Namespace) -> None:
    import mpishard  # noqa: F401  (limits BLAS threads before NumPy loads)

    # isort: split
    import numpy as np

    from mpishard import ShardingConfiguration
    from mpishard.comm.hierarchical import HierarchicalComm, choose

    config = ShardingConfiguration()
    world = config.world
    nodes = config.groups.nodes
    layout = f"{nodes.nodes}x{world.size // nodes.nodes}" + ("" if nodes.contiguous else "rr")
    out = []

    def emit(record):
        if world.rank == 0:
            record = {"layout": layout, "link_gbit": args.link_gbit, **record}
            out.append(record)
            print(json.dumps(record), flush=True)

    # --- link latency and bandwidth: rank 0 with a rank on its node and on another
    inside = next((r for r in range(1, world.size) if nodes.node_of[r] == nodes.node_of[0]), None)
    across = next((r for r in range(1, world.size) if nodes.node_of[r] != nodes.node_of[0]), None)
    small = np.zeros(1)
    big = np.zeros(int(max(args.mib)) << 17)
    for where, peer in (("inside", inside), ("across", across)):
        if peer is None:
            continue
        for what, buf, rounds in (("latency", small, 50), ("bandwidth", big, 3)):
            best = float("inf")
            for _ in range(rounds + 1):
                world.barrier()
                t0 = time.perf_counter()
                if world.rank == 0:
                    world.Isend(buf, peer, tag=1).wait()
                    world.Recv(buf, peer, tag=2)
                elif world.rank == peer:
                    world.Recv(buf, 0, tag=1)
                    world.Isend(buf, 0, tag=2).wait()
                best = min(best, (time.perf_counter() - t0) / 2)
            best = world.bcast(best, root=0)
            if what == "latency":
                emit({"kind": "link", "where": where, "latency_us": best * 1e6})
            else:
                emit({"kind": "link", "where": where, "bandwidth_gbs": buf.nbytes / best / 1e9})

    # --- reductions, flat and hierarchical, alternating
    hier = HierarchicalComm(world)
    p = world.size
    for mib in args.mib:
        buf = np.ones(int(mib * (1 << 17)))
        counts = [len(r) for r in np.array_split(np.arange(buf.size), p)]
        recv = np.zeros(counts[world.rank])
        for op in ("allreduce", "reduce_scatter"):
            best = {"flat": float("inf"), "hierarchical": float("inf")}
            for round_ in range(args.repeats + 1):
                for way, comm in (("flat", world), ("hierarchical", hier)):
                    world.barrier()
                    t0 = time.perf_counter()
                    if op == "allreduce":
                        comm.Allreduce(buf)
                    else:
                        comm.Reduce_scatter(buf, recv, counts)
                    if round_:
                        best[way] = min(best[way], time.perf_counter() - t0)
            factor = 2 * (p - 1) / p if op == "allreduce" else (p - 1) / p
            for way, seconds in best.items():
                seconds = world.allreduce_scalar(seconds, op="max")
                emit({"kind": "reduction", "op": op, "way": way, "mib": mib,
                      "levels": hier.describe(), "seconds": seconds,
                      "busbw_gbs": factor * buf.nbytes / seconds / 1e9})
    hier.free()
    for blocking in (True, False):
        record = {}
        chosen = choose(world, int(max(args.mib) * (1 << 17)), np.float64, np, record=record,
                        blocking=blocking)
        emit({"kind": "choice", "mib": max(args.mib), "blocking": blocking, **record})
        if chosen is not world:
            chosen.free()
    if args.ddp_steps:
        _ddp_steps(args, config, emit)


def _ddp_steps(args, config, emit) -> None:
    """Training steps of an MLP whose gradient is ``--ddp-mib`` MiB (buckets of 1 MiB),
    DDP and ZeRO-2, the gradient reduced flat or hierarchical."""
    import numpy as np

    from mpishard.comm.hierarchical import HierarchicalComm
    from mpishard.nn import MLP
    from mpishard.optim import SGD
    from mpishard.strategies import DDPOptimizer, ZeRO2Optimizer

    width = int((args.ddp_mib * (1 << 17) / 3) ** 0.5)
    sizes = [64, width, width, width, 10]
    local = 32                       # rows per rank: weak scaling
    batch = local * config.world.size
    rng = np.random.default_rng(config.world.rank)
    x = rng.standard_normal((local, 64))
    y = rng.integers(0, 10, local)
    dp = config.groups.dp
    hier = HierarchicalComm(dp)
    # Reductions after the backward (blocking), flat and hierarchical; and flat
    # ones started during the backward (overlap=True), to see whether overlap pays.
    cases = [("ddp", "flat", False), ("ddp", "hierarchical", False), ("ddp", "flat", True),
             ("zero2", "flat", False), ("zero2", "hierarchical", False)]
    for strategy, way, overlap in cases:
        model = MLP(sizes, activation="relu", dtype=np.float64, seed=1)
        if strategy == "ddp":
            opt = DDPOptimizer(SGD(lr=1e-3), config, overlap=overlap, bucket_mb=1.0)
        else:   # pinned: "auto" would time reduce_scatter against allreduce
            opt = ZeRO2Optimizer(SGD(lr=1e-3), config, overlap=overlap, bucket_mb=1.0,
                                 reduce_method="reduce_scatter")
        opt.attach(model)
        wired = hasattr(opt, "reducer")    # strategies that choose their reduction
        if wired:
            if opt.reducer is not dp:
                opt.reducer.free()
            opt.reducer = hier if way == "hierarchical" else dp
        elif way == "hierarchical":
            if strategy != "ddp":
                continue                   # without the wiring only DDP can be redirected
            # DDP's reduction of one bucket through the two levels, handed again to
            # the gradient buckets (attach gave them the bound method).
            def reduce(index, source, blocking, hier=hier):
                if blocking:
                    hier.Allreduce(source, slot=index)
                    return None
                return hier.Iallreduce(source, slot=index)

            opt._reduce = opt.buckets.reduce = reduce
        for _ in range(2):
            opt.train_step(x, y)
        config.world.barrier()
        t0 = time.perf_counter()
        for _ in range(args.ddp_steps):
            opt.train_step(x, y)
        config.world.barrier()
        seconds = (time.perf_counter() - t0) / args.ddp_steps
        emit({"kind": f"{strategy}_step", "way": way, "overlap": overlap,
              "parameters": int(model.params.size),
              "gradient_mib": model.params.nbytes / (1 << 20), "global_batch": batch,
              "seconds_per_step": seconds, "samples_per_s": batch / seconds})
    hier.free()


def _driver(args: argparse.Namespace) -> int:
    env_file = Path(os.environ.get("MPISHARD_CLUSTER_DIR", "/run/mpishard-cluster")) / "env"
    base = dict(os.environ)
    base.update(_sourced(REPO / "scripts" / "mpienv.sh"))
    worker = [sys.executable, str(Path(__file__).resolve()), "--worker",
              "--mib", ",".join(str(m) for m in args.mib), "--repeats", str(args.repeats),
              "--ddp-steps", str(args.ddp_steps), "--ddp-mib", str(args.ddp_mib)]
    for layout in args.layouts:
        # NxL: N nodes of L ranks, placed by slot; NxLrr: round robin (--map-by node).
        nodes, per = (int(v) for v in layout.removesuffix("rr").split("x"))
        mapping = ["--map-by", "node"] if layout.endswith("rr") else []
        cap = [] if not args.link_gbit else ["--link-gbit", str(args.link_gbit)]
        subprocess.run(["bash", str(CLUSTER), "start", "--nodes", str(nodes), "--slots",
                        str(per), *cap], check=True, stdout=subprocess.DEVNULL)
        try:
            env = {**base, **_sourced(env_file)}
            command = [*shlex.split(env["MPISHARD_CLUSTER_EXEC"]), "mpirun",
                       *shlex.split(env["MPISHARD_CLUSTER_MPIRUN_FLAGS"]),
                       *mapping, "-n", str(nodes * per), *worker,
                       *(["--link-gbit", str(args.link_gbit)] if args.link_gbit else [])]
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


def _sourced(path: Path) -> dict[str, str]:
    """The variables a shell has after ``source path``."""
    proc = subprocess.run(["bash", "-c", 'source "$1" && env -0', "bash", str(path)],
                          capture_output=True, check=True)
    return dict(item.split("=", 1) for item in proc.stdout.decode().split("\0") if "=" in item)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", default="2x2,2x2rr,4x1", type=lambda s: s.split(","))
    parser.add_argument("--link-gbit", type=float, default=2.0, help="0: uncapped links")
    parser.add_argument("--mib", default="4,32", type=lambda s: [float(v) for v in s.split(",")])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ddp-steps", type=int, default=5)
    parser.add_argument("--ddp-mib", type=float, default=8.0)
    parser.add_argument("--timeout", type=float, default=550)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    return _driver(args)


if __name__ == "__main__":
    sys.exit(main())
