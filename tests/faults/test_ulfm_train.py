"""Ranks SIGKILLed inside ``optimize()``: the one training loop recovers in place (ULFM).

Runs only in the fault-tolerant runtime (``bash scripts/setup.sh --ft``;
``.venv-ft/bin/python -m pytest tests/faults/test_ulfm_train.py``); elsewhere it skips,
saying why. Each test starts ``mpirun --with-ft ulfm -n 3`` (4 where two ranks die).

Each job trains a float64 MLP (Adam, global batch 24 re-split over whoever is
there, 4 epochs of 8 steps) with ``optimize()``. The kill matrix (:data:`MATRIX`):
the registry's strategies by name (DDP, ZeRO-2, ZeRO-3 and variants: ``-ring``,
``-noprefetch``), a seeded draw of the victims (any rank, 0 included: the metrics
file then moves to the new rank 0; two at once, never neighbours) and of the step;
the phase is the test's: the forward/backward, a bucket's ``Iallreduce`` (small
buckets: several per step), the step's ``Allreduce``, ZeRO-2's parameter
``Allgatherv`` (after the others updated their shards), ZeRO-3's parameter
gathers (of a step or of an evaluation), the buddy exchange, the
loop's stop agreement, a checkpoint save, an evaluation at the end of an epoch.
The victims SIGKILL themselves there. The reference, computed earlier in the same
job: the same training on all ranks up to the step the survivors must agree on
(the step before the kill, or the kill's step itself when the ranks died after
completing it: stop agreement, checkpoint save, evaluation), then on the
survivors only (a communicator without the victims, on purpose). Parameters
(gathered from ZeRO-3's shards) must agree to rtol 1e-12 (they are equal
here); ``result.recoveries`` and the metrics file's ``recovered`` record say
what happened. ZeRO-2 without buddy copies (ZeRO-3 too) rolls back to its
newest checkpoint (reference: 3 ranks to that checkpoint, the survivors from
it). Fewer survivors than ``min_workers``: checkpoint, one line, exit 75. In
reproducible mode the run ends with the bits of a 3-rank run that lost nothing
(DDP, ZeRO-2 killed in the Allgatherv, ZeRO-3 in a gather). Also:
``mpishard train --fault-tolerance`` (DDP goes on; a tensor-parallel layout
hands over with 75) and ``mpishard run --fault-tolerance ulfm`` (no relaunch on a
death).
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
from mpishard.strategies import STRATEGIES
from mpishard.checkpoint import CheckpointManager
from mpishard.comm import FlatComm, ulfm
from mpishard.nn import MLP
from mpishard.optim import Adam
from mpishard.train import StopRequest
import mpishard.checkpoint.files as files
import mpishard.train.reporting as reporting
from mpishard.recovery import ShardBuddy

assert ulfm.available()[0], ulfm.available()[1]
print(f"HOST {{MPI.COMM_WORLD.rank}} {{socket.gethostname()}}", flush=True)
PHASE, VICTIMS, KILL, STRATEGY, EVERY = {phase!r}, {victims}, {kill}, {strategy!r}, {every}
MIN = {min_workers}
REPRO, BUDDY = {repro}, {buddy}
WHOLE = REPRO          # the uninterrupted run: only the reproducible tests compare with it
EPOCHS, ROWS = 4, 24
# The victims die after completing step KILL (every survivor completed it too), or
# inside it: the survivors then go on from the step before (ZeRO-2 with a death in
# the Allgatherv or the buddy exchange too: the survivors that had updated take their
# shards back; without buddy copies: rolled back to the newest checkpoint; ZeRO-3
# without them always is, the lost parameter shard being nowhere else).
AFTER = PHASE in ("stop", "checkpoint", "evaluation")
AGREED = KILL if AFTER else KILL - 1
if not BUDDY and (STRATEGY.startswith("zero3") or PHASE in ("allgather", "exchange")):
    AGREED = (AGREED // EVERY) * EVERY
rank = MPI.COMM_WORLD.rank
VICTIM = rank if rank in VICTIMS else VICTIMS[0]
rng = np.random.default_rng(0)
X = rng.standard_normal((8 * ROWS, 5))
Y = rng.integers(0, 3, 8 * ROWS)
base = tempfile.gettempdir() + "/ulfm-train-" + os.environ.get("JOBTAG", "x")
NAME = STRATEGY.split("-")[0]           # a registry name, then a variant
Strategy = STRATEGIES[NAME].public_class
extra = {{}} if NAME == "ddp" else {{
    "reduce_method": "ring" if STRATEGY.endswith("-ring") else "allreduce", "buddy_copies": BUDDY}}
if NAME == "zero3":
    extra["prefetch"] = not STRATEGY.endswith("-noprefetch")


def fresh():      # ZeRO-3: two hidden layers, for several parameter gathers a pass
    sizes = [5, 16, 16, 3] if NAME == "zero3" else [5, 16, 3]
    return MLP(sizes, activation="tanh", dtype=np.float64, seed=1)


def make(comm, model):
    config = ShardingConfiguration(comm, timeout=60, fault_tolerance="ulfm", reproducible=REPRO)
    return Strategy(Adam(lr=1e-2), config, model=model, bucket_mb=0.0005, **extra)


def train(opt, model, **kw):
    return opt.optimize(model, (X, Y), epochs=EPOCHS, batch_size=ROWS, seed=3, **kw)


def gathered(opt):     # the whole parameter vector (ZeRO-3: gathered from the shards)
    with opt.gathered_parameters() as params:
        return np.array(params)


# --- the run that loses no rank (reproducible mode: the same bits as the others) ---
whole = None
if WHOLE:
    model = fresh()
    opt = make(MPI.COMM_WORLD, model)
    train(opt, model)
    whole = gathered(opt)

# --- the reference: 3 ranks up to AGREED, then the survivors alone ---
ref = fresh()
opt = make(MPI.COMM_WORLD, ref)
train(opt, ref, max_steps=AGREED)
ref_dir = base + "-ref"
keeper = CheckpointManager(ref_dir, keep=1)
keeper.save(ref, opt)
ref = None
two = MPI.COMM_WORLD.Split(MPI.UNDEFINED if rank in VICTIMS else 0, rank)
if rank not in VICTIMS:
    model2 = fresh()
    opt2 = make(two, model2)
    keeper.load_latest(model2, opt2)
    train(opt2, model2)
    ref = gathered(opt2)
MPI.COMM_WORLD.Barrier()

# --- the run that loses VICTIM at step KILL, in PHASE ---
model = fresh()
ckpt = base + "-run"
manager = CheckpointManager(ckpt, keep=None)
opt = make(MPI.COMM_WORLD, model)


def die():
    print(f"KILL {{rank}} step {{opt.step_count}} {{PHASE}}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


if rank in VICTIMS:
    dp = opt.dp
    if PHASE == "forward":
        real = model.forward_backward
        def forward_backward(*a, **k):
            if opt.step_count == KILL - 1:
                die()
            return real(*a, **k)
        model.forward_backward = forward_backward
    elif PHASE == "bucket":
        # The buckets' call: Iallreduce, or the ring's Isend (one per ring step; on
        # the ring's own communicator: the buddy copies send with Isend too).
        name = "Isend" if STRATEGY == "zero2-ring" else "Iallreduce"
        real_i = getattr(type(dp), name)
        calls = [0]
        def reduction(self, *a, **k):
            if opt.step_count == KILL - 1 and (name != "Isend" or self.name.endswith("(ring)")):
                calls[0] += 1
                if calls[0] == 2:      # the second bucket of the step (the ring: its step 1)
                    die()
            return real_i(self, *a, **k)
        setattr(type(dp), name, reduction)
    elif PHASE == "gather" or (PHASE == "evaluation" and NAME == "zero3"):
        # ZeRO-3: the third parameter gather of step KILL - 1 (blocking or not, as
        # prefetch has it), or the second one of the evaluation after step KILL.
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
    elif PHASE == "step":
        real_a = type(dp).Allreduce
        def Allreduce(self, buf, *a, slot=None, **k):
            if slot == "step" and opt.step_count == KILL - 1:
                die()
            return real_a(self, buf, *a, slot=slot, **k)
        type(dp).Allreduce = Allreduce
    elif PHASE == "allgather":            # ZeRO-2: after the update, in the gather
        real_g = type(dp).Allgatherv
        def Allgatherv(self, *a, **k):
            if opt.step_count == KILL:
                die()
            return real_g(self, *a, **k)
        type(dp).Allgatherv = Allgatherv
    elif PHASE == "exchange":             # ZeRO-2: after the step, in the buddy exchange
        real_x = ShardBuddy.exchange
        def exchange(self):
            if opt.step_count == KILL:
                die()
            return real_x(self)
        ShardBuddy.exchange = exchange
    elif PHASE == "evaluation":           # at the end of the epoch of step KILL
        real_e = reporting.evaluate
        def evaluate(*a, **k):
            if opt.step_count == KILL:
                die()
            return real_e(*a, **k)
        reporting.evaluate = evaluate
    elif PHASE == "stop":
        real_s = StopRequest.agree
        def agree(self, world, also=None):
            if opt.step_count == KILL:
                die()
            return real_s(self, world, also)
        StopRequest.agree = agree
    elif PHASE == "checkpoint":
        real_c = files.save_checkpoint
        def save_checkpoint(*a, **k):
            if opt.step_count == KILL:
                die()
            return real_c(*a, **k)
        files.save_checkpoint = save_checkpoint

metrics = base + "-metrics.jsonl"
options = dict(checkpoints=manager, checkpoint_every=EVERY, metrics_path=metrics, log_every=1,
               print_every=1, stop=StopRequest(signals=()), min_workers=MIN)
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
        "first_step": result.first_step, "last_step": result.last_step,
        "recovered_records": [e for e in events if e["event"] == "recovered"],
        "checkpoints": [s for s, _ in manager.checkpoints()],
        "vs_reference": float(np.max(np.abs(final - ref) / np.abs(ref))),
        "allclose_reference": bool(np.allclose(final, ref, rtol=1e-12, atol=0)),
        "equal_reference": bool(np.array_equal(final, ref)),
        "equal_uninterrupted": None if whole is None else bool(np.array_equal(final, whole)),
        "sharded": model.params is None, "held": held,
        "shard": len(opt.core.shard) if NAME == "zero3" else held,     # else whole
    }}), flush=True)
ulfm.leave(0)      # not MPI_Finalize: it may wait for the dead rank (ompi#11404)
"""


