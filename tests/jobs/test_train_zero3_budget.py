"""``mpishard train --strategy zero3`` on 1 and 4 ranks: the memory per rank falls with the ranks.

Two whole jobs (plain pytest, each its own ``mpirun``) train the built-in GPT
example (6.4M float64 parameters, Adam: a training state of ~219 MiB on one
rank) for one step. The numbers checked are the CLI's own, from its summary
line ``memory per rank, MiB: peak RSS ...; training state ...``:

* a per-rank budget of half the whole model's training state (what one rank
  reports: parameters, gradient, Adam state and buffers, all whole) is exceeded
  by the whole model and met by every rank's ZeRO-3 shard at 4 ranks (measured
  72.7 MiB against 218.6: a quarter of the vectors, and buckets);
* the peak RSS of every rank at 4 ranks is below the one rank's (measured
  394-417 MiB against 718: the process' fixed part, libraries, data and
  compiled kernels, does not shard).

37 s for both jobs under a load of 11 on 2 cores.

Both runs train the same global batches from the same initial parameters:
their losses agree (rtol 1e-10).
"""

from __future__ import annotations

import json
import re
import subprocess

import numpy as np
import pytest
from mpijobs import mpi_env, mpirun_command

pytestmark = pytest.mark.launch

ARGS = ["train", "--example", "gpt", "--strategy", "zero3", "--d-model", "256", "--layers", "8",
        "--heads", "4", "--seq-len", "16", "--dtype", "float64", "--samples", "64",
        "--batch-size", "8", "--max-steps", "1", "--log-every", "1", "--no-progress"]
LINE = re.compile(r"memory per rank, MiB: peak RSS ([\d, ]+); training state ([\d., ]+)")


def train(n: int, out) -> tuple[list[float], list[float], list[float]]:
    """(peak RSS, training state) per rank in MiB, and the losses of a run at ``n`` ranks."""
    proc = subprocess.run(mpirun_command(n, "-m", "mpishard", *ARGS, "--out", str(out),
                                         quiet=True),
                          capture_output=True, text=True, timeout=240, env=mpi_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    match = LINE.search(proc.stdout)
    assert match, proc.stdout
    rss, state = ([float(v) for v in group.split(",")] for group in match.groups())
    assert len(rss) == len(state) == n, proc.stdout
    with open(out / "gpt" / "metrics.jsonl") as f:
        losses = [r["loss"] for r in map(json.loads, f) if r["event"] == "step"]
    return rss, state, losses


def test_zero3_memory_per_rank_falls_with_the_ranks(tmp_path):
    rss1, (whole,), losses1 = train(1, tmp_path / "one")
    rss4, state4, losses4 = train(4, tmp_path / "four")
    report = (f"1 rank: peak RSS {rss1} MiB, training state {whole} MiB; 4 ranks: peak RSS "
              f"{rss4} MiB, training state {state4} MiB")
    print(report)
    np.testing.assert_allclose(losses4, losses1, rtol=1e-10)
    budget = whole / 2          # the whole model exceeds it; a quarter of it and buckets fit
    assert whole > budget and max(state4) <= budget, report
    assert max(rss4) < rss1[0], report
