"""Seconds from a SIGKILL to the next completed step: ULFM in place vs the relaunch agent.

For each world size, ``--trials`` jobs each lose their last rank at a seeded random
step (and, under ULFM, at a random phase: between steps or inside the backward, while
the others wait in the gradient reduction). Prints one JSON line per runtime and size:
median and max seconds from the kill to the next step completed by the survivors (the
relaunched workers under the agent), and the steps lost (steps done again).

* ``ulfm``: ``mpirun --with-ft ulfm`` of the fault-tolerant runtime (``.venv-ft``,
  ``bash scripts/setup.sh --ft``); the survivors catch the failure and call
  :func:`mpishard.recovery.recover_in_place` (revoke, shrink, agree on
  the last completed step, configuration and DDP rebuilt over the survivors), and
  go on from that step.
* ``ulfm-zero2``: the same with ZeRO-2 and its buddy copies
  (:class:`mpishard.recovery.ShardBuddy`), the phase drawn from between
  steps, inside the backward, and inside the parameter ``Allgatherv`` (after the
  other ranks updated their shards: they take them back and train the step again).
* ``agent``: ``mpishard run`` over Debian's Open MPI 4.1 with ``tests/support/elastic_worker.py``
  (checkpoint every 4 steps); it relaunches at one worker fewer, which resume from
  the newest checkpoint.

Run: ``.venv/bin/python benchmarks/bench_recovery.py --sizes 2 4 8 --trials 10``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

ULFM_JOB = r"""
import json, os, signal, time
import numpy as np
from mpi4py import MPI
from mpishard import ShardingConfiguration
from mpishard.comm import ulfm
from mpishard.data import rank_rows
from mpishard.nn import MLP
from mpishard.optim import Adam
from mpishard.parallel import DDPCore, ZeRO2Core
from mpishard.recovery import ShardBuddy, recover_in_place

STEPS, KILL_AT, WHERE, ZERO2 = {steps}, {kill_at}, {where!r}, {zero2}
rank, size = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size
victim = size - 1
rng = np.random.default_rng(0)
X, Y = rng.standard_normal((STEPS, 48, 16)), rng.integers(0, 4, (STEPS, 48))

def config_over(comm):
    config = ShardingConfiguration(comm, timeout=60)
    g = config.groups
    ulfm.enable([g.world, g.dp, g.tp, g.pp])
    return config

model = MLP([16, 64, 64, 4], activation="tanh", dtype=np.float64, seed=1)
config = config_over(MPI.COMM_WORLD)
if ZERO2:
    ddp = ZeRO2Core(Adam(lr=1e-3), config, model=model, reduce_method="allreduce")
    buddy = ShardBuddy(ddp)
else:
    ddp, buddy = DDPCore(Adam(lr=1e-3), config, model=model), None
