"""A rank that is alive but makes no progress is *named* within the timeout.

Each test starts its own ``mpirun`` job (plain pytest) with
``ShardingConfiguration(timeout=2)``. One rank gets stuck after a step that works:
SIGSTOP from the job itself (at 2 and 4 ranks), or an endless loop in user code. The
ranks that wait for it must end the job within the timeout plus a grace, with a
message that names the call they wait in, the group, and the stuck rank by world
rank, pid and host, with its state: "is stopped (... state T ...)" for SIGSTOP (a
stopped process cannot dump its stack), for the loop its Python stack, which
must show the looping function of the job's code (``spin``), and for a deadlock
(the two ranks in different collectives) the call the other rank waits in.
"""

from __future__ import annotations

import re
import socket
import time

import pytest
from mpijobs import mpirun
from stuckjob import HOW, JOB, TIMEOUT

# Timeouts of 2 s that every healthy rank must meet: run alone (scripts/test.sh).
pytestmark = [pytest.mark.launch, pytest.mark.timing]

GRACE = 12.0        # start-up, the diagnosis (at most 1 s for a stack), MPI_Abort


def _run(n: int, stuck: int, how: str):
    code = JOB.format(timeout=TIMEOUT, stuck=stuck, how=HOW[how])
    job = mpirun(n, code, timeout=90, quiet=True)
    ended = time.time()
    out = job.output
    assert job.returncode != 0, out
    assert "unreachable" not in out, out
    started = float(re.search(r"STUCK (\d+\.\d+)", out).group(1))
    assert ended - started < TIMEOUT + GRACE, f"took {ended - started:.1f} s:\n{out}"
    pids = dict(re.findall(r"PID (\d+) (\d+)", out))
    lines = [line for line in out.splitlines() if "did not finish within" in line]
    assert lines, out
    return out, lines, pids[str(stuck)]


@pytest.mark.parametrize("n", [2, 4])
def test_sigstopped_rank_is_named_as_stopped(n):
    stuck = n - 1
    out, lines, pid = _run(n, stuck, "sigstop")
    host = socket.gethostname()
    for line in lines:
        waiter = int(re.search(r"\[mpishard\] world rank (\d+) ", line).group(1))
        assert waiter != stuck, line
        # The call the others wait in: the gradient Allreduce of DDP's step.
        assert re.search(r"I?allreduce over the data-parallel group \(size \d\)", line,
                         re.IGNORECASE), line
        assert (f"did not arrive: world rank {stuck} (pid {pid} on {host}): is stopped "
                f"(/proc/{pid}/stat state T") in line, line
        assert "cannot show its stack" in line, line
    # Only the stuck rank is named: the others arrived.
    named = {int(r) for line in lines for r in re.findall(r"did not arrive: world rank (\d+)",
                                                          line)}
    assert named == {stuck}, out


def test_endless_loop_is_named_with_its_stack():
    out, lines, pid = _run(2, 1, "loop")
    host = socket.gethostname()
    assert len(lines) == 1, out
    line = lines[0]
    assert line.startswith("[mpishard] world rank 0 "), line
    assert (f"did not arrive: world rank 1 (pid {pid} on {host}): is running (state R) but "
            "is in no call of the library") in line, line
    stack = out[out.index("[mpishard] Python stack of world rank 1"):]
    # faulthandler's dump: the loop's frame, called from the job's module level.
    assert re.search(r'File "<string>", line \d+ in spin', stack), out
    assert re.search(r'File "<string>", line \d+ in <module>', stack), out


def test_deadlock_names_the_call_the_other_rank_waits_in():
    out, lines, pid = _run(2, 1, "deadlock")
    host = socket.gethostname()
    # Both ranks time out; whichever reports first names the other's call.
    calls = {0: "Iallreduce over the data-parallel group (size 2)",
             1: "Ibarrier over the training group (size 2)"}
    for line in lines:
        waiter = int(re.search(r"\[mpishard\] world rank (\d+) ", line).group(1))
        other = 1 - waiter
        assert f"{calls[waiter]} did not finish" in line, line
        theirs = re.escape(calls[other])
        assert re.search(rf"did not arrive: world rank {other} \(pid \d+ on {host}\): is "
                         rf"running \(state [SR]\) but waits in {theirs}", line), line
