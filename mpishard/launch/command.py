"""``mpishard run``: the command line of the elastic agent."""

from __future__ import annotations

import argparse
import shlex
import sys

from .agent import ElasticAgent, ElasticFailure
from .slots import SlotSource

__all__ = ["add_run_parser"]


def add_run_parser(sub: argparse._SubParsersAction) -> None:
    run = sub.add_parser(
        "run", help="keep a training job alive as workers fail and slots change",
        description="Start the workers with mpirun (srun inside Slurm), relaunch them at a "
                    "new size when one dies or the slots change; they resume from the "
                    "newest checkpoint. Example: mpishard run --min-workers 2 --max-workers 4 "
                    "--slots-file slots -- python train.py. Exit status: 0 when the "
                    "workers finish; 75 when SIGTERM/SIGINT (preemption) stopped them after "
                    "a checkpoint; 1 when the job cannot go on (too few workers, no "
                    "restarts left); 2 for bad arguments. min/max workers reach the "
                    "workers' ElasticOptimizer through MPISHARD_ELASTIC_MIN_WORKERS/_MAX_WORKERS.")
    run.add_argument("--min-workers", type=int, default=1)
    run.add_argument("--max-workers", type=int, default=1024)
    source = run.add_mutually_exclusive_group()
    source.add_argument("--workers", type=int, help="a fixed number of slots")
    source.add_argument("--slots-file", help="a file holding the number of slots; rewrite "
                                             "it to grow or shrink the job")
    source.add_argument("--hostfile", help="an Open MPI hostfile (slots= summed), re-read "
                                           "when it changes")
    run.add_argument("--max-restarts", type=int, default=3,
                     help="relaunches after failures (default 3)")
    run.add_argument("--launcher", default="auto", choices=("auto", "mpirun", "srun"))
    run.add_argument("--launcher-args", default="",
                     help='extra launcher arguments, e.g. --launcher-args=--oversubscribe')
    run.add_argument("--checkpoint-dir", help="the workers' checkpoint folder (named when "
                                              "the job has to stop)")
    run.add_argument("--log", help="append one JSON line per event to this file")
    run.add_argument("--fault-tolerance", default="off", choices=("off", "ulfm"),
                     help="ulfm: mpirun --with-ft ulfm (Open MPI 5); a dead worker does not "
                          "end the job, the survivors go on in place; relaunch only when they "
                          "exit 75 (default off: relaunch on every death)")
    run.add_argument("--spares", type=int, default=0,
                     help="with --fault-tolerance ulfm: the last N ranks of each launch are "
                          "spare ranks (MPISHARD_SPARES=N for the workers' "
                          "ShardingConfiguration), promoted in place when a worker dies")
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- the worker command")
    run.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    launcher_args = shlex.split(args.launcher_args)
    if args.hostfile:
        launcher_args += ["--hostfile", args.hostfile]
    try:
        agent = ElasticAgent(
            command, min_workers=args.min_workers, max_workers=args.max_workers,
            slots=SlotSource(slots_file=args.slots_file, hostfile=args.hostfile,
                             fixed=args.workers),
            max_restarts=args.max_restarts, launcher=args.launcher,
            launcher_args=launcher_args, checkpoint_dir=args.checkpoint_dir, log=args.log,
            fault_tolerance=args.fault_tolerance, spares=args.spares)
        return agent.run()
    except ValueError as exc:
        print(f"mpishard run: error: {exc}", file=sys.stderr)
        return 2
    except ElasticFailure as exc:
        print(f"mpishard run: {exc}", file=sys.stderr)
        return 1
