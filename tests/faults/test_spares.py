"""Spare ranks promoted in place (ULFM): back to full size, on the trajectory of the
run that lost nothing.

Runs only in the fault-tolerant runtime (``.venv-ft/bin/python -m pytest
tests/faults/test_spares.py``); elsewhere it skips, saying why. Each test starts
``mpirun --with-ft ulfm -n 5`` (4 training ranks and 1 spare; 6 with 2 spares):
a float64 MLP (Adam, global batch 24, 2 epochs of 8 steps) trained by
``optimize()`` of each strategy of the registry (``tests/support/strategies.py``)
with ``ShardingConfiguration(spares=K)``, twice in one job: once losing nothing
(the spare is released at the end: ``TrainResult.spare == "unused"``), then
with a training rank SIGKILLed at a step and a phase drawn from a seed (between
steps, or inside the backward: the survivors then wait in the gradient
reduction). The spare takes the lost rank's place and state; the final
parameters must equal the first run's (float64, rtol 1e-12; bit for bit with
``reproducible=True``), and so must every step's loss (the same samples in the
same batches: none skipped, none twice). One test trains with two ``optimize()``
calls of the same optimizer: the spare released by the first serves the second.
"""

from __future__ import annotations

import json
import re
import zlib

import numpy as np
import pytest
from strategies import NAMES
from test_ulfm import _ft_or_skip, ulfm_job

pytestmark = pytest.mark.launch

JOB = r"""
import functools, json, os, signal, sys, time
import numpy as np
from mpi4py import MPI
from mpishard import ShardingConfiguration
from mpishard.comm import ulfm
from mpishard.nn import MLP
from mpishard.optim import Adam
from strategies import build, whole

assert ulfm.available()[0], ulfm.available()[1]
NAME, SPARES, REPRO, CALLS = {name!r}, {spares}, {repro}, {calls}   # CALLS: epoch totals
KILLS = {kills}   # (world rank, step, phase): "between", "backward", "waiting";
                  # (world rank, call, "after_call"): when that call has returned
rank = MPI.COMM_WORLD.rank
rng = np.random.default_rng(0)
ROWS = 24
X = rng.standard_normal((8 * ROWS, 5))
Y = rng.integers(0, 3, 8 * ROWS)
pids = MPI.COMM_WORLD.allgather(os.getpid())


def die(why):
    print(f"KILL {{rank}} {{why}} {{time.time():.6f}}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def run(kills):
    model = MLP([5, 16, 3], activation="tanh", dtype=np.float64, seed=1)
    config = ShardingConfiguration(timeout=60, fault_tolerance="ulfm", spares=SPARES,
                                   reproducible=REPRO)
    opt = build(NAME, Adam(lr=1e-2), config, model=model, bucket_mb=0.0005)
    real = model.forward_backward
    @functools.wraps(real)     # its signature: a rebuild sees loss_scale= as at attach
    def forward_backward(*a, **k):
        for who, step, phase in kills:
            if who == rank and phase == "backward" and opt.step_count == step:
                real(*a, **k)
                die("backward")
        return real(*a, **k)
    model.forward_backward = forward_backward
    def callback(step, loss):
        for who, at, phase in kills:
            if who == rank and phase == "between" and step == at:
                die("between")
            if phase == "waiting" and step == at and opt.config.world.rank == 0:
                os.kill(pids[who], signal.SIGKILL)     # a spare, while it waits
                print(f"KILL {{who}} waiting {{time.time():.6f}}", flush=True)
    seen, recoveries = [], []
    for call, epochs in enumerate(CALLS):   # the same optimizer over several calls
        result = opt.optimize(model, (X, Y), epochs=epochs, batch_size=ROWS, seed=3,
                              callback=callback)
        seen.append(result.spare)
        recoveries += result.recoveries
        for who, at, phase in kills:
            if who == rank and phase == "after_call" and at == call:
                die("after call")     # between this call and the next
    result.recoveries, result.spare = recoveries, seen[-1]
    return opt, result, seen


opt, result, _ = run([])
unused = result.spare == "unused"
ref = np.zeros(opt.model.layout.size)
if not unused:
    ref[...] = whole(opt)
MPI.COMM_WORLD.Bcast(ref, root=0)
losses = MPI.COMM_WORLD.bcast(result.losses, root=0)
spares = MPI.COMM_WORLD.allgather(result.spare)

opt, result, seen = run(KILLS)
if result.spare != "unused":
    final = whole(opt)
    mine = {{"equal": bool(np.array_equal(final, ref)),
             "close": bool(np.allclose(final, ref, rtol=1e-12, atol=0)),
             "losses_equal": result.losses == losses,
             "losses_close": bool(np.allclose(result.losses, losses, rtol=1e-12, atol=0)),
             "error": float(np.max(np.abs(final - ref) / np.abs(ref))),
             "spare": result.spare, "calls": seen, "rank": rank}}
    every = opt.config.world.allgather(mine)
    if opt.config.world.rank == 0:
        print("RESULT " + json.dumps({{
            "ranks": every, "first_spares": spares, "recoveries": result.recoveries,
            "steps": opt.step_count, "world_size": opt.config.world.size,
            "samples": result.samples}}), flush=True)
ulfm.exit_now(0)      # not MPI_Finalize: it may wait for the dead ranks (ompi#11404)
"""


