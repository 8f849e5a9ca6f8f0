"""The job of a rank that is alive but makes no progress (``tests/jobs/test_stall_stuck.py``,
and across nodes in ``tests/cluster/test_cluster.py``).

``JOB.format(timeout=T, stuck=R, how=HOW[kind])``: every rank trains a step with
``ShardingConfiguration(timeout=T)``, prints ``PID rank pid``; rank ``R`` then
prints ``STUCK time`` and gets stuck (``HOW``: SIGSTOP, an endless loop in user
code, or a deadlock), the others wait in the next step.
"""

__all__ = ["HOW", "JOB", "TIMEOUT"]

#: The timeout (seconds) of the single-node tests' jobs.
TIMEOUT = 2.0

JOB = """
import os, signal, time
import numpy as np
from mpi4py import MPI
from mpishard import ShardingConfiguration
from mpishard.nn import MLP
from mpishard.optim import Adam
from mpishard.parallel import DDPCore

config = ShardingConfiguration(timeout={timeout})
rank = MPI.COMM_WORLD.rank
model = MLP([5, 7, 3], seed=1, dtype=np.float64)
ddp = DDPCore(Adam(lr=1e-3), config, model=model)
rng = np.random.default_rng(0)
x, y = rng.standard_normal((8, 5)), rng.integers(0, 3, 8)
ddp.train_step(x, y)                       # a step that works, first
config.world.barrier()
print(f"PID {{rank}} {{os.getpid()}}", flush=True)

def spin():
    while True:                            # the user's endless loop
        pass

if rank == {stuck}:
    print(f"STUCK {{time.time():.3f}}", flush=True)
    {how}
ddp.train_step(x, y)
print("unreachable", flush=True)
"""

HOW = {"sigstop": "os.kill(os.getpid(), signal.SIGSTOP)", "loop": "spin()",
       # A deadlock: this rank waits in a barrier over the training group while the
       # other waits in the step's Allreduce over the data-parallel group.
       "deadlock": "config.world.barrier()"}