if rank == victim and WHERE == "allgather":
    real_g = type(ddp.dp).Allgatherv
    def Allgatherv(self, *a, **k):
        if ddp.step_count == KILL_AT + 1:
            print(f"KILL {{time.time():.6f}}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return real_g(self, *a, **k)
    type(ddp.dp).Allgatherv = Allgatherv
if rank == victim and WHERE == "backward":
    real = model.forward_backward
    def dying(*a, **k):
        out = real(*a, **k)
        if ddp.step_count == KILL_AT:
            print(f"KILL {{time.time():.6f}}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return out
    model.forward_backward = dying
s, done_before, recovered = 0, None, None
while s < STEPS:
    try:
        if rank == victim and WHERE == "between" and s == KILL_AT:
            print(f"KILL {{time.time():.6f}}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        lo, hi = rank_rows(48, ddp.dp.size, ddp.dp.rank)
        ddp.train_step(X[s][lo:hi], Y[s][lo:hi])
        if buddy is not None:
            buddy.exchange()
        s += 1
        if recovered is not None and "next" not in recovered:
            recovered["next"] = time.time()
    except MPI.Exception as exc:
        done_before = s       # steps completed here (a step interrupted is not one)
        ddp, event = recover_in_place(ddp, exc, buddy=buddy)
        buddy = ShardBuddy(ddp) if buddy is not None else None
        s = ddp.step_count
        recovered = {{"step": s, "shrink": event["shrink_seconds"], "done_before": done_before,
                     "rebuild": event["seconds"]}}
if rank == 0:
    print("RESULT", json.dumps(recovered), flush=True)
ulfm.leave(0)      # not MPI_Finalize: it may wait for the dead rank (ompi#11404)
"""


def _run(cmd: list[str], env: dict[str, str], timeout: float = 180) -> str:
    """Run a job in a session of its own; past ``timeout`` kill all of it and raise."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise RuntimeError(f"did not finish within {timeout:g} s") from None
    if proc.returncode != 0:
        raise RuntimeError(f"exit status {proc.returncode}: {out[-300:]}")
    return out


def _ulfm_trial(ft: Path, n: int, kill_at: int, where: str, steps: int,
                zero2: bool = False) -> dict:
    env = dict(os.environ, OMPI_MCA_mpi_yield_when_idle="1")
    code = ULFM_JOB.format(steps=steps, kill_at=kill_at, where=where, zero2=zero2)
    out = _run([str(ft / "bin" / "mpirun"), "--with-ft", "ulfm", "--oversubscribe", "-n", str(n),
                str(ft / "bin" / "python"), "-c", code], env)
    kill = float(re.search(r"KILL (\d+\.\d+)", out).group(1))
    result = json.loads(re.search(r"RESULT (\{.*\})", out).group(1))
    # Steps lost: those the survivors had completed that are done again (0 when the
    # agreed step is the newest any of them completed).
    return {"seconds": result["next"] - kill, "lost": result["done_before"] - result["step"],
            "shrink": result["shrink"], "rebuild": result["rebuild"]}


def _agent_trial(n: int, kill_at: int) -> dict:
    # The global batch must split over n and n - 1 workers (96 rows in the worker).
    batch = 12 if 12 % n == 0 and 12 % max(1, n - 1) == 0 else n * (n - 1)
    epochs = -(-16 // (96 // batch))                       # at least 16 steps
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        cmd = [sys.executable, "-m", "mpishard", "run", "--min-workers=1", f"--workers={n}",
               f"--max-workers={n}", "--launcher=mpirun", "--launcher-args=--oversubscribe",
               "--", sys.executable, str(REPO / "tests" / "support" / "elastic_worker.py"),
               "--ckpt", str(t / "ckpt"), "--events", str(t / "events"), "--every", "4",
               "--batch", str(batch), "--epochs", str(epochs), "--kill-at", str(kill_at),
               "--kill-rank", str(n - 1)]
        _run(cmd, dict(os.environ))
        death = float((t / "events.death").read_text())
        first = [json.loads(line) for line in (t / "events").read_text().splitlines()][0]
        return {"seconds": first["first_step_time"] - death,
                "lost": kill_at - first["resumed_step"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--runtimes", nargs="+", default=["ulfm", "ulfm-zero2", "agent"])
    p.add_argument("--seed", type=int, default=2026)
    p.add_argument("--ft-venv", default=str(REPO / ".venv-ft"))
    args = p.parse_args()
    rng = random.Random(args.seed)
    ft = Path(args.ft_venv)
    for n in args.sizes:
        for runtime in args.runtimes:
            if runtime.startswith("ulfm") and not (ft / "bin" / "mpirun").exists():
                print(json.dumps({"bench": "recovery", "runtime": runtime, "ranks": n,
                                  "skipped": f"no {ft} (bash scripts/setup.sh --ft)"}))
                continue
            trials, failed = [], []
            t0 = time.time()
            for _ in range(args.trials):
                kill_at = rng.randrange(5, 14)
                where = rng.choice(["between", "backward"] + (
                    ["allgather"] if runtime == "ulfm-zero2" else []))
                try:
                    trials.append(_ulfm_trial(ft, n, kill_at, where, 16,
                                              zero2=runtime == "ulfm-zero2")
                                  if runtime.startswith("ulfm") else _agent_trial(n, kill_at))
                except (RuntimeError, OSError, AttributeError, ValueError) as exc:
                    failed.append(f"kill at {kill_at} ({where}): {exc}"[:300])
            if not trials:
                print(json.dumps({"bench": "recovery", "runtime": runtime, "ranks": n,
                                  "failed": failed}), flush=True)
                continue
            seconds = [t["seconds"] for t in trials]
            record = {"bench": "recovery", "runtime": runtime, "ranks": n, "trials": len(trials),
                      "failed_trials": failed,
                      "median_s": round(statistics.median(seconds), 4),
                      "max_s": round(max(seconds), 4),
                      "steps_lost_max": max(t["lost"] for t in trials),
                      "wall_s": round(time.time() - t0, 1)}
            if runtime.startswith("ulfm"):
                record["shrink_agree_median_s"] = round(
                    statistics.median(t["shrink"] for t in trials), 4)
                record["recover_in_place_median_s"] = round(
                    statistics.median(t["rebuild"] for t in trials), 4)
            print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