def job_code(tmp_path, phase, strategy="ddp", every=3, min_workers=1, seed=0, repro=False,
             ranks=3, lose=1, buddy=True, victims=None):
    """The job above at ``ranks`` ranks, ``lose`` of them (a seeded draw; two
    are never neighbours; or ``victims``) killed at a seeded step in ``phase``:
    ``(code, victims, kill)``."""
    rng = np.random.default_rng(seed)
    first = int(rng.integers(0, ranks))
    if victims is None:
        victims = sorted({first, (first + 2) % ranks} if lose == 2 else {first})
    kill = int(rng.integers(4, 12))          # a step of epoch 0 or 1 (8 steps each)
    if phase == "checkpoint":                # a step with a save (the second one or later)
        kill = -(-kill // every) * every
    if phase == "evaluation":                # the end of epoch 0
        kill = 8
    code = JOB.format(phase=phase, victims=victims, kill=kill, strategy=strategy, every=every,
                      min_workers=min_workers, repro=repro, buddy=buddy)
    code = code.replace('tempfile.gettempdir() + "/ulfm-train-"', repr(str(tmp_path) + "/j"))
    return code, victims, kill


def run_job(tmp_path, phase, ranks=3, **options):
    """:func:`job_code`'s job run on this machine: ``(job, victims, kill)``."""
    _ft_or_skip()
    code, victims, kill = job_code(tmp_path, phase, ranks=ranks, **options)
    return ulfm_job(ranks, code, timeout=120), victims, kill


#: The kill matrix: (strategy, phase, seed, ranks, ranks killed at once). Each
#: point draws its victims and step from its seed. The phases every strategy meets
#: alike (the forward, the stop agreement, a checkpoint save, the evaluation's
#: start) run for one strategy each (the forward also for DDP losing two ranks);
#: each strategy's own calls (buckets, the step's Allreduce, ZeRO-2's Allgatherv,
#: ZeRO-3's gathers, also in an evaluation, the buddy exchange) for each that has them.
MATRIX = [("ddp", "bucket", 2, 3, 1), ("ddp", "step", 3, 3, 1),
          ("ddp", "stop", 4, 3, 1), ("ddp", "forward", 18, 4, 2),
          ("zero2", "bucket", 12, 3, 1),
          ("zero2", "allgather", 13, 3, 1), ("zero2", "exchange", 14, 3, 1),
          ("zero2", "evaluation", 17, 3, 1),
          ("zero2", "allgather", 19, 4, 2), ("zero2-ring", "bucket", 20, 3, 1),
          # ZeRO-3 (no rank holds the whole vector): its gathers, shard to shard after.
          ("zero3", "forward", 1, 3, 1), ("zero3", "gather", 2, 3, 1),
          ("zero3-noprefetch", "gather", 3, 3, 1), ("zero3", "bucket", 4, 3, 1),
          ("zero3", "step", 5, 3, 1), ("zero3", "exchange", 6, 3, 1),
          ("zero3", "checkpoint", 7, 3, 1), ("zero3", "evaluation", 8, 3, 1),
          ("zero3", "gather", 9, 4, 2)]


@pytest.mark.parametrize("strategy,phase,seed,ranks,lose", MATRIX,
                         ids=[f"{m[0]}-{m[1]}-{m[3]}ranks-lose{m[4]}" for m in MATRIX])
def test_a_rank_killed_inside_optimize_is_recovered_exactly(tmp_path, strategy, phase, seed,
                                                            ranks, lose):
    job, victims, kill = run_job(tmp_path, phase, strategy=strategy, seed=seed, ranks=ranks,
                                 lose=lose)
    out = job.stdout
    match = re.search(r"^RESULT (.*)$", out, re.MULTILINE)
    assert match, out
    result = json.loads(match.group(1))
    agreed = kill if phase in ("stop", "checkpoint", "evaluation") else kill - 1
    for victim in victims:
        assert f"KILL {victim} step " in out, out
    left = ranks - lose
    # Ranks killed at once are usually found dead together (one recovery); where the
    # runtime notices the second death only after the first shrink, the survivors
    # recover again, at the same step, from the same copies: still exact. (A survivor
    # may also meet a late failure notice of the broken group after the rebuild and
    # recover once more losing nobody: seen once in about 10 runs; still exact.)
    recs = result["recoveries"]
    losing = [rec for rec in recs if rec["lost_ranks"]]
    assert 1 <= len(losing) <= lose, recs
    assert sorted(r for rec in recs for r in rec["lost_ranks"]) == victims, recs
    assert recs[-1]["world_size"] == left, recs
    for rec in recs:
        assert rec["step"] == agreed, (rec, kill)
    for rec in losing:
        assert rec["from"] == ("buddy" if strategy.startswith("zero") else "survivor"), rec
    rec = recs[0]
    print(f"{strategy} {phase}: recovery {rec['seconds']:.4f} s (shrink+agree "
          f"{rec['shrink_seconds']:.4f} s), vs reference {result['vs_reference']:.2e}"
          + (f", in {len(recs)} recoveries" if len(recs) > 1 else ""))
    assert result["steps"] == 32 and result["world_size"] == left, result   # 4 epochs x 8
    assert result["losses"] == 32 and result["last_step"] == 32, result
    assert result["allclose_reference"], result
    # Resharded over the survivors (ZeRO-3: sharded still, its shard only).
    assert result["sharded"] == strategy.startswith("zero3"), result
    assert result["held"] == result["shard"], result
    records = result["recovered_records"]
    assert [r["lost_ranks"] for r in records] == [r["lost_ranks"] for r in recs], records
    assert all(r["step"] == agreed for r in records), records
    going = ranks
    for rec in losing:
        going -= len(rec["lost_ranks"])
        lost = ", ".join(map(str, rec["lost_ranks"]))
        assert re.search(rf"train recovered at step {agreed}: lost world rank\(s\) {lost}, "
                         rf"going on with {going}", out), out
    if phase == "checkpoint":
        # The interrupted save is done again after the recovery; the one before stays.
        assert kill in result["checkpoints"] and kill - 3 in result["checkpoints"], result
        assert not list(tmp_path.glob("jx-run/*.tmp-*")), list(tmp_path.iterdir())
    assert "InexactRecoveryWarning" not in out, out
    assert job.returncode in (0, None), out
    assert "Traceback" not in out, out


def test_zero2_recovers_the_lost_shard_from_its_buddy_copy(tmp_path):
    # Killed in the step's Allreduce: the left neighbour's copy of the lost rank's
    # optimizer-state shard holds the agreed step; the state is put together and
    # resharded over the survivors; exact, nothing lost, nothing read from disk.
    job, [victim], kill = run_job(tmp_path, "step", strategy="zero2", seed=9)
    out = job.stdout
    match = re.search(r"^RESULT (.*)$", out, re.MULTILINE)
    assert match, out
    result = json.loads(match.group(1))
    [rec] = result["recoveries"]
    assert rec["lost_ranks"] == [victim] and rec["step"] == kill - 1, (rec, kill)
    assert rec["from"] == "buddy" and rec["rolled_back_from"] is None, rec
    print(f"zero2 buddy: recovery {rec['seconds']:.4f} s; copies {rec['buddy_bytes']} B, "
          f"exchanges {rec['buddy_seconds']:.4f} s over {kill - 1} steps")
    assert rec["buddy_bytes"] > 0, rec
    assert "InexactRecoveryWarning" not in out, out
    assert result["steps"] == 32 and result["allclose_reference"], result
    assert job.returncode in (0, None), out


@pytest.mark.parametrize("strategy,phase", [("zero2", "allgather"), ("zero3", "step")])
def test_sharded_state_rolls_back_to_its_newest_checkpoint_over_the_survivors(tmp_path,
                                                                             strategy, phase):
    # Without buddy copies (buddy_copies=False), killed in ZeRO-2's Allgatherv of the
    # parameters (after the update of step KILL), or in ZeRO-3's step: the lost
    # shard is gone; the survivors roll back to the newest checkpoint, resharded
    # over 2 (ZeRO-3: read in shards), with a warning, and train the steps since again.
    job, [victim], kill = run_job(tmp_path, phase, strategy=strategy, seed=6, buddy=False)
    out = job.stdout
    match = re.search(r"^RESULT (.*)$", out, re.MULTILINE)
    assert match, out
    result = json.loads(match.group(1))
    back = (kill - 1) // 3 * 3
    [rec] = result["recoveries"]
    assert rec["lost_ranks"] == [victim] and rec["step"] == back, (rec, kill)
    assert rec["rolled_back_from"] == f"{tmp_path}/jx-run/ckpt-{back:010d}.h5", rec
    done = kill if phase == "allgather" else kill - 1      # ZeRO-2 had done step KILL
    assert rec["survivor_steps"] == [done, done], rec
    assert rec["from"] == "checkpoint", rec
    assert "InexactRecoveryWarning" in out and f"rolled back from step {done}" in out, out
    assert result["steps"] == 32 and result["allclose_reference"], result
    assert job.returncode in (0, None), out


def test_fewer_survivors_than_min_workers_checkpoint_and_exit_75(tmp_path):
    job, [victim], kill = run_job(tmp_path, "step", min_workers=3, seed=7)
    out = job.stdout
    assert "RESULT" not in out, out
    line = re.findall(r"^\[mpishard\] train: .*$", out, re.MULTILINE)
    assert line == [f"[mpishard] train: 2 worker(s) left after losing world rank(s) "
                    f"[{victim}], fewer than min_workers=3: checkpoint "
                    f"{tmp_path}/jx-run/ckpt-{kill - 1:010d}.h5 at step {kill - 1}; exiting "
                    f"with 75 to be relaunched"], out
    assert job.returncode in (75, None), out
    # The checkpoint it wrote resumes on the survivors: its step and their parameters.
    assert (tmp_path / "jx-run" / f"ckpt-{kill - 1:010d}.h5").exists()


CLI = r"""
import os, signal, sys
from mpi4py import MPI
from mpishard.commands.train import main
from mpishard.train import StopRequest

VICTIM, AT = {victim}, {at}
if MPI.COMM_WORLD.rank == VICTIM:
    real, calls = StopRequest.agree, [0]
    def agree(self, world, also=None):
        calls[0] += 1
        if calls[0] == AT:                     # after step AT, in the stop agreement
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, world, also)
    StopRequest.agree = agree
sys.exit(main({argv!r}))
"""


@pytest.mark.parametrize("layout", ["ddp", "hybrid", "hybrid-one-replica"])
def test_mpishard_train_fault_tolerance(tmp_path, layout):
    # `mpishard train --fault-tolerance ulfm`: DDP goes on over the survivors and
    # says so in its summary; a tensor-parallel layout of 2 replicas drops the one
    # that lost a rank (its other rank says so and leaves) and goes on with the
    # other; one replica cannot (the lost rank held half of some layers): one line,
    # exit 75, for `mpishard run` to relaunch.
    _ft_or_skip()
    argv = ["--example", "burgers", "--samples", "640", "--epochs", "2", "--batch-size",
            "48", "--hidden", "32,32", "--fault-tolerance", "ulfm", "--no-progress",
            "--out", str(tmp_path)]
    n = 3
    if layout.startswith("hybrid"):
        argv += ["--strategy", "hybrid", "--tp", "2"]
        n = 2 if layout == "hybrid-one-replica" else 4
    job = ulfm_job(n, CLI.format(victim=n - 1, at=5, argv=argv), timeout=90)
    out = job.stdout
    if layout in ("ddp", "hybrid"):
        assert re.search(rf"^   recovered in place at step 5: lost world rank\(s\) {n - 1}, "
                         rf"went on with 2 ", out, re.MULTILINE), out
        assert re.search(r"^burgers done: .* 26 steps in", out, re.MULTILINE), out
        assert job.returncode in (0, None), out
    if layout == "hybrid":
        assert re.search(r"^\[mpishard\] world rank 2 \(host \S+\): dropped with replica 1, "
                         r"which lost world rank\(s\) \[3\]; 2 ranks go on$", out,
                         re.MULTILINE), out
    if layout == "hybrid-one-replica":
        lines = re.findall(r"^\[mpishard\] .*$", out, re.MULTILINE)
        assert lines == ["[mpishard] burgers: lost world rank(s) [1] after step 5, cannot "
                         "go on in place (the layout has tensor_parallel_size=2, "
                         "pipeline_parallel_size=1 and data_parallel_size=1: the lost rank "
                         "held a piece of the only model replica); exiting with 75 to be "
                         "relaunched"], out
        assert job.returncode in (75, None), out
    assert "Traceback" not in out, out


def test_agent_in_ulfm_mode_leaves_the_survivors_running(tmp_path):
    # `mpishard run --fault-tolerance ulfm`: rank 1 of 3 dies after step 6; the agent
    # records the death and ends nothing; the survivors go on in place and finish:
    # one launch, exit 0.
    _ft_or_skip()
    import os
    import subprocess
    import sys
    from pathlib import Path

    from elastic import WORKER
    from mpijobs import mpi_env

    (tmp_path / "slots").write_text("3")
    log = tmp_path / "agent.log"
    env = mpi_env({"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"})
    cmd = [sys.executable, "-m", "mpishard", "run", "--fault-tolerance", "ulfm",
           f"--slots-file={tmp_path / 'slots'}", "--launcher=mpirun",
           "--launcher-args=--oversubscribe", f"--log={log}", "--", sys.executable,
           WORKER[1], "--ckpt", str(tmp_path / "ckpt"), "--events", str(tmp_path / "events"),
           "--kill-at", "6", "--kill-rank", "1"]
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=120)
    out = proc.stdout
    assert proc.returncode == 0, out
    events = [json.loads(line) for line in log.read_text().splitlines()]
    launches = [e for e in events if e["event"] == "launch"]
    assert len(launches) == 1 and "--with-ft ulfm" in launches[0]["command"], events
    lost = [e for e in events if e["event"] == "lost"]
    assert lost and lost[0]["dead"] == [1] and lost[0]["in_place"], events
    [done] = [json.loads(line) for line in (tmp_path / "events").read_text().splitlines()]
    assert done["final_step"] == 24 and done["world_size"] == 2, done
    [rec] = done["recoveries"]
    assert rec["lost_ranks"] == [1] and rec["step"] == 6, rec


