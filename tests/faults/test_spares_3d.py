"""A spare rank takes a lost tensor rank's place in a 3D layout (ULFM): back to full
size, every group rebuilt, on the trajectory of the run that lost nothing.

Runs only in the fault-tolerant runtime (``.venv-ft/bin/python -m pytest
tests/faults/test_spares_3d.py``); elsewhere it skips, saying why. Each test
starts ``mpirun --with-ft ulfm -n 9``: tensor 2 x pipeline 2 x data 2 (8
training ranks) and 1 spare, a tiny float64 ``ParallelMLP`` (6-8-8-4, Adam,
global batch 8 in 2 micro-batches, 2 epochs of 4 steps) as a
``HybridShardedModel`` trained by ``HybridShardedOptimizer.optimize()`` with
``ShardingConfiguration(spares=1)``, twice in one job: once losing nothing (the
spare is released at the end), then with a training rank SIGKILLed at a step and
a phase drawn from a seed (between steps, or inside its stage's backward: its
tensor partner waits in the layer's ``Allreduce``, the other stage in a pipeline
``Recv``, its replica partner in the data-parallel reduction). The spare takes
the lost rank's (data, tensor, pipeline) coordinates; its slice's parameters
and optimizer state come from its data-parallel group (hybrid DDP: a replica
holds the same slice; hybrid ZeRO-2/ZeRO-3: the survivors' shards and the buddy
copy). Every rank's final slice must equal the first run's slice at the same
coordinates (float64, rtol 1e-12; bit for bit with ``reproducible=True``), and
so must every step's loss (none of the samples skipped or seen twice).
"""

from __future__ import annotations

import json
import re
import zlib

import numpy as np
import pytest
from test_ulfm import _ft_or_skip, ulfm_job

pytestmark = pytest.mark.launch

