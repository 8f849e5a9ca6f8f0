"""Recovery (ULFM) of layouts with empty parts: a stage without parameters, empty shards.

Issue 21, finding 1: zero-length buckets, shards and optimizer state must be fine in
recovery too. Runs only in the fault-tolerant runtime (``.venv-ft/bin/python -m
pytest tests/faults/test_ulfm_empty.py``); elsewhere it skips, saying why.

* A pipeline of 3 stages whose middle one is a GELU alone (``ParallelMLP([6, 8, 4])``,
  pp=3, dp=2: 6 ranks, replicas {0, 2, 4} and {1, 3, 5}) loses a rank, on the empty
  stage or on another, in a pipeline ``Recv`` or at the start of a step; the replica
  that lost it is dropped and the other goes on alone (DDP, ZeRO-2, ZeRO-3: the
  empty stage's data group rebuilds empty shards and buddy copies).
* A one-layer ``MLP`` of 2 parameters over 4 ranks (two empty ZeRO shards) loses the
  rank of an empty shard, or one whose neighbour's is empty; the survivors rebuild
  the shards in place from the buddy copies (ZeRO-2, ZeRO-3).

Each job computes its reference in the same job: the whole model trained by one
process (DDP on ``COMM_SELF``) on the same global batches (global batch 24, 2 epochs
of 6 steps). Every survivor's parameters (its stage's tensors, gathered under
ZeRO-3) must agree with it to rtol 1e-10 after all 12 steps.
"""

from __future__ import annotations

import json
import re

import pytest
from test_ulfm import _ft_or_skip, ulfm_job

pytestmark = pytest.mark.launch

JOB = r"""
import json, os, signal
import numpy as np
from functools import partial
from mpi4py import MPI
from mpishard import ShardingConfiguration
from mpishard.comm import ulfm
from mpishard.nn import MLP, ParallelMLP
from mpishard.optim import Adam
from mpishard.strategies import (DDPOptimizer, HybridShardedModel, HybridShardedOptimizer,
                                 ZeRO2Optimizer, ZeRO3Optimizer)

assert ulfm.available()[0], ulfm.available()[1]
LAYOUT, STRATEGY, PHASE, VICTIM, KILL = {layout!r}, {strategy!r}, {phase!r}, {victim}, {kill}
EPOCHS, ROWS = 2, 24
rank = MPI.COMM_WORLD.rank
rng = np.random.default_rng(0)
if LAYOUT == "stage":
    factory = partial(ParallelMLP, [6, 8, 4], activation="gelu", loss="mse",
                      dtype=np.float64, seed=5)
    X, Y = rng.standard_normal((6 * ROWS, 6)), rng.standard_normal((6 * ROWS, 4))
else:
    factory = partial(MLP, [1, 1], loss="mse", dtype=np.float64, seed=5)
    X, Y = rng.standard_normal((6 * ROWS, 1)), rng.standard_normal((6 * ROWS, 1))

# The reference: the whole model, one process, the same global batches.
whole = factory()
DDPOptimizer(Adam(lr=1e-2), ShardingConfiguration(MPI.COMM_SELF), model=whole).optimize(
    whole, (X, Y), epochs=EPOCHS, batch_size=ROWS, seed=3)

config = ShardingConfiguration(MPI.COMM_WORLD, timeout=60, fault_tolerance="ulfm",
                               pipeline_parallel_size=3 if LAYOUT == "stage" else 1)
extra = {{}} if STRATEGY == "ddp" else {{"reduce_method": "allreduce"}}
if LAYOUT == "stage":
    model = HybridShardedModel(factory, config, micro_batches=2, stages=[0, 1, 2])
    opt = HybridShardedOptimizer(Adam(lr=1e-2), config, data_parallel=STRATEGY, model=model,
                                 bucket_mb=0.0002, **extra)
else:
    model = factory()
    cls = {{"zero2": ZeRO2Optimizer, "zero3": ZeRO3Optimizer}}[STRATEGY]
    opt = cls(Adam(lr=1e-2), config, model=model, **extra)
shard = len(opt.optimizer_state_shard()[0])
sizes = MPI.COMM_WORLD.allgather((model.layout.size, shard))


def die():
    print(f"KILL {{rank}} step {{opt.step_count}} {{PHASE}}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


if rank == VICTIM:
    if PHASE == "recv":                 # a pipeline Recv (activations or their gradients)
        pp, real_recv, calls = model.pp, model.pp.Recv, [0]
        def Recv(*a, **k):
            if opt.step_count == KILL - 1:
                calls[0] += 1
                if calls[0] == 2:
                    die()
            return real_recv(*a, **k)
        pp.Recv = Recv
    else:                               # before the step's first communication
        real_fb = type(model).forward_backward
        def forward_backward(self, *a, **k):
            if opt.step_count == KILL - 1:
                die()
            return real_fb(self, *a, **k)
        type(model).forward_backward = forward_backward

result = opt.optimize(model, (X, Y), epochs=EPOCHS, batch_size=ROWS, seed=3, min_workers=1)
world = opt.config.world
worst, checked = 0.0, 0
with opt.gathered_parameters() as params:
    shards = getattr(model, "tensor_shards", None)
    for name, s in (shards() if shards else {{}}).items():
        local = model.layout.view(params, name)
        full = whole.layout.view(whole.params, s.logical_name)[s.index]
        worst = max(worst, float(np.max(np.abs(local - full) / np.abs(full))))
        checked += local.size
    if shards is None:
        worst = float(np.max(np.abs(params - whole.params) / np.abs(whole.params)))
        checked = params.size
every = world.allgather((worst, checked, model.layout.size, opt.step_count,
                         len(opt.optimizer_state_shard()[0])))
if world.rank == 0:
    print("RESULT " + json.dumps({{"recoveries": result.recoveries, "every": every,
                                  "sizes": sizes, "losses": len(result.losses)}}), flush=True)
ulfm.leave(0)      # not MPI_Finalize: it may wait for the dead rank (ompi#11404)
"""