def test_fault_tolerance_option_of_mpishard_train(tmp_path):
    # Flag and TOML key; "ulfm" where the runtime has no ULFM is an error at the start.
    from mpishard.commands.config import UsageError, plan_runs

    toml = tmp_path / "run.toml"
    toml.write_text('example = "burgers"\nfault_tolerance = "ulfm"\n')
    assert plan_runs({"config": str(toml)}, 1)[0].fault_tolerance == "ulfm"
    assert plan_runs({"config": str(toml), "fault_tolerance": "off"}, 1)[0].fault_tolerance \
        == "off"
    assert plan_runs({"example": "burgers"}, 1)[0].fault_tolerance == "auto"
    toml.write_text('example = "burgers"\nfault_tolerance = "on"\n')
    with pytest.raises(UsageError, match="unknown fault_tolerance 'on': choose one of auto, "
                                         "ulfm, off"):
        plan_runs({"config": str(toml)}, 1)


@pytest.mark.parametrize("strategy,phase", [("ddp", "step"), ("zero2", "allgather"),
                                            ("zero3", "gather")])
def test_reproducible_mode_ends_with_the_bits_of_the_run_that_lost_no_rank(tmp_path, strategy,
                                                                         phase):
    # ShardingConfiguration(reproducible=True): every sum is independent of the number
    # of ranks, so the run that lost rank VICTIM (in DDP's step Allreduce; in ZeRO-2's
    # parameter Allgatherv, after some ranks had updated) and went on over 2 ends bit
    # for bit where the 3-rank run that lost nothing ends.
    job, [victim], kill = run_job(tmp_path, phase, strategy=strategy, seed=8, repro=True)
    out = job.stdout
    match = re.search(r"^RESULT (.*)$", out, re.MULTILINE)
    assert match, out
    result = json.loads(match.group(1))
    [rec] = result["recoveries"]
    assert rec["lost_ranks"] == [victim] and rec["step"] == kill - 1, rec
    assert result["equal_uninterrupted"] is True and result["equal_reference"], result
    assert job.returncode in (0, None), out


