"""A configuration built on ``MPI.COMM_WORLD`` by only some of its ranks (issue 34,
item 10): the trainers forgot ``comm=``, world rank 0 simulates and never calls it.

MPI cannot withdraw a collective, so the trainers' arrival ``Iallreduce`` stays
pending on ``MPI.COMM_WORLD``. Their ``CommunicationError`` must say so: in what
state the communicator is (pending, completed only by the missing ranks' own call),
and what the program may still do with it (point-to-point messages, then end the
job with ``Abort``; no collective on it). The job does that and must end.
"""

from __future__ import annotations

import pytest
from mpijobs import mpirun

# A timeout of 1 s that the ranks that call must meet: run alone (scripts/test.sh).
pytestmark = [pytest.mark.launch, pytest.mark.timing]

JOB = """
import time
from mpi4py import MPI
from mpishard import CommunicationError, ShardingConfiguration

world = MPI.COMM_WORLD
if world.rank == 0:              # the simulation: never builds a configuration
    statuses = [world.recv(source=r, tag=7) for r in range(1, world.size)]
    print("SIM heard", statuses, flush=True)
    world.Abort(3)               # what the message says to do: end the job
else:
    try:
        ShardingConfiguration(timeout=1, abort_on_exception=False)  # comm= forgotten
        status = "trained"
    except CommunicationError as exc:
        print(f"MESSAGE {{world.rank}}: {{exc}}", flush=True)
        status = "failed"
    world.send(status, dest=0, tag=7)    # point-to-point still pairs up
    time.sleep(60)                       # until the abort
"""


@pytest.mark.parametrize("n", [2, 3])
def test_partial_configuration_says_what_the_world_is_worth(n):
    job = mpirun(n, JOB.format(), timeout=60, quiet=True)
    out = job.output
    assert job.returncode != 0, out            # ended by the abort, not hanging
    assert "SIM heard " + str(["failed"] * (n - 1)) in out, out
    messages = [line for line in out.splitlines() if line.startswith("MESSAGE")]
    assert len(messages) == n - 1, out
    for line in messages:
        assert "did not finish within 1 s" in line, line
        assert "stays pending on MPI.COMM_WORLD" in line, line
        assert "their own ShardingConfiguration() call completes it" in line, line
        assert "no rank may call a collective on MPI.COMM_WORLD" in line, line
        assert "point-to-point" in line and "Abort" in line, line
