"""Time from a worker's death to the first training step after the relaunch.

    python benchmarks/bench_elastic.py --workers 4 --repeats 3

Runs ``mpishard run`` over ``tests/support/elastic_worker.py`` (a small MLP with
ElasticOptimizer, checkpoints every 4 steps); one worker SIGKILLs itself at step
9 after writing the time. The relaunched job (one worker fewer) records the time
of its first step. Prints one JSON line per run: the recovery time split into
the launcher noticing the death (mpirun ending the job), and the relaunch
(process start, MPI init, imports, loading the checkpoint, one step).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--strategy", default="ddp")
    args = parser.parse_args()
    env = dict(os.environ)
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    for run in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            log = tmp / "agent.log"
            cmd = [sys.executable, "-m", "mpishard", "run", "--min-workers=1",
                   f"--max-workers={args.workers}", f"--workers={args.workers}",
                   "--launcher=mpirun", "--launcher-args=--oversubscribe", f"--log={log}", "--",
                   sys.executable, str(REPO / "tests" / "support" / "elastic_worker.py"),
                   "--ckpt", str(tmp / "ckpt"), "--events", str(tmp / "events"),
                   "--strategy", args.strategy, "--kill-at", "9", "--kill-rank", "1"]
            proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, timeout=300)
            if proc.returncode != 0:
                print(proc.stdout, file=sys.stderr)
                return 1
            died = float((tmp / "events.death").read_text())
            agent = [json.loads(line) for line in log.read_text().splitlines()]
            noticed = next(e["time"] for e in agent if e["event"] == "failure")
            relaunch = json.loads((tmp / "events").read_text().splitlines()[0])
            print(json.dumps({
                "bench": "elastic_recovery", "run": run, "workers": args.workers,
                "strategy": args.strategy, "oversubscribed": args.workers > (os.cpu_count() or 1),
                "recovery_s": relaunch["first_step_time"] - died,
                "launcher_noticed_s": noticed - died,
                "relaunch_to_first_step_s": relaunch["first_step_time"] - noticed,
                "resumed_step": relaunch["resumed_step"]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