def _job(name, kills, *, spares=1, repro=False, n=5, timeout=90, calls=(2,)):
    _ft_or_skip()
    code = f"import sys; sys.path.insert(0, {str(_support())!r})\n" + JOB.format(
        name=name, spares=spares, repro=repro, kills=kills, calls=list(calls))
    job = ulfm_job(n, code, timeout=timeout)
    out = job.stdout
    match = re.search(r"^RESULT (.*)$", out, re.MULTILINE)
    assert match, out
    assert job.returncode in (0, None), out   # None: hung in MPI_Finalize, see ulfm_job
    assert "Traceback" not in out, out
    return json.loads(match.group(1)), out


def _support():
    from mpijobs import SUPPORT
    return SUPPORT


def _draw(name):
    """A victim (training rank 0-3), a step (1-14) and a phase, drawn from the name
    (``"spare ddp"``: rank 0 in the backward after step 4; zero2: rank 3 in the
    backward after step 5; zero3: rank 1 after step 13)."""
    rng = np.random.default_rng(zlib.crc32(f"spare {name}".encode()))
    return int(rng.integers(0, 4)), int(rng.integers(1, 15)), str(rng.choice(
        ["between", "backward"]))


@pytest.mark.parametrize("name", NAMES)
def test_a_spare_takes_the_lost_ranks_place_and_the_run_ends_as_if_nothing_was_lost(name):
    victim, step, phase = _draw(name)
    repro = name == "zero3"   # one case in reproducible mode: bit for bit
    result, out = _job(name, [(victim, step, phase)], repro=repro)
    assert result["first_spares"] == [None] * 4 + ["unused"], result   # released, unused
    assert len(result["recoveries"]) == 1, (result["recoveries"], out)
    [rec] = result["recoveries"]
    assert rec["from"] == "spares" and rec["lost_ranks"] == [victim], rec
    assert rec["promoted"] == [4] and rec["spares_left"] == 0, rec
    assert rec["world_size"] == 4 and result["world_size"] == 4, rec
    # After step `step` (its callback), or in the backward of the next one: the
    # survivors go on from `step` either way.
    assert rec["step"] == step, (rec, phase)
    assert rec["sent_bytes"] > 0, rec
    assert result["steps"] == 16 and result["samples"] == 16 * 24, result
    ranks = result["ranks"]
    assert sorted(r["rank"] for r in ranks) == sorted({0, 1, 2, 3, 4} - {victim}), ranks
    assert [r["spare"] for r in ranks].count("promoted") == 1, ranks
    for r in ranks:
        assert r["close"] and r["losses_close"], (r, out)
        if repro:
            assert r["equal"] and r["losses_equal"], r


def test_a_spare_lost_while_waiting_then_one_used_in_a_later_call_then_one_more_loss():
    # 4 training ranks, spares 4 and 5, two optimize() calls of the same optimizer
    # (epochs 1, then 2 in total: steps 1-8, 9-16). Spare 5 is killed while it
    # waits (nobody notices); the first call ends: spare 4 is released and waits
    # again in the second call; rank 1 dies at step 10: spare 4 takes its place
    # (the shrink leaves the dead spare out); rank 2 dies at step 13: no spare is
    # left, the survivors shrink to 3 ranks as without spares.
    kills = [(5, 2, "waiting"), (1, 10, "between"), (2, 13, "backward")]
    result, out = _job("ddp", kills, spares=2, n=6, calls=(1, 2))
    assert result["first_spares"] == [None] * 4 + ["unused", "unused"], result
    first, second = result["recoveries"]
    assert first["from"] == "spares" and first["lost_ranks"] == [1], first
    assert first["promoted"] == [4] and first["spares_left"] == 0, first
    assert first["world_size"] == 4 and first["step"] == 10, first
    assert second["from"] == "survivor" and second["lost_ranks"] == [2], second
    assert second["world_size"] == 3 and second["step"] == 13, second
    assert result["world_size"] == 3 and result["steps"] == 16, result
    calls = {r["rank"]: r["calls"] for r in result["ranks"]}
    assert calls[4] == ["unused", "promoted"], calls   # released, then promoted
    # Up to the second loss the run is the one that lost nothing; then it goes on
    # over 3 ranks (the same global batches: float64 sums in another order).
    for r in result["ranks"]:
        assert r["error"] < 1e-10, r


