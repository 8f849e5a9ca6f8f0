"""Peak memory per rank against the model's whole state: DDP, ZeRO-2, ZeRO-3 (JSON lines).

    for n in 1 2 4 8; do
      flock /tmp/mpishard-bench.lock mpirun -n $n python benchmarks/bench_memory.py
    done

Each strategy (default options, Adam, float32) trains ``--steps`` steps of GPTs
of the same width and ``--layers`` depths (the GPT shape of ``bench_zero3.py``:
vocabulary 512, context 64, width 256, 8 heads; 8 sequences a rank) and reports,
as the most over the ranks:

* ``peak_bytes``: ``memory_report()["peak"]``, the arrays the strategy holds
  (parameters, gathered parameters, gradients, optimizer state, buffers);
* ``activation_bytes``: the model's training workspaces;
* ``rss_peak_step_bytes``: the process' peak resident memory during the steps
  (``memory_report()["rss_peak_step"]``: imports, Numba, MPI and the data
  included, and what earlier rows of the same process left to the allocator:
  run one strategy a process, ``--strategies zero3``, to compare these);
* ``whole_state_bytes``: what one process holds for the whole model (parameters,
  gradient, Adam's two moments: 16 bytes a parameter), and ``over_whole``, the
  peak with activations over it.

From two depths each strategy's bytes are a line in the parameter count P,
``a * P + c`` (``a``: the measured bytes per parameter, ``c``: what does not grow
with the model); ``{"kind": "fits_in_budget"}`` gives the largest P within
``--budget-mib`` a rank, ``(budget - c) / a``, and the depth of that GPT at
this width (parameters per block measured from the two models). With
``--rss`` the line uses the process' peak RSS instead (fixed costs included).
The line assumes what grows with the depth grows linearly (true of parameters,
state and activations; the ZeRO-3 buffers are a block's, fixed).

Set OMP_NUM_THREADS (the script defaults it to cores / ranks).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

_ranks = int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("PMI_SIZE", "1")))
_threads = str(max(1, (os.cpu_count() or 1) // _ranks))
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, _threads)

GPT_SHAPE = (512, 64, 256, 8)      # vocabulary, context, width, heads
ROWS = 8                           # sequences a rank
STRATEGIES = ("ddp", "zero2", "zero3")


def _comm():
    import mpishard  # noqa: F401  (limits BLAS threads before NumPy loads)

    # isort: split
    from mpi4py import MPI

    return MPI.COMM_WORLD


def emit(record: dict) -> None:
    if _comm().rank == 0:
        print(json.dumps(record), flush=True)


def measure(name: str, layers: int, steps: int) -> dict:
    """One strategy on one GPT: the most over the ranks of each figure."""
    import gc

    import numpy as np

    from mpishard import ShardingConfiguration
    from mpishard.nn import GPT
    from mpishard.optim import Adam
    from mpishard.strategies import STRATEGIES as REGISTRY

    comm = _comm()
    gc.collect()      # the models of earlier rows (strategies and models hold cycles)
    vocab, seq, width, heads = GPT_SHAPE
    config = ShardingConfiguration(comm)
    model = GPT(vocab, seq, width, heads, layers, dtype=np.float32, seed=0)
    n = model.layout.size
    strategy = REGISTRY[name].public_class(Adam(lr=1e-4), config, model=model)
    rng = np.random.default_rng(comm.rank)
    x = rng.integers(0, vocab, (ROWS, seq))
    y = np.roll(x, -1, axis=1)
    for _ in range(steps):
        strategy.train_step(x, y)
    report = strategy.memory_report()
    mine = (report["peak"], model.activation_bytes(), report["rss_peak_step"],
            report.get("rss_peak_attach", 0))
    worst = [max(v) for v in zip(*comm.allgather(mine))]
    config.free()
    peak, acts, rss_step, rss_attach = worst
    whole = 16 * n
    return {"kind": "memory", "ranks": comm.size, "strategy": name,
            "model": f"gpt-{layers}-layers", "parameters": n, "dtype": "float32",
            "peak_bytes": peak, "activation_bytes": acts,
            "peak_with_activations": peak + acts, "rss_peak_step_bytes": rss_step,
            "rss_peak_attach_bytes": rss_attach, "whole_state_bytes": whole,
            "over_whole": (peak + acts) / whole}


def fits(records: list[dict], budget: float, rss: bool) -> dict:
    """The largest GPT of this width within ``budget`` bytes a rank, from a line."""
    (a, b) = records[0], records[-1]
    key = "rss_peak_step_bytes" if rss else "peak_with_activations"
    slope = (b[key] - a[key]) / (b["parameters"] - a["parameters"])
    fixed = a[key] - slope * a["parameters"]
    per_block = (b["parameters"] - a["parameters"]) / (int(b["model"].split("-")[1])
                                                        - int(a["model"].split("-")[1]))
    base = a["parameters"] - per_block * int(a["model"].split("-")[1])
    largest = int((budget - fixed) / slope) if slope > 0 else None
    return {"kind": "fits_in_budget", "ranks": a["ranks"], "strategy": a["strategy"],
            "measure": key, "budget_bytes": budget, "bytes_per_parameter": slope,
            "fixed_bytes": fixed, "parameters_that_fit": largest,
            "layers_that_fit": None if largest is None else int((largest - base) // per_block),
            "from": f"{a['model']} and {b['model']}, width {GPT_SHAPE[2]}"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", default=",".join(STRATEGIES),
                        type=lambda s: s.split(","))
    parser.add_argument("--layers", default="2,6", type=lambda s: [int(v) for v in s.split(",")])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--budget-mib", type=float, default=1024.0)
    parser.add_argument("--rss", action="store_true",
                        help="fit the budget on the process' peak RSS")
    args = parser.parse_args(argv)
    for name in args.strategies:
        records = []
        for layers in args.layers:
            record = measure(name, layers, args.steps)
            emit(record)
            records.append(record)
        if len(records) > 1:
            emit(fits(records, args.budget_mib * 2**20, args.rss))
    return 0


if __name__ == "__main__":
    sys.exit(main())
