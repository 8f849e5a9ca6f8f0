"""A training job for the elastic tests and benchmark (run by `mpishard run` or mpirun).

Trains a small float64 MLP with ElasticOptimizer, checkpointing every --every
steps. Rank 0 appends one JSON line per launch to --events: the size, the step
it resumed from and the step it stopped at. Faults are injected on the first
launch only (MPISHARD_ELASTIC_RESTARTS unset or 0):

  --kill-at S        rank --kill-rank (a comma list: several at once) SIGKILLs
                     itself after step S
  --kill-in-save S   rank --kill-rank SIGKILLs itself as the checkpoint of step S begins
  --stop-at S        every rank asks to stop after step S (a planned resize)
  --slow-after-restart T   sleep T seconds per step on relaunches (test timing)
  --step-seconds T   sleep T seconds in every step (a step longer than mpirun's
                     SIGTERM-to-SIGKILL interval)
  --async-checkpoints   write the periodic checkpoints in the background (the
                     default here is synchronous: a kill then always finds the
                     checkpoint of the last --every step, which the tests assert)
  --exit-zero        a worker script written for 0.1: it never reads opt.exit_code
                     (nor stop_reason) and exits 0 whenever optimize() returns
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import mpishard  # noqa: F401  (thread limits before NumPy)

# isort: split
import numpy as np
from mpi4py import MPI

from mpishard import ShardingConfiguration
from mpishard.exitcodes import EXIT_STOPPED
from mpishard.nn import MLP
from mpishard.optim import Adam
from mpishard.strategies import ElasticOptimizer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--events", required=True)
    p.add_argument("--out")
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch", type=int, default=12)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--min-workers", type=int, default=1)
    p.add_argument("--max-workers", type=int, default=8)
    p.add_argument("--kill-at", type=int)
    p.add_argument("--kill-in-save", type=int)
    p.add_argument("--kill-rank", default="1")
    p.add_argument("--stop-at", type=int)
    p.add_argument("--slow-after-restart", type=float, default=0.0)
    p.add_argument("--step-seconds", type=float, default=0.0)
    p.add_argument("--exit-zero", action="store_true")
    p.add_argument("--async-checkpoints", action="store_true")
    args = p.parse_args()
    kill_ranks = {int(r) for r in args.kill_rank.split(",")}

    comm = MPI.COMM_WORLD
    first_launch = os.environ.get("MPISHARD_ELASTIC_RESTARTS", "0") == "0"
    rng = np.random.default_rng(1)
    x = rng.standard_normal((96, 5))
    y = np.argmax(x @ rng.standard_normal((5, 3)), axis=1)
    model = MLP([5, 16, 16, 3], activation="tanh", dtype=np.float64, seed=1)
    # ZeRO-2's "auto" reduce method is chosen by timing, and Reduce_scatter and
    # Allreduce may sum in different orders: pin it so runs compare bit for bit.
    pinned = {"reduce_method": "reduce_scatter"} if args.strategy in ("zero2", "zero3") else {}
    opt = ElasticOptimizer(Adam(lr=3e-3), ShardingConfiguration(comm), args.min_workers,
                           args.max_workers, strategy=args.strategy, checkpoint_dir=args.ckpt,
                           checkpoint_every=args.every,
                           async_checkpoints=args.async_checkpoints, **pinned)
    record = {"workers": comm.size, "restarts": int(os.environ.get("MPISHARD_ELASTIC_RESTARTS", 0))}

    if args.kill_in_save is not None and first_launch:
        save = opt.manager.save

        def dying_save(model, optimizer=None, **kw):
            if optimizer.step_count == args.kill_in_save and comm.rank in kill_ranks:
                os.kill(os.getpid(), signal.SIGKILL)
            return save(model, optimizer, **kw)

        opt.manager.save = dying_save

    def after_step(step: int, loss: float) -> None:
        if "first_step_time" not in record:
            record["first_step_time"] = time.time()
            record["resumed_step"] = step - 1
        if args.step_seconds:
            time.sleep(args.step_seconds)
        if first_launch and step == args.kill_at and comm.rank in kill_ranks:
            if comm.rank == min(kill_ranks):
                with open(args.events + ".death", "w") as f:
                    f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        if step == args.stop_at:
            opt.request_stop()
        if not first_launch and args.slow_after_restart:
            time.sleep(args.slow_after_restart)

    def write(extra: dict) -> None:
        if opt.config.world.rank == 0:   # the survivors' rank 0 after a lost rank
            with open(args.events, "a") as f:
                f.write(json.dumps({**record, **extra}) + "\n")

    opt.exit_on_signal = False
    result = opt.optimize(model, (x, y), epochs=args.epochs, batch_size=args.batch,
                          callback=after_step)
    if args.exit_zero:
        write({"final_step": opt.step_count, "stopped": result.stopped})
        with opt.gathered_parameters() as params:
            final = np.array(params)
        if opt.config.world.rank == 0 and args.out:
            np.save(args.out, final)
        return
    write({"final_step": opt.step_count, "stopped": result.stopped,
           "reason": opt.stop_reason, "resumed_from": opt.resumed_from,
           "recovery_seconds": opt.recovery_seconds, "recoveries": result.recoveries,
           "world_size": opt.config.world.size})
    code = EXIT_STOPPED if result.stopped else 0   # checkpointed, relaunch me
    with opt.gathered_parameters() as params:      # ZeRO-3: gathered (every rank)
        final = np.array(params)
    if not code and args.out and opt.config.world.rank == 0:
        np.save(args.out, final)
    if result.recoveries:   # lost a rank (ULFM): MPI_Finalize may wait for it forever
        from mpishard.comm import ulfm

        ulfm.exit_now(code)
    raise SystemExit(code)


if __name__ == "__main__":
    main()