@pytest.mark.parametrize("name,repro", [("ddp", True), ("zero2", False)])
def test_a_rank_lost_between_two_calls_is_replaced_in_the_next_one(name, repro):
    # Rank 1 dies after the first optimize() call returned (step 8): the second
    # call's first collective (a fault-tolerant agreement) finds it, the spare
    # takes its place from the survivors (ZeRO-2: the first call's buddy copy of
    # its shard) and the run ends as the one that lost nothing (before: the
    # survivors' next collective failed outside a step, a traceback or a hang).
    result, out = _job(name, [(1, 0, "after_call")], repro=repro, calls=(1, 2), timeout=120)
    [rec] = result["recoveries"]
    assert rec["from"] == "spares" and rec["lost_ranks"] == [1], rec
    assert rec["promoted"] == [4] and rec["step"] == 8 and rec["world_size"] == 4, rec
    assert result["steps"] == 16 and result["world_size"] == 4, result
    calls = {r["rank"]: r["calls"] for r in result["ranks"]}
    assert calls[4] == ["unused", "promoted"] and calls[0] == [None, None], calls
    for r in result["ranks"]:
        assert r["close"] and r["losses_close"], (r, out)
        if repro:
            assert r["equal"] and r["losses_equal"], r


def test_a_rank_lost_between_two_calls_without_spares_shrinks_in_the_next_one():
    # No spare: the second call goes on over the 3 survivors from step 8.
    result, out = _job("zero2", [(1, 0, "after_call")], spares=0, n=4, calls=(1, 2),
                       timeout=120)
    [rec] = result["recoveries"]
    assert rec["from"] == "buddy" and rec["lost_ranks"] == [1], rec
    assert rec["step"] == 8 and rec["world_size"] == 3, rec
    assert result["steps"] == 16 and result["world_size"] == 3, result
    for r in result["ranks"]:   # the same global batches over 3 ranks
        assert r["error"] < 1e-10, (r, out)


PROMOTION_JOB = r"""
import os, signal, sys
import numpy as np
from mpi4py import MPI
from mpishard import ShardingConfiguration
from mpishard.comm import FlatComm, ulfm
from mpishard.nn import MLP
from mpishard.optim import Adam
from strategies import build

rank = MPI.COMM_WORLD.rank
rng = np.random.default_rng(0)
X, Y = rng.standard_normal((192, 5)), rng.integers(0, 3, 192)
model = MLP([5, 16, 3], activation="tanh", dtype=np.float64, seed=1)
config = ShardingConfiguration(timeout=60, fault_tolerance="ulfm", spares=1)
opt = build("ddp", Adam(lr=1e-2), config, model=model)
real = FlatComm.Isend
def Isend(self, buf, *a, slot=None, **k):   # rank 2 dies as it sends its piece of the state
    if rank == 2 and isinstance(slot, tuple) and slot[:2] == ("spares", "params"):
        os.kill(os.getpid(), signal.SIGKILL)
    return real(self, buf, *a, slot=slot, **k)
FlatComm.Isend = Isend
def callback(step, loss):
    if rank == 1 and step == 3:
        os.kill(os.getpid(), signal.SIGKILL)
opt.optimize(model, (X, Y), epochs=2, batch_size=24, seed=3, callback=callback)
print("NOT REACHED", flush=True)
"""


def test_a_rank_lost_during_the_promotion_ends_the_job_with_one_line():
    _ft_or_skip()
    code = f"import sys; sys.path.insert(0, {str(_support())!r})\n" + PROMOTION_JOB
    job = ulfm_job(5, code, timeout=90)
    out = job.stdout
    assert job.returncode == 75, out
    lines = [line for line in out.splitlines() if line.startswith("[mpishard]")]
    assert len(lines) == 1, out     # the lowest survivor speaks; MPI's error is its own
    assert re.fullmatch(
        r"\[mpishard\] train: a rank was lost while spare world rank\(s\) \[4\] took the "
        r"place\(s\) of lost training rank\(s\) \[1\] \(world rank\(s\) \[1\]\): "
        r"MPI_ERR_(PROC_FAILED|REVOKED): .*; restart from a checkpoint; exiting with 75 to "
        r"be relaunched", lines[0]), out
    assert "Traceback" not in out and "NOT REACHED" not in out, out