MEMORY = r"""
import json, os, signal, tracemalloc
import numpy as np
from mpi4py import MPI
from mpishard import ShardingConfiguration
from mpishard.comm import ulfm
from mpishard.nn import MLP
from mpishard.optim import Adam
from mpishard.strategies import STRATEGIES
import mpishard.recovery.policy as policy

VICTIM, KILL, STRATEGY = {victim}, {kill}, {strategy!r}
rank = MPI.COMM_WORLD.rank
rng = np.random.default_rng(0)
X = rng.standard_normal((4 * 24, 8))
Y = rng.integers(0, 3, 4 * 24)


def run(kill):
    model = MLP([8] + [64] * 40 + [3], activation="tanh", dtype=np.float64, seed=1)
    config = ShardingConfiguration(MPI.COMM_WORLD, timeout=60, fault_tolerance="ulfm",
                                   reproducible=True)
    opt = STRATEGIES[STRATEGY].public_class(Adam(lr=1e-2), config, model=model,
                                            bucket_mb=0.1, reduce_method="allreduce")
    if kill and rank == VICTIM:
        real = model.forward_backward
        def forward_backward(*a, **k):
            if opt.step_count == KILL:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*a, **k)
        model.forward_backward = forward_backward
    result = opt.optimize(model, (X, Y), epochs=3, batch_size=24, seed=3)
    with opt.gathered_parameters() as params:
        return np.array(params), result, opt


whole, _, _ = run(False)
size = whole.size
MPI.COMM_WORLD.Barrier()
# The recovery call measured on every survivor: the peak of what it allocates.
real_recover, peaks = policy.recover_in_place, []
def recover_in_place(*a, **k):
    tracemalloc.start()
    try:
        return real_recover(*a, **k)
    finally:
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
policy.recover_in_place = recover_in_place
final, result, opt = run(True)
every = opt.config.world.allgather(peaks)
if opt.config.world.rank == 0:
    print("RESULT " + json.dumps({{
        "recoveries": result.recoveries, "steps": opt.step_count, "peaks": every,
        "whole_bytes": 3 * size * 8, "shard_bytes": 3 * len(opt.core.shard) * 8,
        "equal_uninterrupted": bool(np.array_equal(final, whole))}}), flush=True)
ulfm.leave(0)
"""


