"""The process' memory in a validation: a GPT under ZeRO-3, RSS before and after (JSON lines).

    mpirun -n 4 python benchmarks/bench_eval_memory.py

A GPT (``--layers`` blocks, ``--d-model``, ``--heads``, context ``--seq-len``,
vocabulary 96, float32) built in shards trains two steps of 8 sequences a rank,
then the validation loss of ``--rows`` sequences, ``--batch`` a forward, as the
training loop computes it (``evaluate(..., group=strategy.dp)``: each rank its
part of the rows; ``--every-row``: every rank every row, as 0.5 did). One line
per rank: the RSS before the validation, its peak during it, and after it (the
inference workspace is kept for the next evaluation), in MiB.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from mpi4py import MPI

from mpishard import ShardingConfiguration
from mpishard.nn import GPT
from mpishard.optim import AdamW
from mpishard.parallel.memory import current_rss, reset_peak_rss
from mpishard.strategies import ZeRO3Optimizer
from mpishard.train import evaluate


def peak_since_reset() -> int:
    """The kernel's peak resident bytes since ``reset_peak_rss`` (Linux: VmHWM)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status
                    if line.startswith("VmHWM:"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--every-row", action="store_true")
    a = parser.parse_args()
    world, vocab = MPI.COMM_WORLD, 96
    rng = np.random.default_rng(0)
    x = rng.integers(0, vocab, (8 * world.size, a.seq_len))
    y = np.roll(x, -1, axis=1)
    xv = rng.integers(0, vocab, (a.rows, a.seq_len))
    yv = np.roll(xv, -1, axis=1)
    config = ShardingConfiguration(world)
    zero3 = ZeRO3Optimizer(AdamW(lr=1e-3), config)
    model = zero3.build(GPT, vocab, a.seq_len, a.d_model, a.heads, a.layers,
                        dtype=np.float32, seed=1)
    mine = slice(8 * world.rank, 8 * world.rank + 8)
    for _ in range(2):
        zero3.train_step(x[mine], y[mine])
    mib = 2**20
    before = current_rss()
    reset_peak_rss()
    group = None if a.every_row else zero3.dp
    value = evaluate(model, xv, yv, batch=a.batch, group=group)
    peak, after = peak_since_reset(), current_rss()
    for line in world.gather({"rank": world.rank, "ranks": world.size, "layers": a.layers,
                              "d_model": a.d_model, "rows": a.rows, "batch": a.batch,
                              "every_row": a.every_row, "val_loss": value,
                              "rss_before_mib": round(before / mib),
                              "rss_peak_mib": round(peak / mib),
                              "rss_after_mib": round(after / mib)}) or []:
        print(json.dumps(line), flush=True)
    config.free()


if __name__ == "__main__":
    main()