JOB = r"""
import functools, json, os, signal, sys, time
import numpy as np
from mpi4py import MPI
from mpishard import ShardingConfiguration
from mpishard.comm import FlatComm, ulfm
from mpishard.nn import ParallelMLP
from mpishard.optim import Adam
from mpishard.strategies import HybridShardedModel, HybridShardedOptimizer
from strategies import whole

assert ulfm.available()[0], ulfm.available()[1]
STRATEGY, REPRO, KILLS, TP, PP = {strategy!r}, {repro}, {kills}, {tp}, {pp}
IN_PROMOTION = {in_promotion}      # a world rank that dies as the state is sent, or None
SIZES, MEASURE = {sizes}, {measure}
rank = MPI.COMM_WORLD.rank
rng = np.random.default_rng(0)
ROWS = 8
X = rng.standard_normal((4 * ROWS, 6))
Y = rng.integers(0, 4, 4 * ROWS)
pids = MPI.COMM_WORLD.allgather(os.getpid())
factory = functools.partial(ParallelMLP, SIZES, activation="tanh", dtype=np.float64, seed=5)
PEAK = []     # the spare's promotion (tracemalloc): (bytes it still holds, peak bytes)
if MEASURE and rank == 8:
    import tracemalloc
    from mpishard.recovery import spares as promotion
    real_take_seats = promotion._take_seats
    def take_seats(*a, **k):
        tracemalloc.start()      # after its placeholder: what the promotion allocates
        try:
            return real_take_seats(*a, **k)
        finally:
            PEAK.append(tracemalloc.get_traced_memory())   # (held after, peak)
            tracemalloc.stop()
    promotion._take_seats = take_seats


def die(why):
    print(f"KILL {{rank}} {{why}} {{time.time():.6f}}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def run(kills):
    global MODEL
    config = ShardingConfiguration(timeout=60, fault_tolerance="ulfm", spares=1,
                                   reproducible=REPRO, tensor_parallel_size=TP,
                                   pipeline_parallel_size=PP)
    model = MODEL = HybridShardedModel(factory, config, micro_batches=2)
    opt = HybridShardedOptimizer(Adam(lr=1e-2), config, data_parallel=STRATEGY, model=model)
    for who, at, phase in kills:
        if who == rank and phase == "backward":
            stage, real = model.stage_model, model.stage_model.backward_stage
            def backward_stage(*a, **k):
                if opt.step_count == at:
                    die("backward")
                return real(*a, **k)
            stage.backward_stage = backward_stage
    def callback(step, loss):
        # The victims of one step die at once: the first SIGKILLs the others (which
        # may be behind it, in another stage), then itself; else a survivor could
        # notice the first death and recover before the second victim got there.
        between = [who for who, at, phase in kills if phase == "between" and at == step]
        if between and between[0] == rank:
            for who in between[1:]:
                os.kill(pids[who], signal.SIGKILL)
                print(f"KILL {{who}} between (by {{rank}})", flush=True)
            die("between")
        for who, at, phase in kills:
            if phase == "waiting" and step == at and opt.config.world.rank == 0:
                os.kill(pids[who], signal.SIGKILL)     # the spare, while it waits
                print(f"KILL {{who}} waiting", flush=True)
    result = opt.optimize(model, (X, Y), epochs=2, batch_size=ROWS, seed=3, callback=callback)
    return opt, result


def where(opt):
    c = opt.config.groups.coordinates
    return (c.dp, c.tp, c.pp)


if IN_PROMOTION is not None:
    real_bcast = FlatComm.Bcast
    def Bcast(self, buf, *a, slot=None, **k):
        if rank == IN_PROMOTION and slot is not None and slot[0] == "spares":
            die("promotion")
        return real_bcast(self, buf, *a, slot=slot, **k)
    FlatComm.Bcast = Bcast
    run(KILLS)
    print("NOT REACHED", flush=True)
    ulfm.exit_now(0)

opt, result = run([])
mine = None if result.spare == "unused" else (where(opt), whole(opt).tolist())
ref = dict((tuple(k), np.array(v)) for k, v in filter(None, MPI.COMM_WORLD.allgather(mine)))
losses = MPI.COMM_WORLD.bcast(result.losses, root=0)
spares = MPI.COMM_WORLD.allgather(result.spare)

opt, result = run(KILLS)
if result.spare != "unused":
    final, expected = whole(opt), ref[where(opt)]
    mine = {{"rank": rank, "where": where(opt), "spare": result.spare,
             "equal": bool(np.array_equal(final, expected)),
             "close": bool(np.allclose(final, expected, rtol=1e-12, atol=0)),
             "error": float(np.max(np.abs(final - expected) / np.abs(expected))),
             "losses_equal": result.losses == losses,
             "losses_close": bool(np.allclose(result.losses, losses, rtol=1e-12, atol=0)),
             "peak": PEAK[-1] if PEAK else None,
             "slice_bytes": MODEL.layout.size * 8}}
    every = opt.config.world.allgather(mine)
    if opt.config.world.rank == 0:
        print("RESULT " + json.dumps({{
            "ranks": every, "first_spares": spares, "recoveries": result.recoveries,
            "steps": opt.step_count, "world_size": opt.config.world.size,
            "samples": result.samples}}), flush=True)
ulfm.exit_now(0)      # not MPI_Finalize: it may wait for the dead ranks (ompi#11404)
"""


def _code(strategy, kills, *, repro=False, tp=2, pp=2, in_promotion=None,
          sizes=(6, 8, 8, 4), measure=False):
    from mpijobs import SUPPORT
    return f"import sys; sys.path.insert(0, {str(SUPPORT)!r})\n" + JOB.format(
        strategy=strategy, repro=repro, kills=kills, tp=tp, pp=pp, in_promotion=in_promotion,
        sizes=list(sizes), measure=measure)


def _draw(name):
    """A victim (training rank 0-7: each holds a tensor slice of a stage), a step
    (1-7) and a phase, drawn from the name."""
    rng = np.random.default_rng(zlib.crc32(f"spare 3d {name}".encode()))
    return int(rng.integers(0, 8)), int(rng.integers(1, 8)), str(rng.choice(
        ["between", "backward"]))


