"""A rank of a tensor- or pipeline-parallel layout SIGKILLed inside ``optimize()`` (ULFM):
the replicas that lost a rank are dropped, the whole ones go on in place.

Runs only in the fault-tolerant runtime (``bash scripts/setup.sh --ft``;
``.venv-ft/bin/python -m pytest tests/faults/test_ulfm_hybrid.py``); elsewhere it skips,
saying why. Each test starts ``mpirun --with-ft ulfm -n 4``.

Each job trains a float64 ``ParallelMLP`` (Adam, global batch 24 re-split over the
replicas that are there, 2 epochs of 6 steps) as a ``HybridShardedModel`` with
``optimize()``, at 4 ranks: pp=2 dp=2, or tp=2 dp=2, or tp=2 pp=2 dp=1. A seeded
draw picks the victim and the step; the phase is the test's: a pipeline ``Recv``, a
stage's backward, the start of a step. The victim SIGKILLs itself there. The
reference, computed earlier in the same job: the same training on 4 ranks up to
the step before the kill, saved to a checkpoint, loaded on the kept replica's ranks
alone (a communicator without the dropped replica, on purpose) and trained on to
the end. Every kept rank's parameters (its own tensor slice and stage) must agree
to rtol 1e-12; ``result.recoveries`` says what happened; the dropped replica's alive
ranks each write one line and leave with status 0. Where no replica is whole (dp=1,
or each replica lost a rank) the survivors hand over: one line, exit 75.
"""

from __future__ import annotations

import json
import re
import socket

import numpy as np
import pytest
from test_ulfm import _ft_or_skip, ulfm_job

JOB = r"""
import json, os, signal, sys, tempfile
import numpy as np
from functools import partial
from mpi4py import MPI
from mpishard import ShardingConfiguration
from mpishard.strategies import HybridShardedModel, HybridShardedOptimizer
from mpishard.checkpoint import CheckpointManager
from mpishard.comm import ulfm
from mpishard.nn import ParallelMLP
from mpishard.optim import Adam

assert ulfm.available()[0], ulfm.available()[1]
PHASE, VICTIMS, KILL, STRATEGY, TP, PP = {phase!r}, {victims!r}, {kill}, {strategy!r}, {tp}, {pp}
EPOCHS, ROWS, MICRO = 2, 24, 2
AGREED = KILL - 1
rank = MPI.COMM_WORLD.rank
DP = MPI.COMM_WORLD.size // (TP * PP)
replica = lambda r: (r // TP) % DP           # tp-dp-pp order
DROPPED = sorted({{replica(v) for v in VICTIMS}})
KEEP = replica(rank) not in DROPPED
rng = np.random.default_rng(0)
X = rng.standard_normal((6 * ROWS, 6))
Y = rng.integers(0, 4, 6 * ROWS)
base = tempfile.gettempdir() + "/ulfm-hybrid-"
factory = partial(ParallelMLP, [6, 8, 8, 8, 4], activation="tanh", dtype=np.float64, seed=5)

def make(comm):
    config = ShardingConfiguration(comm, timeout=60, fault_tolerance="ulfm",
                                   tensor_parallel_size=TP, pipeline_parallel_size=PP)
    model = HybridShardedModel(factory, config, micro_batches=MICRO)
    extra = {{"reduce_method": "allreduce"}} if STRATEGY == "zero2" else {{}}
    opt = HybridShardedOptimizer(Adam(lr=1e-2), config, data_parallel=STRATEGY, model=model,
                                 bucket_mb=0.0005, **extra)
    return model, opt


def train(opt, model, **kw):
    return opt.optimize(model, (X, Y), epochs=EPOCHS, batch_size=ROWS, seed=3, **kw)


if STRATEGY == "zero2":   # the state moved shard to shard, never put together whole
    from mpishard.recovery import replicas
    def zero2_rebuild(*a, **k):
        raise AssertionError("the whole stage vectors were put together")
    replicas.zero2_rebuild = zero2_rebuild


# --- the reference: 4 ranks up to AGREED, then the kept replicas alone -----------
ref = None
if DROPPED != list(range(DP)):
    ref4, opt4 = make(MPI.COMM_WORLD)
    train(opt4, ref4, max_steps=AGREED)
    keeper = CheckpointManager(base + "ref", keep=1)
    keeper.save(ref4, opt4)
    kept = MPI.COMM_WORLD.Split(0 if KEEP else MPI.UNDEFINED, rank)
    if KEEP:
        ref, opt2 = make(kept)
        keeper.load_latest(ref, opt2)
        train(opt2, ref)
    MPI.COMM_WORLD.Barrier()

# --- the run that loses VICTIMS at step KILL, in PHASE ----------------------------
model, opt = make(MPI.COMM_WORLD)

def die():
    print(f"KILL {{rank}} step {{opt.step_count}} {{PHASE}}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


if rank in VICTIMS:
    if PHASE == "recv":                 # a pipeline Recv (activations or their gradients)
        pp, real_recv, calls = model.pp, model.pp.Recv, [0]
        def Recv(*a, **k):
            if opt.step_count == KILL - 1:
                calls[0] += 1
                if calls[0] == 2:
                    die()
            return real_recv(*a, **k)
        pp.Recv = Recv
    elif PHASE == "backward":           # inside the stage's backward
        stage, real_b = model.stage_model, model.stage_model.backward_stage
        def backward_stage(*a, **k):
            if opt.step_count == KILL - 1:
                die()
            return real_b(*a, **k)
        stage.backward_stage = backward_stage
    elif PHASE == "allgather":          # ZeRO-2: after the update of step KILL, in the gather
        dp, real_g = opt.dp, opt.dp.Allgatherv
        def Allgatherv(*a, **k):
            if opt.step_count == KILL:
                die()
            return real_g(*a, **k)
        dp.Allgatherv = Allgatherv
    elif PHASE == "start":              # before the step's first communication
        real_fb = type(model).forward_backward
        def forward_backward(self, *a, **k):
            if opt.step_count == KILL - 1:
                die()
            return real_fb(self, *a, **k)
        type(model).forward_backward = forward_backward

result = train(opt, model, min_workers=1, print_every=1)
world = opt.config.world
vs = float(np.max(np.abs(model.params - ref.params) / np.abs(ref.params)))
every = world.allgather((vs, bool(np.allclose(model.params, ref.params, rtol=1e-12, atol=0)),
                         opt.step_count, model.describe()))
if world.rank == 0:
    print("RESULT " + json.dumps({{
        "recoveries": result.recoveries, "steps": opt.step_count,
        "world_size": world.size, "dp": opt.config.topology.dp,
        "losses": len(result.losses), "last_step": result.last_step,
        "vs_reference": max(e[0] for e in every),
        "allclose_reference": all(e[1] for e in every),
        "step_counts": [e[2] for e in every], "where": [e[3] for e in every],
    }}), flush=True)
ulfm.leave(0)      # not MPI_Finalize: it may wait for the dead rank (ompi#11404)
"""

