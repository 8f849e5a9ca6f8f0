"""ZeRO-3 ranks SIGKILLed inside ``optimize()``: recovered in place (ULFM), exactly.

Runs only in the fault-tolerant runtime (``.venv-ft/bin/python -m pytest
tests/faults/test_ulfm_zero3.py``); elsewhere it skips, saying why. Each test
starts ``mpirun --with-ft ulfm -n 3`` (4 where two ranks die), the pattern of
``tests/test_ulfm_train.py``: a float64 MLP (Adam, global batch 24 re-split over
whoever is there, 4 epochs of 8 steps) trained by ``ZeRO3Optimizer.optimize()``
with small buckets (several gathers and reductions per step). The kill matrix
(:data:`MATRIX`) draws the victims (any rank, 0 included; two at once, never
neighbours) and the step from a seed; the phase is the test's: the model's
forward/backward, a parameter gather of the forward or backward
(``Iallgatherv`` on the gathers' group), a gradient bucket's reduction, the
step's ``Allreduce``, the buddy exchange after the update (the parameter shard
travels with the state: no rank holds the whole vector), a checkpoint save, an
evaluation (gathers of an inference pass). The reference, computed earlier in
the same job: the same training on every rank up to the step the survivors must
agree on, then on the survivors only (a communicator without the victims).
Parameters, gathered from the shards, must agree to rtol 1e-12 (they are equal
here). Without buddy copies the survivors roll back to the newest checkpoint;
in reproducible mode the run ends with the bits of the run that lost nothing.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from test_ulfm import _ft_or_skip, ulfm_job

pytestmark = pytest.mark.launch

JOB = r"""
import json, os, signal, socket, sys, tempfile
import numpy as np
from mpi4py import MPI
from mpishard import ShardingConfiguration
from mpishard.strategies import ZeRO3Optimizer
from mpishard.checkpoint import CheckpointManager
from mpishard.comm import FlatComm, ulfm
from mpishard.nn import MLP
from mpishard.optim import Adam
from mpishard.train import StopRequest
import mpishard.checkpoint.files as files
import mpishard.train.reporting as reporting
from mpishard.recovery import ShardBuddy