def _result(job):
    """The RESULT record of a job that ended well (exit 0, or None: hung in
    MPI_Finalize, see ulfm_job), with no traceback."""
    out = job.stdout
    match = re.search(r"^RESULT (.*)$", out, re.MULTILINE)
    assert match, out
    assert job.returncode in (0, None) and "Traceback" not in out, out
    return json.loads(match.group(1))


def _hand_over_lines(job):
    """The ``[mpishard]`` lines of a job that handed over: exit 75, no traceback."""
    out = job.stdout
    assert job.returncode in (75, None), out
    assert "Traceback" not in out and "NOT REACHED" not in out, out
    return [line for line in out.splitlines() if line.startswith("[mpishard]")]


def _hands_over_saying(job, line):
    """The job handed over (exit 75) with exactly this one ``[mpishard]`` line."""
    assert _hand_over_lines(job) == [line], job.stdout


@pytest.mark.parametrize("strategy,repro", [("ddp", True), ("zero2", False), ("zero3", True)])
def test_a_spare_takes_a_tensor_ranks_place_in_a_3d_layout(strategy, repro):
    _ft_or_skip()
    victim, step, phase = _draw(strategy)
    job = ulfm_job(9, _code(strategy, [(victim, step, phase)], repro=repro), timeout=150)
    result = _result(job)
    assert result["first_spares"] == [None] * 8 + ["unused"], result
    [rec] = result["recoveries"]
    assert rec["from"] == "spares" and rec["lost_ranks"] == [victim], rec
    assert rec["promoted"] == [8] and rec["spares_left"] == 0, rec
    assert rec["world_size"] == 8 and result["world_size"] == 8, rec
    assert rec["step"] == step, (rec, phase)
    assert rec["sent_bytes"] > 0, rec
    assert result["steps"] == 8 and result["samples"] == 8 * 8, result
    ranks = result["ranks"]
    assert sorted(r["rank"] for r in ranks) == sorted(set(range(9)) - {victim}), ranks
    # The spare sits where the victim sat: tp-dp-pp order, rank = (pp*dp + dp_rank)*tp + tp.
    spare = next(r for r in ranks if r["spare"] == "promoted")
    assert spare["rank"] == 8 and spare["where"] == [(victim // 2) % 2, victim % 2,
                                                     victim // 4], (spare, victim)
    assert sorted(tuple(r["where"]) for r in ranks) == sorted(
        (d, t, p) for d in range(2) for t in range(2) for p in range(2)), ranks
    for r in ranks:
        assert r["close"] and r["losses_close"], (r, job.stdout)
        if repro:
            assert r["equal"] and r["losses_equal"], r
    print(f"{strategy} victim {victim} step {step} {phase}: recovery {rec['seconds']:.3f} s, "
          f"{rec['sent_bytes']} bytes to the newcomer")


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_the_newcomer_receives_only_its_shard_under_3d_zero(strategy):
    # A wider stage (each tensor slice ~34k float64 parameters): rank 1 (dp 0, tp 1,
    # pp 0) dies in its backward at step 3; the spare gets only its shard of the
    # optimizer state (and of ZeRO-3's parameters) from the buddy copy. What its
    # promotion allocates beyond what it then holds to train (tracemalloc: peak
    # minus held) stays under 1.5 slices; the whole slice sent before (parameters,
    # m, v, and the stage built whole) made it 3.0 (ZeRO-2) and 4.0 (ZeRO-3)
    # slices. The run ends as the one that lost nothing.
    _ft_or_skip()
    job = ulfm_job(9, _code(strategy, [(1, 3, "backward")], repro=strategy == "zero3",
                            sizes=(6, 256, 256, 256, 4), measure=True), timeout=240)
    result = _result(job)
    [rec] = result["recoveries"]
    assert rec["from"] == "spares" and rec["promoted"] == [8], rec
    assert result["steps"] == 8 and result["world_size"] == 8, result
    spare = next(r for r in result["ranks"] if r["spare"] == "promoted")
    slice_bytes, half = spare["slice_bytes"], spare["slice_bytes"] // 2
    # Its shard of parameters, m and v (ZeRO-2: the whole parameters, gathered).
    assert rec["sent_bytes"] == (3 * half if strategy == "zero3" else slice_bytes + 2 * half), rec
    held, peak = spare["peak"]
    assert peak - held < 1.5 * slice_bytes, (held, peak, slice_bytes)
    for r in result["ranks"]:
        assert r["close"] and r["losses_close"], r
        if strategy == "zero3":
            assert r["equal"] and r["losses_equal"], r
    print(f"{strategy}: newcomer's promotion peak {peak} B, held after {held} B, "
          f"slice {slice_bytes} B, "
          f"received {rec['sent_bytes']} B")


def test_a_rank_lost_while_the_3d_state_is_sent_ends_with_one_line():
    # Rank 1 dies after step 2; rank 6 (another data group) dies in the promotion's
    # Bcast: every rank leaves with exit 75, the lowest survivor's one line.
    _ft_or_skip()
    job = ulfm_job(9, _code("ddp", [(1, 2, "between")], in_promotion=6), timeout=150)
    out = job.stdout
    lines = _hand_over_lines(job)
    assert len(lines) == 1, out
    assert re.fullmatch(
        r"\[mpishard\] train: a rank was lost while spare world rank\(s\) \[8\] took the "
        r"place\(s\) of lost training rank\(s\) \[1\] \(world rank\(s\) \[1\]\): "
        r"MPI_ERR_(PROC_FAILED|REVOKED): .*; restart from a checkpoint; exiting with 75 to "
        r"be relaunched", lines[0]), out


def test_a_single_replica_3d_layout_hands_over_naming_the_lost_rank():
    # tp 2 x pp 2 x dp 1 and a spare: no survivor holds the lost slice; the spare
    # is not promoted, every rank leaves with 75, one line says why.
    _ft_or_skip()
    job = ulfm_job(5, _code("ddp", [(2, 3, "between")], in_promotion=-1), timeout=120)
    _hands_over_saying(job, (
        "[mpishard] train: lost world rank(s) [2] after step 3, spares not promoted: the "
        "layout has tensor_parallel_size=2, pipeline_parallel_size=2 and "
        "data_parallel_size=1: the lost rank held a piece of the only model replica; "
        "exiting with 75 to be relaunched"))


def test_two_ranks_lost_with_one_spare_hand_over_naming_them():
    # Ranks 1 and 6 (two slices) die after the same step; one spare cannot fill
    # both places: it is not promoted, every rank leaves with 75, one line says why.
    _ft_or_skip()
    job = ulfm_job(9, _code("ddp", [(1, 3, "between"), (6, 3, "between")], in_promotion=-1),
                   timeout=120)
    _hands_over_saying(job, (
        "[mpishard] train: lost world rank(s) [1, 6] after step 3, spares not promoted: 2 "
        "training rank(s) lost, 1 spare(s) alive: a 3D layout needs a spare for each lost "
        "rank; exiting with 75 to be relaunched"))


def test_the_spare_used_then_one_more_loss_drops_the_broken_replica():
    # Rank 1 dies after step 2: the spare (world rank 8) takes its place. Rank 6
    # dies after step 5: no spare is left, replica 1 (world ranks 2, 3, 6, 7) is
    # dropped as without spares, and replica 0, the newcomer in it, goes on alone.
    _ft_or_skip()
    job = ulfm_job(9, _code("ddp", [(1, 2, "between"), (6, 5, "between")]), timeout=150)
    result = _result(job)
    first, second = result["recoveries"]
    assert first["from"] == "spares" and first["lost_ranks"] == [1], first
    assert first["promoted"] == [8] and first["world_size"] == 8 and first["step"] == 2, first
    assert second["from"] == "replica" and second["lost_ranks"] == [6], second
    assert second["dropped_ranks"] == [2, 3, 7] and second["data_parallel_size"] == 1, second
    assert result["world_size"] == 4 and result["steps"] == 8, result
    assert sorted(r["rank"] for r in result["ranks"]) == [0, 4, 5, 8], result
    # Equal to the run that lost nothing up to step 5, then the same global batches
    # over one replica (float64 sums in another order).
    for r in result["ranks"]:
        assert r["error"] < 1e-10, r


def _dropped_replica_run(job, dropped, kept):
    """The job went on over the whole replica (world ranks ``kept``, dp 1) after
    dropping the broken one (its alive ranks ``dropped``), as without spares."""
    result = _result(job)
    [rec] = result["recoveries"]
    assert rec["from"] == "replica" and rec["dropped_ranks"] == dropped, rec
    assert rec["data_parallel_size"] == 1 and rec["world_size"] == 4, rec
    assert result["world_size"] == 4 and result["steps"] == 8, result
    assert sorted(r["rank"] for r in result["ranks"]) == kept, result
    for r in result["ranks"]:   # the same global batches over one replica
        assert r["error"] < 1e-10, r
    return rec


def test_the_spare_lost_while_waiting_then_a_loss_drops_the_broken_replica():
    # The spare (world rank 8) is killed while it waits (nobody notices), rank 1
    # dies after step 3: the shrink finds no spare alive, and the run goes on as
    # without spares: replica 0 (world ranks 0, 1, 4, 5) is dropped, replica 1
    # goes on alone (it handed over with exit 75 before).
    _ft_or_skip()
    job = ulfm_job(9, _code("ddp", [(8, 1, "waiting"), (1, 3, "between")]), timeout=150)
    rec = _dropped_replica_run(job, [0, 4, 5], [2, 3, 6, 7])
    assert rec["lost_ranks"] == [1] and rec["step"] == 3, rec


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_two_losses_in_one_replica_with_one_spare_drop_it_and_the_spare_waits(strategy):
    # Ranks 1 and 4 (both of replica 0) die after step 3, one spare alive: too few
    # for both places, so replica 0 is dropped as without spares; the spare keeps
    # waiting and is released at the end (no hang).
    _ft_or_skip()
    job = ulfm_job(9, _code(strategy, [(1, 3, "between"), (4, 3, "between")]), timeout=150)
    rec = _dropped_replica_run(job, [0, 5], [2, 3, 6, 7])
    assert rec["lost_ranks"] == [1, 4], rec


def test_the_newest_step_every_slice_holds_and_its_sources():
    from mpishard.recovery.spares3d import newest_common_step, short_of_spares

    # (dp, tp, pp, step): slice (0, 0) has dp 0 at step 5 and dp 1 at 4; (1, 0) only 4.
    assert newest_common_step([(0, 0, 0, 5), (1, 0, 0, 4), (1, 1, 0, 4)]) == \
        (4, {(0, 0): 1, (1, 0): 1})
    assert newest_common_step([(0, 0, 0, 5), (1, 1, 0, 4)]) == (None, {})
    assert newest_common_step([(1, 0, 0, 5), (0, 0, 0, 5), (0, 1, 0, 5)]) == \
        (5, {(0, 0): 0, (1, 0): 0})
    assert short_of_spares(1, 1) is None
    assert short_of_spares(2, 1) == ("2 training rank(s) lost, 1 spare(s) alive: a 3D "
                                     "layout needs a spare for each lost rank")


def test_mpishard_train_3d_with_a_spare_runs(tmp_path):
    # The spare's placeholder model is not evaluated before training (its 3D
    # pipeline has no peers: MPI_ERR_RANK aborted the job before the fix).
    _ft_or_skip()
    argv = ["train", "--example", "gpt", "--strategy", "hybrid", "--tp", "2", "--pp", "2",
            "--spares", "1", "--max-steps", "3", "--fault-tolerance", "ulfm", "--d-model", "16",
            "--layers", "2", "--heads", "2", "--out", str(tmp_path)]
    code = (f"import sys; from mpishard.cli import main; rc = main({argv!r}); "
            f"print('RESULT', rc, flush=True); sys.exit(rc)")
    job = ulfm_job(9, code, timeout=150)
    out = job.stdout
    assert job.returncode in (0, None), out
    assert "tp 2 x pp 2 x dp 2" in out and "1 spare(s)" in out, out
    assert "stopped at --max-steps 3" in out and out.count("RESULT 0") == 9, out
    assert "Traceback" not in out, out
