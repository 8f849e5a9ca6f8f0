"""Print the SHA-256 prefixes of the final parameters of reproducible training at each layout.

Anyone can rerun it::

    python scripts/repro_table.py                    # 1, 2, 3 and 4 ranks
    python scripts/repro_table.py --ranks 1 2 4 8    # with the 8-rank layouts

It starts ``mpirun -n N`` (with ``MPISHARD_MPIRUN_FLAGS`` from the environment,
e.g. ``--oversubscribe``) for each N; each job trains, with
``ShardingConfiguration(reproducible=True)``, every layout of N ranks below for
30 steps (global batch 48, AdamW, clipping at 0.5) and prints one JSON line per
layout; this script then prints a markdown table. In each column every row
must show the same prefix: the parameters (and the losses) are the same bits
at every data-parallel size, with DDP or ZeRO-2 (both reduce methods),
accumulation, and pipeline sizes and schedules.

Columns: ``mlp-f32`` / ``mlp-f64``: an MLP [6, 16, 16, 4] trained by DDP or
ZeRO-2 (24 units of 2 rows); ``gpt-f32``: a 2-block GPT as a pipeline of
``pp`` stages (8 units of 6 rows; a pass of the schedule runs 1, 2 or 4 of them
as its micro-batches), the parameters in the whole model's order.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import subprocess
import sys

BATCH = 48
EPOCHS = 6            # 240 samples, 5 steps an epoch: 30 steps
PIPE_UNIT = 6


def layouts(world: int) -> list[dict]:
    """The layouts a job of ``world`` ranks trains."""
    out = []
    for kind in ("ddp", "zero2-reduce_scatter", "zero2-allreduce"):
        for acc in (1, 2):
            if 24 % (world * acc) == 0:
                out.append({"family": "mlp", "strategy": kind, "accumulation": acc})
    for pp in (1, 2, 4):
        dp = world // pp
        if world % pp == 0 and (BATCH // PIPE_UNIT) % dp == 0:
            for schedule in ("1f1b", "gpipe"):
                for micro in (1, 2, 4):
                    out.append({"family": "gpt", "pp": pp, "dp": dp, "schedule": schedule,
                                "micro_batches": micro})
    return out


def worker() -> None:
    import numpy as np
    from mpi4py import MPI

    from mpishard import ShardingConfiguration
    from mpishard.nn import GPT, MLP, HybridShardedModel
    from mpishard.optim import AdamW
    from mpishard.strategies import DDPOptimizer, HybridShardedOptimizer, ZeRO2Optimizer

    world = MPI.COMM_WORLD
    rng = np.random.default_rng(3)
    x = rng.standard_normal((240, 6))
    mlp_data = (x, np.argmax(x[:, :4] + 0.1 * rng.standard_normal((240, 4)), axis=1))
    tokens = np.random.default_rng(2).integers(0, 11, (240, 5))
    gpt_data = (tokens, np.roll(tokens, -1, axis=1))

    def sha(a) -> str:
        return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()[:12]

    for layout in layouts(world.size):
        row = dict(layout, ranks=world.size)
        if layout["family"] == "mlp":
            for dtype in (np.float32, np.float64):
                config = ShardingConfiguration(world, reproducible=True)
                model = MLP([6, 16, 16, 4], activation="tanh", dtype=dtype, seed=5)
                opt = AdamW(lr=1e-2, weight_decay=0.01)
                options = {"accumulation_steps": layout["accumulation"], "max_grad_norm": 0.5}
                kind = layout["strategy"]
                strategy = (DDPOptimizer(opt, config, **options) if kind == "ddp" else
                            ZeRO2Optimizer(opt, config, reduce_method=kind.split("-")[1],
                                           **options))
                result = strategy.optimize(model, mlp_data, epochs=EPOCHS, batch_size=BATCH)
                row[f"mlp-{np.dtype(dtype).name}"] = sha(model.params)
                row[f"mlp-{np.dtype(dtype).name}-losses"] = sha(np.array(result.losses))
                config.free()
        else:
            config = ShardingConfiguration(world, pipeline_parallel_size=layout["pp"],
                                           reproducible=True, unit_rows=PIPE_UNIT)
            model = HybridShardedModel(
                lambda **kw: GPT(11, 5, 8, 2, 2, dtype=np.float32, seed=11, **kw), config,
                micro_batches=layout["micro_batches"], schedule=layout["schedule"])
            strategy = HybridShardedOptimizer(AdamW(lr=1e-2, weight_decay=0.01), config,
                                              data_parallel="ddp", model=model,
                                              max_grad_norm=0.5)
            result = strategy.optimize(model, gpt_data, epochs=EPOCHS, batch_size=BATCH)
            tensors = {n: np.array(model.layout.view(model.params, n))
                       for n in model.layout.names}
            merged: dict = {}
            for part in config.groups.pp.allgather(tensors):
                merged.update(part)
            order = sorted(merged, key=lambda n: (int(n.split(".")[0]), n))
            row["gpt-float32"] = sha(np.concatenate([merged[n].reshape(-1) for n in order]))
            row["gpt-float32-losses"] = sha(np.array(result.losses))
            config.free()
        if world.rank == 0:
            print("ROW " + json.dumps(row), flush=True)
    if world.rank == 0:   # what the bits depend on (docs/guide/reproducible.md)
        from mpishard.comm import reproducibility_line

        print("ENV " + reproducibility_line(), flush=True)


def label(row: dict) -> str:
    ranks = f"{row['ranks']} rank{'s' if row['ranks'] > 1 else ''}"
    if row["family"] == "mlp":
        acc = f", accumulation {row['accumulation']}" if row["accumulation"] > 1 else ""
        return f"{ranks}, {row['strategy']}{acc}"
    return (f"{ranks}, pp={row['pp']} dp={row['dp']}, {row['schedule']}, "
            f"{row['micro_batches']} micro-batch{'es' if row['micro_batches'] > 1 else ''}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker()
        return
    flags = shlex.split(os.environ.get("MPISHARD_MPIRUN_FLAGS", "--oversubscribe"))
    rows = []
    for n in args.ranks:
        cmd = ["mpirun", *flags, "-n", str(n), sys.executable, os.path.abspath(__file__),
               "--worker"]
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if out.returncode:
            sys.exit(f"{' '.join(cmd)} failed:\n{out.stdout}\n{out.stderr}")
        # Another rank's terminal reset (ESC[0m, no newline) may land before a row.
        got = [json.loads(line[line.index("ROW ") + 4:]) for line in out.stdout.splitlines()
               if "ROW {" in line]
        if len(got) != len(layouts(n)):
            sys.exit(f"{' '.join(cmd)} printed {len(got)} rows for {len(layouts(n))} "
                     f"layouts:\n{out.stdout}")
        rows += got
        said = [line[line.index("ENV ") + 4:] for line in out.stdout.splitlines()
                if "ENV BLAS" in line]
    mlp = [r for r in rows if r["family"] == "mlp"]
    gpt = [r for r in rows if r["family"] == "gpt"]
    print("| layout | mlp-float32 | mlp-float64 |")
    print("|---|---|---|")
    for r in mlp:
        print(f"| {label(r)} | `{r['mlp-float32']}` | `{r['mlp-float64']}` |")
    print()
    print("| layout | gpt-float32 (pipeline) |")
    print("|---|---|")
    for r in gpt:
        print(f"| {label(r)} | `{r['gpt-float32']}` |")
    distinct = {key: {r[key] for r in rows if key in r}
                for key in ("mlp-float32", "mlp-float64", "gpt-float32",
                            "mlp-float32-losses", "mlp-float64-losses", "gpt-float32-losses")}
    same = all(len(v) <= 1 for v in distinct.values())
    print()
    print(f"{len(rows)} layouts; every column (parameters and losses) identical: {same}")
    print(f"rank 0 of the last job: {said[0] if said else 'no reproducibility line'}")
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
