"""A strategy rebuilt over the survivors of a lost rank keeps every constructor option.

Runs in the fault-tolerant runtime (``.venv-ft``; elsewhere it skips, saying why).
Each strategy is built with options that are not the defaults (bucket size,
accumulation, clipping, the non-finite policy, overlap, the learning-rate
schedule; ZeRO-2's reduce method and buddy copies; ZeRO-3's prefetch, keep_gathered
and gather size), a rank SIGKILLs itself in the
forward of step 3, and the survivors go on in place (:mod:`mpishard.recovery`,
through ``core.rebuild(config)``). The test reads the options back after the
recovery, from the options record and from the attributes the core uses, and checks
that the run finished its steps over the survivors.
"""

from __future__ import annotations

import json
import re

import pytest
from test_ulfm import _ft_or_skip, ulfm_job

pytestmark = pytest.mark.launch

JOB = r"""
import dataclasses, functools, json, os, signal, tempfile
import numpy as np
from mpi4py import MPI
from mpishard import ShardingConfiguration
from mpishard.checkpoint import CheckpointManager
from mpishard.comm import ulfm
from mpishard.nn import MLP, ParallelMLP
from mpishard.optim import Adam
from mpishard.optim.schedules import CosineSchedule
from mpishard.strategies import (DDPOptimizer, ElasticOptimizer, HybridShardedModel,
                                 HybridShardedOptimizer, ZeRO2Optimizer, ZeRO3Optimizer)

KIND, VICTIM = {kind!r}, {victim}
rank = MPI.COMM_WORLD.rank
config = ShardingConfiguration(MPI.COMM_WORLD, timeout=60, fault_tolerance="ulfm",
                               pipeline_parallel_size=2 if KIND == "hybrid" else 1)
options = dict(bucket_mb=0.0007, accumulation_steps=2, max_grad_norm=7.5, nonfinite="skip",
               overlap=False, schedule=CosineSchedule(total_steps=40, warmup_steps=2))
if KIND in ("zero2", "zero3", "hybrid"):   # a 3D layout needs the copies to drop a replica
    options.update(reduce_method="allreduce", buddy_copies=KIND == "hybrid")
if KIND == "zero3":
    options.update(prefetch=False, keep_gathered=True, gather_mb=0.0005)
if KIND == "hybrid":
    model = HybridShardedModel(functools.partial(ParallelMLP, [5, 16, 16, 3], activation="tanh",
                                                 dtype=np.float64), config)
    opt = HybridShardedOptimizer(Adam(lr=1e-2), config, data_parallel="zero2", model=model,
                                 **options)
else:
    model = MLP([5, 16, 3], activation="tanh", dtype=np.float64, seed=1)
    if KIND == "elastic":
        opt = ElasticOptimizer(Adam(lr=1e-2), config, strategy="ddp", **options)
    else:
        opt = {{"ddp": DDPOptimizer, "zero2": ZeRO2Optimizer,
                "zero3": ZeRO3Optimizer}}[KIND](Adam(lr=1e-2), config, model=model, **options)
before = opt.core.options
rng = np.random.default_rng(0)
X, Y = rng.standard_normal((96, 5)), rng.integers(0, 3, 96)
if rank == VICTIM:
    real = model.forward_backward
    def forward_backward(*a, **k):
        if opt.step_count == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*a, **k)
    model.forward_backward = forward_backward
manager = CheckpointManager(tempfile.mkdtemp(dir={tmp!r}), keep=None)
result = opt.optimize(model, (X, Y), epochs=2, batch_size=24, seed=3, checkpoints=manager,
                      checkpoint_every=1)
core = opt.core
after = {{f.name: getattr(core, f.name) for f in dataclasses.fields(before)}}
if core.config.world.rank == 0:
    print("RESULT " + json.dumps({{
        "record_kept": core.options == before,
        "attributes_kept": after == {{f.name: getattr(before, f.name)
                                     for f in dataclasses.fields(before)}},
        "schedule_kept": core.schedule is before.schedule,
        "optimizer_kept": core.optimizer is opt.optimizer,
        "world_size": core.config.world.size, "steps": core.step_count,
        "recoveries": [r["from"] for r in result.recoveries],
    }}), flush=True)
ulfm.leave(0)
"""

CASES = {"ddp": (3, 1), "zero2": (3, 2), "zero3": (3, 2), "elastic": (3, 0), "hybrid": (4, 3)}


@pytest.mark.parametrize("kind", sorted(CASES))
def test_every_constructor_option_survives_a_recovery(tmp_path, kind):
    _ft_or_skip()
    ranks, victim = CASES[kind]
    job = ulfm_job(ranks, JOB.format(kind=kind, victim=victim, tmp=str(tmp_path)), timeout=120)
    out = job.stdout
    match = re.search(r"^RESULT (.*)$", out, re.MULTILINE)
    assert match, out
    result = json.loads(match.group(1))
    assert result["record_kept"] and result["attributes_kept"], result
    assert result["schedule_kept"] and result["optimizer_kept"], result
    assert result["world_size"] == ranks - (2 if kind == "hybrid" else 1), result
    # 96 rows in batches of 24: 4 steps an epoch, 2 epochs, none refused.
    assert result["steps"] == 8, result
    expected = {"ddp": "survivor", "elastic": "survivor", "zero2": "checkpoint",
                "zero3": "checkpoint", "hybrid": "replica"}[kind]
    assert result["recoveries"] == [expected], result
    assert "Traceback" not in out, out
