"""Spare ranks (ULFM): seconds from a SIGKILL to the first step at full size, and the
step's cost of keeping spares.

Each job is ``mpirun --with-ft ulfm -n RANKS+SPARES`` of this file (``--worker``):
``ShardingConfiguration(spares=SPARES)``, an MLP trained by ``optimize()`` (DDP or
ZeRO-2 with buddy copies). Every ``--every`` steps a training rank drawn from the
seed SIGKILLs itself after its step (the callback); the survivors promote a spare
and go on at full size. Per kill: the seconds from the kill to the end of the
next step of the full-size world (``kill_to_step``), the recovery's own seconds,
its revoke/shrink/agree, the bytes each newcomer received and the send's seconds.
Then ``--steps-only`` jobs time the step with the spares waiting and without
spares (``-n RANKS``), alternated, and the waiting spares' CPU use (their process
time over their wall time, from [`SparePool`][mpishard.comm.spares.SparePool]).

Prints JSON lines: one ``kills`` summary per model (p50, p99 and max over every kill;
the detection, from the kill to the start of the recovery on the reporting rank,
which counts the survivors' compute up to their next MPI call; the first step
after it; the median of each part of the recovery; sent bytes, implied
bandwidth; the median step), one ``step_cost`` per model. ``--detect`` times
only Open MPI's notice of a death (``--jobs`` jobs of ``--ranks`` ranks, the
last one SIGKILLed, the others testing a request every ``--nap`` seconds). Run (the fault-tolerant
runtime): ``.venv-ft/bin/python benchmarks/bench_spares.py --ranks 8 --spares 4
--jobs 5 --model small``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODELS = {"small": [64, 256, 256, 64], "25m": [1024, 4096, 4096, 1024]}


def worker(args: argparse.Namespace) -> None:
    import signal

    import numpy as np

    from mpishard import ShardingConfiguration
    from mpishard.comm import ulfm
    from mpishard.nn import MLP
    from mpishard.optim import Adam
    from mpishard.strategies import STRATEGIES

    sizes = MODELS[args.model]
    rng = np.random.default_rng(0)
    rows = 8 * args.ranks
    x = rng.standard_normal((16 * rows, sizes[0])).astype(np.float32)
    y = rng.standard_normal((16 * rows, sizes[-1])).astype(np.float32)
    model = MLP(sizes, activation="tanh", loss="mse", dtype=np.float32, seed=1)
    config = ShardingConfiguration(timeout=120, fault_tolerance="ulfm", spares=args.spares)
    options = {"buddy_copies": True} if args.strategy == "zero2" else {}
    opt = STRATEGIES[args.strategy].public_class(Adam(lr=1e-3), config, model=model, **options)
    steps = args.steps
    times: list[float] = []
    current = [opt.config]

    def callback(step: int, loss: float) -> None:
        now = time.time()
        times.append(time.perf_counter())
        world = opt.config.world
        if opt.config is not current[0]:     # rebuilt: the first step after a recovery
            current[0] = opt.config
            if world.rank == 0:
                print(f"STEP {now:.6f}", flush=True)
        k = step // args.every
        if args.kills and step % args.every == 0 and 1 <= k <= args.kills:
            victim = int(np.random.default_rng(args.seed * 100 + k).integers(0, world.size))
            if world.rank == victim:
                print(f"KILL {k} {time.time():.6f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

    # The recovered records: rank 0's metrics file (rank 0 may be a promoted spare).
    result = opt.optimize(model, (x, y), epochs=steps // 16 + 1, batch_size=rows, seed=3,
                          callback=callback, max_steps=steps, metrics_path=args.metrics,
                          log_every=10**6)
    pool = opt.config.spare_pool
    if args.phases:   # every rank's view of each recovery
        for rec in result.recoveries:
            print(f"PHASES {opt.config.world.rank} {result.spare} "
                  + json.dumps({k: round(v, 3) for k, v in rec.get("phases", {}).items()}),
                  flush=True)
    if result.spare == "unused" and pool is not None:
        print("SPARE " + json.dumps({"waited": pool.waited, "cpu": pool.cpu_seconds}),
              flush=True)
    elif opt.config.world.rank == 0 and len(times) > 4:
        gaps = sorted(b - a for a, b in zip(times[1:], times[2:]))   # the first is warm-up
        print("STEPS " + json.dumps({"median": gaps[len(gaps) // 2], "steps": len(gaps)}),
              flush=True)
    ulfm.exit_now(0)


def detect_worker(args: argparse.Namespace) -> None:
    """``--detect``'s job: the last rank SIGKILLs itself, the others wait in an
    ``Iallreduce`` tested every ``--nap`` seconds; each prints the seconds from
    the kill to its error (Open MPI's notice of the death: no compute between)."""
    import signal

    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    stamp = Path(args.metrics + ".kill")
    comm.Barrier()
    if comm.rank == comm.size - 1:
        time.sleep(0.3)
        stamp.write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    request = comm.Iallreduce(MPI.IN_PLACE, np.zeros(1))
    try:
        while not request.Test():
            time.sleep(args.nap)
    except MPI.Exception:
        print(f"DETECT {time.time() - float(stamp.read_text())}", flush=True)
    os._exit(0)


def _detect(args: argparse.Namespace) -> None:
    seconds = []
    for _ in range(args.jobs):
        out = _job(args, args.ranks, ["--detect-worker", "--nap", str(args.nap)])
        seconds += [float(t) for t in re.findall(r"^DETECT (\S+)$", out, re.M)]
    seconds.sort()
    print(json.dumps({"bench": "spares", "what": "detect", "ranks": args.ranks,
                      "jobs": args.jobs, "nap": args.nap, "notices": len(seconds),
                      "p50": statistics.median(seconds) if seconds else None,
                      "p99": seconds[min(len(seconds) - 1, round(0.99 * (len(seconds) - 1)))]
                      if seconds else None, "max": max(seconds, default=None)}), flush=True)


def _job(args: argparse.Namespace, n: int, extra: list[str]) -> str:
    mpirun = Path(sys.executable).parent / "mpirun"
    if os.path.exists(args.metrics):
        os.remove(args.metrics)
    cmd = [str(mpirun), "--with-ft", "ulfm", "--mca", "coll", "^han", "--oversubscribe",
           "-n", str(n), sys.executable, __file__, "--worker", "--model", args.model,
           "--ranks", str(args.ranks), "--strategy", args.strategy, "--metrics",
           args.metrics, *(["--phases"] if args.phases else []), *extra]
    # scripts/mpienv.sh's settings (root allowed, yield when idle, no fast network).
    env = dict(os.environ, PYTHONPATH=str(REPO), OMPI_MCA_mpi_yield_when_idle="1",
               OMPI_MCA_btl="self,vader,tcp")
    if os.getuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    return proc.stdout + proc.stderr


def _kills(args: argparse.Namespace) -> None:
    rows: list[dict] = []
    medians: list[float] = []   # each job's median step (rank 0), for scale
    for job in range(args.jobs):
        out = _job(args, args.ranks + args.spares,
                   ["--spares", str(args.spares), "--kills", str(args.spares), "--every",
                    str(args.every), "--steps", str(args.every * (args.spares + 1) + 4),
                    "--seed", str(job + 1)])
        kills = {int(k): float(t) for k, t in re.findall(r"^KILL (\d+) (\S+)$", out, re.M)}
        steps = [float(t) for t in re.findall(r"^STEP (\S+)$", out, re.M)]
        medians += [json.loads(m)["median"] for m in re.findall(r"^STEPS (.*)$", out, re.M)]
        try:
            with open(args.metrics) as records:
                events = [e for e in map(json.loads, records) if e["event"] == "recovered"]
        except FileNotFoundError:
            events = []
        for line in re.findall(r"^PHASES .*$", out, re.M):
            print(line, file=sys.stderr)
        if not len(steps) == len(kills) == len(events):
            print(f"job {job}: {len(kills)} kills, {len(steps)} steps after, {len(events)} "
                  f"recoveries:\n{out[-3000:]}", file=sys.stderr)
        for k, step, event in zip(sorted(kills), steps, events):
            rows.append({"kill_to_step": step - kills[k], "recovery": event["seconds"],
                         "shrink": event["shrink_seconds"], "sent_bytes": event["sent_bytes"],
                         "send_seconds": event["state_seconds"],
                         "world_size": event["world_size"],
                         "detect": event["started"] - kills[k],
                         "after": step - event["started"] - event["seconds"],
                         **{f"phase_{n}": v for n, v in event["phases"].items()}})
    if not rows:
        print(json.dumps({"bench": "spares", "model": args.model, "error": "no kill recorded"}))
        return
    times = sorted(r["kill_to_step"] for r in rows)

    def pct(q: float) -> float:
        return times[min(len(times) - 1, round(q * (len(times) - 1)))]

    sent = statistics.median(r["sent_bytes"] for r in rows)
    send = statistics.median(r["send_seconds"] for r in rows)
    print(json.dumps({
        "bench": "spares", "what": "kills", "model": args.model, "strategy": args.strategy,
        "params": _params(MODELS[args.model]), "ranks": args.ranks, "kills": len(rows),
        "full_size": all(r["world_size"] == args.ranks for r in rows),
        "kill_to_step_p50": pct(0.5), "kill_to_step_p99": pct(0.99), "max": times[-1],
        "recovery_p50": statistics.median(r["recovery"] for r in rows),
        "shrink_p50": statistics.median(r["shrink"] for r in rows),
        "detect_p50": statistics.median(r["detect"] for r in rows),
        "first_step_p50": statistics.median(r["after"] for r in rows),
        "phases_p50": {k[6:]: statistics.median(r.get(k, 0.0) for r in rows)
                       for k in sorted({k for r in rows for k in r if k.startswith("phase_")})},
        "step_median": statistics.median(medians) if medians else None,
        "sent_bytes": sent, "send_seconds_p50": send,
        "implied_MBps": sent / send / 1e6 if send > 0 else None}), flush=True)


def _step_cost(args: argparse.Namespace) -> None:
    medians: dict[str, list[float]] = {"spares": [], "none": []}
    cpu = []
    for _ in range(args.repeats):
        for kind in ("spares", "none"):
            n = args.ranks + (args.spares if kind == "spares" else 0)
            out = _job(args, n, ["--spares", str(args.spares if kind == "spares" else 0),
                                 "--steps", str(args.steps_timed)])
            found = re.findall(r"^STEPS (.*)$", out, re.M)
            if found:
                medians[kind].append(json.loads(found[0])["median"])
            cpu += [json.loads(s) for s in re.findall(r"^SPARE (.*)$", out, re.M)]
    with_spares, without = (statistics.median(medians[k]) for k in ("spares", "none"))
    print(json.dumps({
        "bench": "spares", "what": "step_cost", "model": args.model, "strategy": args.strategy,
        "ranks": args.ranks, "spares": args.spares, "step_with_spares": with_spares,
        "step_without": without, "ratio": with_spares / without,
        "spare_cpu_fraction": (sum(c["cpu"] for c in cpu) / sum(c["waited"] for c in cpu)
                               if cpu else None)}), flush=True)


def _params(sizes: list[int]) -> int:
    return sum(a * b + b for a, b in zip(sizes, sizes[1:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", choices=MODELS, default="small")
    parser.add_argument("--strategy", choices=("ddp", "zero2"), default="ddp")
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--spares", type=int, default=4)
    parser.add_argument("--jobs", type=int, default=5)
    parser.add_argument("--every", type=int, default=6)
    parser.add_argument("--kills", type=int, default=0)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--steps-timed", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--skip", choices=("kills", "steps"), default=None)
    parser.add_argument("--detect", action="store_true",
                        help="only time how soon the others notice a killed rank")
    parser.add_argument("--detect-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--nap", type=float, default=0.0,
                        help="--detect: seconds slept between two tests of the request")
    parser.add_argument("--phases", action="store_true",
                        help="print every rank's seconds per part of each recovery")
    parser.add_argument("--metrics", default=os.path.join(
        tempfile.gettempdir(), f"bench-spares-{os.getpid()}.jsonl"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.detect_worker:
        detect_worker(args)
        return
    if args.worker:
        worker(args)
        return
    if args.detect:
        _detect(args)
        return
    if args.skip != "kills":
        _kills(args)
    if args.skip != "steps":
        _step_cost(args)


if __name__ == "__main__":
    main()