STEPS = 12   # 2 epochs of 144 / 24 = 6 steps


def run_job(tmp_path, phase, *, tp=1, pp=1, strategy="ddp", seed=0, victims=None):
    _ft_or_skip()
    rng = np.random.default_rng(seed)
    if victims is None:
        victims = [int(rng.integers(0, 4))]
    kill = int(rng.integers(3, 9))           # a step of epoch 0 or 1
    code = JOB.format(phase=phase, victims=victims, kill=kill, strategy=strategy, tp=tp, pp=pp)
    code = code.replace('tempfile.gettempdir() + "/ulfm-hybrid-"', repr(str(tmp_path) + "/j"))
    job = ulfm_job(4, code, timeout=90)
    return job, victims, kill


def check_dropped(tmp_path, phase, *, tp=1, pp=1, strategy="ddp", seed=0):
    job, [victim], kill = run_job(tmp_path, phase, tp=tp, pp=pp, strategy=strategy, seed=seed)
    out = job.stdout
    match = re.search(r"^RESULT (.*)$", out, re.MULTILINE)
    assert match, out
    result = json.loads(match.group(1))
    # Dying in the gather, the victim had updated step KILL: still, KILL - 1 is agreed.
    printed = kill if phase == "allgather" else kill - 1
    assert f"KILL {victim} step {printed} {phase}" in out, out
    dp = 2
    lost = (victim // tp) % dp
    dropped = sorted(r for r in range(4) if (r // tp) % dp == lost and r != victim)
    [rec] = result["recoveries"]
    assert rec["lost_ranks"] == [victim] and rec["world_size"] == 2, rec
    assert rec["dropped_ranks"] == dropped and rec["data_parallel_size"] == 1, rec
    assert rec["step"] == kill - 1 and rec["from"] == "replica", (rec, kill)
    if phase == "allgather":   # survivors had completed step KILL: they went back one
        assert max(rec["survivor_steps"]) == kill, rec
    print(f"{strategy} {phase} tp={tp} pp={pp}: victim {victim} at step {kill}, recovery "
          f"{rec['seconds']:.4f} s (shrink+agree {rec['shrink_seconds']:.4f} s), vs reference "
          f"{result['vs_reference']:.2e}")
    assert result["steps"] == STEPS and result["world_size"] == 2 and result["dp"] == 1, result
    assert result["losses"] == STEPS and result["last_step"] == STEPS, result
    assert result["step_counts"] == [STEPS, STEPS], result
    # Each kept rank holds its own stage and tensor slice still.
    assert [(w["tp_rank"], w["pp_rank"]) for w in result["where"]] == \
        [(r % tp, r // (tp * dp)) for r in range(4) if r not in dropped + [victim]], result
    assert result["allclose_reference"], result
    lines = re.findall(r"^\[mpishard\] .*$", out, re.MULTILINE)
    host = socket.gethostname()
    assert sorted(lines) == [f"[mpishard] world rank {r} (host {host}): dropped with replica "
                             f"{lost}, which lost world rank(s) [{victim}]; 2 ranks go on"
                             for r in dropped], out
    assert re.search(rf"train recovered at step {kill - 1}: lost world rank\(s\) {victim}, "
                     rf"going on with 2", out), out
    assert job.returncode in (0, None), out
    assert "Traceback" not in out, out


@pytest.mark.launch
def test_pipeline_replica_dropped_when_a_rank_dies_in_a_pipeline_recv(tmp_path):
    # pp=2, dp=2: replicas {0, 2} and {1, 3}; the victim dies in its stage's Recv.
    check_dropped(tmp_path, "recv", pp=2, seed=1)


@pytest.mark.launch
def test_tensor_replica_dropped_when_a_rank_dies_in_its_backward(tmp_path):
    # tp=2, dp=2: replicas {0, 1} and {2, 3}; the victim dies in the stage's backward,
    # its tensor partner waits in the layer's Allreduce, the other replica in the
    # data-parallel reduction (a group without the dead rank: revoked).
    check_dropped(tmp_path, "backward", tp=2, seed=2)


@pytest.mark.launch
@pytest.mark.parametrize("phase,seed", [("recv", 5), ("allgather", 6)])
def test_zero2_replica_dropped_with_its_optimizer_state_rebuilt(tmp_path, phase, seed):
    # pp=2, dp=2, HybridZeRO2: each stage's data group {0, 1} / {2, 3} spans both
    # replicas; its survivors (the dropped replica's alive rank included) put the
    # stage's state together from their shards and the lost shard's buddy copy.
    # "allgather": the victim's stage group had updated step KILL, the other stage
    # completed it: they agree on KILL - 1 (shards from before the update).
    check_dropped(tmp_path, phase, pp=2, strategy="zero2", seed=seed)


@pytest.mark.launch
def test_no_whole_replica_hands_over_with_75(tmp_path):
    # tp=2, dp=2: one rank of each replica dies at the start of the same step;
    # no replica is whole: one line on the survivors' rank 0, exit 75.
    job, victims, kill = run_job(tmp_path, "start", tp=2, seed=3, victims=[1, 2])
    out = job.stdout
    assert "RESULT" not in out, out
    lines = re.findall(r"^\[mpishard\] .*$", out, re.MULTILINE)
    assert lines == ["[mpishard] train: cannot recover in place: no model replica is whole "
                     "(replica 0 lost world rank(s) [1]; replica 1 lost world rank(s) [2]) in "
                     "a layout with tensor_parallel_size=2 and pipeline_parallel_size=1; "
                     "restart from a checkpoint; exiting with 75 to be relaunched"], out
    assert job.returncode in (75, None), out
    assert "Traceback" not in out, out


@pytest.mark.launch
def test_single_replica_layout_hands_over_with_75(tmp_path):
    # tp=2, pp=2, dp=1: the only replica lost a rank (in a stage's backward): one
    # line on the survivors' rank 0, exit 75, for `mpishard run` to relaunch.
    job, [victim], kill = run_job(tmp_path, "backward", tp=2, pp=2, seed=4)
    out = job.stdout
    assert "RESULT" not in out, out
    lines = re.findall(r"^\[mpishard\] .*$", out, re.MULTILINE)
    assert len(lines) == 1, out
    assert re.fullmatch(rf"\[mpishard\] train: lost world rank\(s\) \[{victim}\] after step "
                        rf"{kill - 1}, cannot go on in place \(.*\); exiting with 75 to be "
                        rf"relaunched", lines[0]), out
    assert job.returncode in (75, None), out
    assert "Traceback" not in out, out