STEPS = 12   # 2 epochs of 144 / 24 = 6 steps


def run(layout: str, strategy: str, phase: str, victim: int, kill: int) -> dict:
    """The job's RESULT, after the checks every case shares."""
    _ft_or_skip()
    n = 6 if layout == "stage" else 4
    code = JOB.format(layout=layout, strategy=strategy, phase=phase, victim=victim, kill=kill)
    job = ulfm_job(n, code, timeout=120)
    out = job.stdout
    match = re.search(r"^RESULT (.*)$", out, re.MULTILINE)
    assert match, out
    result = json.loads(match.group(1))
    assert f"KILL {victim} step {kill - 1} {phase}" in out, out
    [rec] = result["recoveries"]
    assert rec["lost_ranks"] == [victim] and rec["step"] == kill - 1, rec
    assert result["losses"] == STEPS, result
    worst = [e[0] for e in result["every"]]
    assert all(e[3] == STEPS for e in result["every"]), result
    assert max(worst) < 1e-10, result
    assert job.returncode in (0, None), out
    assert "Traceback" not in out, out
    return result


@pytest.mark.parametrize("strategy,phase,victim,kill", [
    ("zero2", "recv", 2, 5),        # the empty stage's replica-0 rank, in its Recv
    ("zero3", "start", 3, 4),       # the empty stage's replica-1 rank
    ("ddp", "start", 2, 6),
    ("zero3", "recv", 4, 6),        # the last stage: the empty stage's data group survives
])
def test_empty_stage_replica_dropped(strategy, phase, victim, kill):
    result = run("stage", strategy, phase, victim, kill)
    # Before: pp=3, dp=2 (rank = stage * 2 + replica); stage 1 holds nothing.
    assert [size for size, _ in result["sizes"]][2:4] == [0, 0], result
    [rec] = result["recoveries"]
    lost = victim % 2
    assert rec["dropped_ranks"] == [r for r in range(6) if r % 2 == lost and r != victim], rec
    assert rec["world_size"] == 3 and rec["data_parallel_size"] == 1, rec
    # After: one replica, its stages in order, the middle one still empty and trained.
    assert [e[2] for e in result["every"]] == [result["sizes"][0][0], 0,
                                              result["sizes"][4][0]], result
    assert [e[1] for e in result["every"]] == [e[2] for e in result["every"]], result


@pytest.mark.parametrize("strategy,victim,kill", [
    ("zero2", 3, 5),                # an empty shard lost
    ("zero3", 2, 4),                # an empty shard lost; its neighbour's is empty too
    ("zero3", 1, 3),                # the last non-empty shard lost: its buddy holds it
    ("zero2", 0, 6),                # the first shard lost: the empty last rank holds its copy
])
def test_empty_shards_rebuilt_in_place(strategy, victim, kill):
    result = run("shards", strategy, "start", victim, kill)
    # 2 parameters over 4 ranks: shards of 1, 1, 0 and 0; over the 3 survivors 1, 1, 0.
    assert [shard for _, shard in result["sizes"]] == [1, 1, 0, 0], result
    [rec] = result["recoveries"]
    assert rec["from"] == "buddy" and rec["world_size"] == 3, rec
    assert [e[4] for e in result["every"]] == [1, 1, 0], result
