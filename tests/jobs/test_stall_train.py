"""A rank that stalls inside the training loop ends the job, naming the call and the group.

Each test starts its own ``mpirun -n 2`` (or ``-n 4``) job (plain ``pytest``, not under
``mpirun``) with ``ShardingConfiguration(timeout=2)``; one rank sleeps well past
the timeout at a chosen point, and the other waits for it in a collective.
Expected: the job ends within the timeout plus a few seconds of the stall (not
after the sleep), with a ``[mpishard] ... did not finish within 2 s`` line that names
the collective and the group from a rank that waited (exactly one with 2 ranks; at
4 ranks each waiting rank may report before the abort reaches it, once each), and
names the stalled rank (running, in no call of the library) with its Python stack.
"""

from __future__ import annotations

import re
import time

import pytest
from mpijobs import mpirun

# Timeouts of 2 s that every healthy rank must meet: run alone (scripts/test.sh).
pytestmark = [pytest.mark.launch, pytest.mark.timing]

TIMEOUT = 2.0
SLEEP = 30.0          # far past the timeout: a job that waited for it took > 30 s
GRACE = 10.0          # start-up of two Python ranks, and MPI_Abort

SETUP = f"""
import time
import numpy as np
from mpi4py import MPI
from mpishard import ShardingConfiguration
from mpishard.nn import MLP
from mpishard.optim import Adam
from mpishard.strategies import DDPOptimizer, ElasticOptimizer
from mpishard.train import StopRequest, evaluate

rank = MPI.COMM_WORLD.rank
rng = np.random.default_rng(0)
x = rng.standard_normal((64, 5))
y = np.argmax(x[:, :3], axis=1)
t0 = time.monotonic()

def stall():
    print("stalling at", time.time(), flush=True)
    time.sleep({SLEEP})

def stall_after(at):
    def callback(step, loss):
        if step == at and rank == 1:
            stall()
    return callback
"""

CASES = {
    # (a) before the per-step stop agreement of the loop: the other rank waits in it.
    "loop-stop-agreement": ("""
config = ShardingConfiguration(MPI.COMM_WORLD, timeout=2)
opt = DDPOptimizer(Adam(lr=1e-2), config)
with StopRequest() as stop:
    opt.optimize(MLP([5, 8, 3], seed=1), (x, y), epochs=2, batch_size=16,
                 callback=stall_after(3), stop=stop)
""", "Iallreduce", "training", "stop agreement"),
    # (a) the same inside ElasticOptimizer, which always agrees on a stop.
    "elastic-stop-agreement": ("""
config = ShardingConfiguration(MPI.COMM_WORLD, timeout=2)
opt = ElasticOptimizer(Adam(lr=1e-2), config, 1, 4, strategy="zero2", exit_on_signal=False)
opt.optimize(MLP([5, 8, 3], seed=1), (x, y), epochs=2, batch_size=16, callback=stall_after(2))
""", "Iallreduce", "training", "stop agreement"),
    # (b) inside the evaluation of a model whose forward is collective (tp=2).
    "evaluate-tensor-parallel": ("""
import functools
from mpishard.nn import ParallelMLP
from mpishard.strategies import HybridShardedModel
config = ShardingConfiguration(MPI.COMM_WORLD, tensor_parallel_size=2, timeout=2)
model = HybridShardedModel(functools.partial(ParallelMLP, [5, 8, 3], activation="tanh",
                                             dtype=np.float64, seed=4), config)
print("first", evaluate(model, x, y), flush=True)   # both ranks: it works
if rank == 1:
    stall()
evaluate(model, x, y)
""", "Iallreduce", "tensor-parallel", ""),
}


# Evaluation stalls one tensor group; at 4 ranks the other group would finish
# normally, so that case runs at 2 ranks only.
RUNS = [(case, n) for case in CASES for n in (2, 4) if n == 2 or "evaluate" not in case]


@pytest.mark.parametrize(("case", "n"), RUNS, ids=[f"{c}-{n}" for c, n in RUNS])
def test_a_stalled_rank_ends_the_job_naming_call_and_group(case, n):
    body, call, group, during = CASES[case]
    code, out, _ = mpirun(n, SETUP + body + "\nprint('unreachable', flush=True)\n",
                          timeout=SLEEP + 60, quiet=True)
    ended = time.time()
    assert code != 0, out
    assert "unreachable" not in out, out
    stalled = re.search(r"stalling at ([0-9.]+)", out)
    assert stalled, out
    assert ended - float(stalled.group(1)) < TIMEOUT + GRACE, (ended, out)
    lines = [line for line in out.splitlines() if "did not finish within" in line]
    ranks = [int(r) for line in lines for r in re.findall(r"\[mpishard\] world rank (\d+) ",
                                                          line)]
    assert len(ranks) == len(lines) == len(set(ranks)) >= 1, out
    assert 1 not in ranks, out                   # the stalled rank waits in no call
    assert n > 2 or len(lines) == 1, out
    for line in lines:
        assert line.startswith("[mpishard]"), lines
        assert re.search(rf"\b{call} over the {group} group\b", line), lines
        assert during in line, lines
        assert f"within {TIMEOUT:g} s" in line, lines
        # The stalled rank is named, and shown running but in no call. It sleeps (state
        # S), unless another waiting rank's signal has it writing its stack (R).
        assert re.search(r"did not arrive: world rank 1 \(pid \d+ on \S+\): is running "
                         r"\(state [SR]\) but is in no call of the library", line), lines
    # Its stack, from faulthandler: the sleep in the job's stall().
    assert re.search(r'File "<string>", line \d+ in stall', out), out