@pytest.mark.parametrize("strategy", ["zero3"])
def test_sharded_recovery_allocates_no_whole_vector(strategy):
    # 4 ranks, a seeded worker SIGKILLed in its forward: each survivor's recovery
    # call (tracemalloc) allocates less than the whole parameter vector with its
    # Adam state (0.5 put all three together on every survivor: more than that),
    # and the run ends with the bits of the run that lost nothing (reproducible).
    _ft_or_skip()
    rng = np.random.default_rng(30)
    victim, kill = int(rng.integers(0, 4)), int(rng.integers(3, 10))
    job = ulfm_job(4, MEMORY.format(victim=victim, kill=kill, strategy=strategy), timeout=120)
    match = re.search(r"^RESULT (.*)$", job.stdout, re.MULTILINE)
    assert match, job.stdout
    result = json.loads(match.group(1))
    [rec] = result["recoveries"]
    assert rec["lost_ranks"] == [victim] and rec["from"] == "buddy", rec
    peaks = [p for ranks in result["peaks"] for p in ranks]
    print(f"{strategy} recovery: peak {max(peaks)} B on a survivor; whole parameters and "
          f"state {result['whole_bytes']} B, new shard of them {result['shard_bytes']} B; "
          f"moved {rec.get('moved_bytes')} B")
    assert len(peaks) == 3, result
    assert max(peaks) < result["whole_bytes"], result
    assert result["steps"] == 12 and result["equal_uninterrupted"], result


# --- 3D: the replicas that lost a rank are dropped, as with hybrid ZeRO-2 -------------------
def hybrid_zero3_job(job):
    """``tests/faults/test_ulfm_hybrid.py``'s job, comparing the parameters gathered
    from the ZeRO-3 shards (the stage model holds no whole vector)."""
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