assert ulfm.available()[0], ulfm.available()[1]
PHASE, VICTIMS, KILL, EVERY = {phase!r}, {victims}, {kill}, {every}
REPRO, BUDDY, PREFETCH = {repro}, {buddy}, {prefetch}
EPOCHS, ROWS = 4, 24
AFTER = PHASE in ("checkpoint", "evaluation")
AGREED = KILL if AFTER else KILL - 1
if not BUDDY:                             # the lost shards are gone: the newest checkpoint
    AGREED = (AGREED // EVERY) * EVERY
rank = MPI.COMM_WORLD.rank
rng = np.random.default_rng(0)
X = rng.standard_normal((8 * ROWS, 5))
Y = rng.integers(0, 3, 8 * ROWS)
base = tempfile.gettempdir() + "/ulfm-zero3-" + os.environ.get("JOBTAG", "x")


def fresh():
    return MLP([5, 16, 16, 3], activation="tanh", dtype=np.float64, seed=1)


def make(comm, model):
    config = ShardingConfiguration(comm, timeout=60, fault_tolerance="ulfm", reproducible=REPRO)
    return ZeRO3Optimizer(Adam(lr=1e-2), config, model=model, bucket_mb=0.0005,
                          reduce_method="allreduce", buddy_copies=BUDDY, prefetch=PREFETCH)


def train(opt, model, **kw):
    return opt.optimize(model, (X, Y), epochs=EPOCHS, batch_size=ROWS, seed=3, **kw)


def gathered(opt):
    with opt.gathered_parameters() as params:
        return np.array(params)


# --- the run that loses no rank (reproducible mode: the same bits as the others) ---
model = fresh()
opt = make(MPI.COMM_WORLD, model)
train(opt, model)
whole = gathered(opt)

# --- the reference: every rank up to AGREED, then the survivors alone ---
model = fresh()
opt = make(MPI.COMM_WORLD, model)
train(opt, model, max_steps=AGREED)
keeper = CheckpointManager(base + "-ref", keep=1)
keeper.save(model, opt)
two = MPI.COMM_WORLD.Split(MPI.UNDEFINED if rank in VICTIMS else 0, rank)
ref = None
if rank not in VICTIMS:
    model2 = fresh()
    opt2 = make(two, model2)
    keeper.load_latest(model2, opt2)
    train(opt2, model2)
    ref = gathered(opt2)
MPI.COMM_WORLD.Barrier()

# --- the run that loses the victims at step KILL, in PHASE ---
model = fresh()
manager = CheckpointManager(base + "-run", keep=None)
opt = make(MPI.COMM_WORLD, model)
assert model.params is None


def die():
    print(f"KILL {{rank}} step {{opt.step_count}} {{PHASE}}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


if rank in VICTIMS:
    if PHASE == "forward":
        real = model.forward_backward
        def forward_backward(*a, **k):
            if opt.step_count == KILL - 1:
                die()
            return real(*a, **k)
        model.forward_backward = forward_backward
    elif PHASE in ("gather", "evaluation"):
        # The third parameter gather of step KILL - 1 (blocking or not, as prefetch
        # has it), or the second one of the evaluation after step KILL.
        real_i, real_b = FlatComm.Iallgatherv, FlatComm.Allgatherv
        calls, evaluating = [0], [False]
        def count(self):
            if self is opt.core.gather_comm and (
                    evaluating[0] if PHASE == "evaluation" else opt.step_count == KILL - 1):
                calls[0] += 1
                if calls[0] == (2 if PHASE == "evaluation" else 3):
                    die()
        def Iallgatherv(self, *a, **k):
            count(self)
            return real_i(self, *a, **k)
        def Allgatherv(self, *a, **k):
            count(self)
            return real_b(self, *a, **k)
        FlatComm.Iallgatherv, FlatComm.Allgatherv = Iallgatherv, Allgatherv
        if PHASE == "evaluation":         # at the end of the epoch of step KILL
            real_e = reporting.evaluate
            def evaluate(*a, **k):
                evaluating[0] = opt.step_count == KILL
                return real_e(*a, **k)
            reporting.evaluate = evaluate
    elif PHASE == "bucket":               # the second gradient bucket of the step
        real_r = FlatComm.Iallreduce
        calls = [0]
        def Iallreduce(self, *a, **k):
            if opt.step_count == KILL - 1:
                calls[0] += 1
                if calls[0] == 2:
                    die()
            return real_r(self, *a, **k)
        FlatComm.Iallreduce = Iallreduce
    elif PHASE == "step":
        real_a = FlatComm.Allreduce
        def Allreduce(self, buf, *a, slot=None, **k):
            if slot == "step" and opt.step_count == KILL - 1:
                die()
            return real_a(self, buf, *a, slot=slot, **k)
        FlatComm.Allreduce = Allreduce
    elif PHASE == "exchange":             # after the update, in the buddy exchange
        real_x = ShardBuddy.exchange
        def exchange(self):
            if opt.step_count == KILL:
                die()
            return real_x(self)
        ShardBuddy.exchange = exchange
    elif PHASE == "checkpoint":
        real_c = files.save_checkpoint
        def save_checkpoint(*a, **k):
            if opt.step_count == KILL:
                die()
            return real_c(*a, **k)
        files.save_checkpoint = save_checkpoint

metrics = base + "-metrics.jsonl"
options = dict(checkpoints=manager, checkpoint_every=EVERY, metrics_path=metrics, log_every=1,
               print_every=1, stop=StopRequest(signals=()))
if PHASE == "evaluation":
    options["validation"] = (X[:30], Y[:30])
result = train(opt, model, **options)
final = gathered(opt)
held = opt.core.parameter_shard()[1].size
if opt.config.world.rank == 0:
    events = [json.loads(line) for line in open(metrics)]
    print("RESULT " + json.dumps({{
        "recoveries": result.recoveries, "steps": opt.step_count,
        "world_size": opt.config.world.size, "losses": len(result.losses),
        "last_step": result.last_step, "held": held, "shard": len(opt.core.shard),
        "sharded": model.params is None,
        "recovered_records": [e for e in events if e["event"] == "recovered"],
        "checkpoints": [s for s, _ in manager.checkpoints()],
        "vs_reference": float(np.max(np.abs(final - ref) / np.abs(ref))),
        "allclose_reference": bool(np.allclose(final, ref, rtol=1e-12, atol=0)),
        "equal_reference": bool(np.array_equal(final, ref)),
        "equal_uninterrupted": bool(np.array_equal(final, whole)),
    }}), flush=True)
ulfm.leave(0)      # not MPI_Finalize: it may wait for the dead rank (ompi#11404)
"""


def run_job(tmp_path, phase, seed=0, ranks=3, lose=1, every=3, repro=False, buddy=True,
            prefetch=True):
    """The job at ``ranks`` ranks, ``lose`` of them (a seeded draw, never
    neighbours) killed at a seeded step in ``phase``: ``(job, victims, kill)``."""
    _ft_or_skip()
    rng = np.random.default_rng(seed)
    first = int(rng.integers(0, ranks))
    victims = sorted({first, (first + 2) % ranks} if lose == 2 else {first})
    kill = int(rng.integers(4, 12))          # a step of epoch 0 or 1 (8 steps each)
    if phase == "checkpoint":
        kill = -(-kill // every) * every
    if phase == "evaluation":
        kill = 8
    code = JOB.format(phase=phase, victims=victims, kill=kill, every=every, repro=repro,
                      buddy=buddy, prefetch=prefetch)
    code = code.replace('tempfile.gettempdir() + "/ulfm-zero3-"', repr(str(tmp_path) + "/j"))
    return ulfm_job(ranks, code, timeout=180), victims, kill


def result_of(job):
    match = re.search(r"^RESULT (.*)$", job.stdout, re.MULTILINE)
    assert match, job.stdout
    return json.loads(match.group(1))


#: (phase, seed, ranks, ranks killed at once, prefetch)
MATRIX = [("forward", 1, 3, 1, True), ("gather", 2, 3, 1, True), ("gather", 3, 3, 1, False),
          ("bucket", 4, 3, 1, True), ("step", 5, 3, 1, True), ("exchange", 6, 3, 1, True),
          ("checkpoint", 7, 3, 1, True), ("evaluation", 8, 3, 1, True),
          ("gather", 9, 4, 2, True)]


@pytest.mark.parametrize("phase,seed,ranks,lose,prefetch", MATRIX,
                         ids=[f"{m[0]}-{m[2]}ranks-lose{m[3]}" + ("" if m[4] else "-no-prefetch")
                              for m in MATRIX])
def test_zero3_rank_killed_inside_optimize_is_recovered_exactly(tmp_path, phase, seed, ranks,
                                                                lose, prefetch):
    job, victims, kill = run_job(tmp_path, phase, seed=seed, ranks=ranks, lose=lose,
                                 prefetch=prefetch)
    out = job.stdout
    result = result_of(job)
    agreed = kill if phase in ("checkpoint", "evaluation") else kill - 1
    for victim in victims:
        assert f"KILL {victim} step " in out, out
    left = ranks - lose
    [rec] = result["recoveries"]
    assert rec["lost_ranks"] == victims and rec["world_size"] == left, rec
    assert rec["step"] == agreed and rec["from"] == "buddy", (rec, kill)
    print(f"zero3 {phase}: recovery {rec['seconds']:.4f} s, vs reference "
          f"{result['vs_reference']:.2e}")
    assert result["steps"] == 32 and result["world_size"] == left, result
    assert result["losses"] == 32 and result["last_step"] == 32, result
    assert result["allclose_reference"], result
    # Resharded over the survivors, and sharded still.
    assert result["sharded"] and result["held"] == result["shard"], result
    [record] = result["recovered_records"]
    assert record["lost_ranks"] == victims and record["step"] == agreed, record
    if phase == "checkpoint":
        assert kill in result["checkpoints"] and kill - 3 in result["checkpoints"], result
    assert "InexactRecoveryWarning" not in out, out
    assert job.returncode in (0, None), out
    assert "Traceback" not in out, out


def test_zero3_without_buddy_copies_rolls_back_to_its_newest_checkpoint(tmp_path):
    # The lost rank's parameter and state shards are nowhere else: the survivors
    # roll back to the newest checkpoint, resharded over 2, with a warning.
    job, [victim], kill = run_job(tmp_path, "step", seed=6, buddy=False)
    out = job.stdout
    result = result_of(job)
    back = (kill - 1) // 3 * 3
    [rec] = result["recoveries"]
    assert rec["lost_ranks"] == [victim] and rec["step"] == back, (rec, kill)
    assert rec["rolled_back_from"] == f"{tmp_path}/jx-run/ckpt-{back:010d}.h5", rec
    assert rec["from"] == "checkpoint", rec
    assert "InexactRecoveryWarning" in out, out
    assert result["steps"] == 32 and result["allclose_reference"], result
    assert result["sharded"] and result["held"] == result["shard"], result
    assert job.returncode in (0, None), out


def test_zero3_reproducible_mode_ends_with_the_bits_of_the_run_that_lost_no_rank(tmp_path):
    job, [victim], kill = run_job(tmp_path, "gather", seed=10, repro=True)
    result = result_of(job)
    [rec] = result["recoveries"]
    assert rec["lost_ranks"] == [victim] and rec["step"] == kill - 1, rec
    assert result["equal_uninterrupted"] and result["equal_reference"], result
    assert job.returncode in (0, None), job.stdout


# --- 3D: the replicas that lost a rank are dropped, as with hybrid ZeRO-2 -------------------
def hybrid_zero3_job(job):
    """``tests/test_ulfm_hybrid.py``'s job, comparing the parameters gathered from the
    ZeRO-3 shards (the stage model holds no whole vector)."""
    old = ("vs = float(np.max(np.abs(model.params - ref.params) / np.abs(ref.params)))\n"
           "every = world.allgather((vs, bool(np.allclose(model.params, ref.params, ")
    new = ("assert model.params is None and ref.params is None\n"
           "with opt.gathered_parameters() as p:\n"
           "    mine = np.array(p)\n"
           "with opt2.gathered_parameters() as p:\n"
           "    theirs = np.array(p)\n"
           "vs = float(np.max(np.abs(mine - theirs) / np.abs(theirs)))\n"
           "every = world.allgather((vs, bool(np.allclose(mine, theirs, ")
    assert old in job
    return job.replace(old, new)


@pytest.mark.parametrize("phase,tp,pp,seed", [("recv", 1, 2, 5), ("backward", 2, 1, 3)])
def test_hybrid_zero3_replica_dropped_with_its_shards_rebuilt(tmp_path, monkeypatch, phase, tp,
                                                              pp, seed):
    # dp=2: each (tensor, stage) data group spans both replicas; its survivors (the
    # dropped replica's alive rank included) put the stage's parameters and state
    # together from their shards and the lost shards' buddy copies, then shard
    # them again over the kept replica.
    import test_ulfm_hybrid as hybrid

    monkeypatch.setattr(hybrid, "JOB", hybrid_zero3_job(hybrid.JOB))
    hybrid.check_dropped(tmp_path, phase, tp=tp, pp=pp, strategy="zero3", seed=seed)
