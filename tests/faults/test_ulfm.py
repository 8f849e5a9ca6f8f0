"""In-place recovery with ULFM: a rank SIGKILLed, the survivors shrink and finish.

Runs only in the fault-tolerant runtime (``bash scripts/setup.sh --ft`` makes
``.venv-ft``: Open MPI 5 with ULFM; ``scripts/test.sh`` runs this file there with
that environment's pytest); elsewhere every test skips, saying why. Each test
starts its own ``mpirun --with-ft ulfm -n 3`` job (plain pytest, no ``--with-mpi``).

The job trains a float64 MLP with DDP (Adam) on a fixed global batch of 24 rows per
step, re-split over whoever is there. Rank 1 SIGKILLs itself at step 4, either
between steps or inside the backward (the survivors then wait in the gradient
reduction), or SIGSTOPs itself there: the survivors, with ``evict_stuck``, SIGKILL
it at the timeout. The survivors catch the failure (``mpi4py.MPI.Exception``,
``ERR_PROC_FAILED``/``ERR_REVOKED``) and call
:func:`mpishard.recovery.recover_in_place`: revoke, shrink, agree on the
last completed step (:func:`mpishard.comm.ulfm.recover`), a new
``ShardingConfiguration`` and ``DDPOptimizer`` over the survivors carrying over
parameters, optimizer state and step count from the survivor that completed the
newest step; then they train on from that step. The reference, computed earlier in the same job: the
same training on all 3 ranks to step 4, then on ranks {0, 2} only (a communicator
that drops rank 1 on purpose). Final parameters must agree to float64 rtol 1e-12
(and with a single process on the global batch to 1e-10).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from mpijobs import mpi_env

pytestmark = pytest.mark.launch

MPIRUN = Path(sys.executable).parent / "mpirun"

JOB = r"""
import json, os, signal, sys, time
import numpy as np
from mpi4py import MPI
from mpishard import ShardingConfiguration
from mpishard.comm import ulfm
from mpishard.data import rank_rows
from mpishard.nn import MLP
from mpishard.optim import Adam
from mpishard.parallel import DDPCore
from mpishard.recovery import recover_in_place

ok, why = ulfm.available()
assert ok, why
STEPS, KILL_AT, VICTIM, WHERE = 10, 4, 1, {where!r}
ROWS = 24
rank = MPI.COMM_WORLD.rank
rng = np.random.default_rng(0)
X = rng.standard_normal((STEPS, ROWS, 5))
Y = rng.integers(0, 3, (STEPS, ROWS))


def config_over(comm):
    # Errors return instead of ending the job (fault_tolerance="auto" would do too).
    config = ShardingConfiguration(comm, timeout={timeout}, fault_tolerance="ulfm",
                                   evict_stuck=WHERE == "sigstop")
    assert config.groups.dp.evict_stuck == (WHERE == "sigstop")
    return config


def step(ddp, s):
    lo, hi = rank_rows(ROWS, ddp.dp.size, ddp.dp.rank)
    return ddp.train_step(X[s][lo:hi], Y[s][lo:hi])


def fresh():
    return MLP([5, 16, 3], activation="tanh", dtype=np.float64, seed=1)


# --- the references: one process on the global batch; 3 ranks, then {{0, 2}} ---
serial = fresh()
one = DDPCore(Adam(lr=1e-2), ShardingConfiguration(MPI.COMM_SELF), model=serial)
for s in range(STEPS):
    one.train_step(X[s], Y[s])
ref = fresh()
ref_ddp = DDPCore(Adam(lr=1e-2), config_over(MPI.COMM_WORLD), model=ref)
for s in range(KILL_AT):
    step(ref_ddp, s)
two = MPI.COMM_WORLD.Split(MPI.UNDEFINED if rank == VICTIM else 0, rank)
if rank != VICTIM:
    ddp2 = DDPCore(ref_ddp.optimizer, config_over(two), model=ref)
    for k, v in ref_ddp.state.items():
        ddp2.state[k][...] = v
    ddp2.step_count = ref_ddp.step_count
    for s in range(KILL_AT, STEPS):
        step(ddp2, s)
MPI.COMM_WORLD.Barrier()

# --- the run that loses rank 1 ---
model = fresh()
config = config_over(MPI.COMM_WORLD)
ddp = DDPCore(Adam(lr=1e-2), config, model=model)
if rank == VICTIM and WHERE == "backward":
    real = model.forward_backward
    def dying(*a, **k):
        if ddp.step_count == KILL_AT:
            real(*a, **k)                      # the forward and backward, then death
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*a, **k)
    model.forward_backward = dying
recoveries = []
s = 0
while s < STEPS:
    try:
        if rank == VICTIM and WHERE == "between" and s == KILL_AT:
            print(f"KILL {{time.time():.6f}}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if rank == VICTIM and WHERE == "backward" and s == KILL_AT:
            print(f"KILL {{time.time():.6f}}", flush=True)
        if rank == VICTIM and WHERE == "sigstop" and s == KILL_AT:
            print(f"KILL {{time.time():.6f}}", flush=True)   # stopped: evicted at the timeout
            os.kill(os.getpid(), signal.SIGSTOP)
        step(ddp, s)
        s += 1
        if recoveries and "next_step" not in recoveries[-1]:
            recoveries[-1]["next_step"] = time.time()
    except MPI.Exception as exc:
        # Revoke, shrink, agree on the last completed step, rebuild DDP over the survivors.
        ddp, event = recover_in_place(ddp, exc)
        s = ddp.step_count
        recoveries.append(event.record())   # the typed Recovered, as the metrics record
if rank == 0:
    print("RESULT " + json.dumps({{
        "recoveries": recoveries,
        "vs_reference": float(np.max(np.abs(model.params - ref.params) / np.abs(ref.params))),
        "vs_serial": float(np.max(np.abs(model.params - serial.params) / np.abs(serial.params))),
        "allclose_reference": bool(np.allclose(model.params, ref.params, rtol=1e-12, atol=0)),
        "allclose_serial": bool(np.allclose(model.params, serial.params, rtol=1e-10, atol=0)),
        "steps": ddp.step_count}}), flush=True)
ulfm.leave(0)      # not MPI_Finalize: it may wait for the dead rank (ompi#11404)
"""


def _ft_or_skip() -> None:
    if not MPIRUN.exists():
        pytest.skip(f"no mpirun beside {sys.executable}: run in the fault-tolerant runtime "
                    f"(bash scripts/setup.sh --ft; .venv-ft/bin/python -m pytest "
                    f"tests/faults)")
    probe = subprocess.run([sys.executable, "-c", "from mpi4py import MPI; "
                            "print(hasattr(MPI.Comm, 'Shrink'), MPI.Get_library_version())"],
                           capture_output=True, text=True, timeout=60)
    if not probe.stdout.startswith("True Open MPI v5"):
        pytest.skip(f"this environment's MPI has no ULFM: {probe.stdout.strip()[:80]}"
                    f"{probe.stderr.strip()[-200:]}")


def ulfm_job(n: int, code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``mpirun --with-ft ulfm --mca coll ^han -n N python -c code`` with this
    environment's Open MPI (without the han collectives, as the README says)."""
    cmd = [str(MPIRUN), "--with-ft", "ulfm", "--mca", "coll", "^han", "--oversubscribe", "-n",
           str(n), sys.executable, "-c", code]
    # A session of its own: past the timeout the whole job (mpirun, ranks) is killed.
    proc = subprocess.Popen(cmd, env=mpi_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        if not re.search(r"^RESULT ", out, re.MULTILINE):
            pytest.fail(f"mpirun --with-ft ulfm -n {n} did not finish within {timeout:g} s:"
                        f"\n{out}")
        # The job had finished its work: the survivors hang in MPI_Finalize, a known
        # Open MPI ULFM problem (PMIx fence waiting for the dead rank; open-mpi/ompi
        # #11404, #9434), seen here in about 1 of 10 jobs on a loaded machine.
        warnings.warn(f"the survivors hung in MPI_Finalize after their work (killed "
                      f"after {timeout:g} s): Open MPI ULFM, open-mpi/ompi#11404", stacklevel=2)
        return subprocess.CompletedProcess(cmd, None, out)
    return subprocess.CompletedProcess(cmd, proc.returncode, out)


@pytest.mark.parametrize("where", ["between", "backward", "sigstop"])
def test_survivors_shrink_and_finish_as_a_reference_that_drops_the_rank(where):
    # "sigstop": rank 1 stops itself (alive, no progress); with evict_stuck the
    # survivors SIGKILL it at the timeout (3 s) and recover as from a death.
    _ft_or_skip()
    timeout = 3 if where == "sigstop" else 60
    job = ulfm_job(3, JOB.format(where=where, timeout=timeout))
    out = job.stdout
    match = re.search(r"^RESULT (.*)$", out, re.MULTILINE)
    assert match, out
    result = json.loads(match.group(1))
    assert result["steps"] == 10, result
    [rec] = result["recoveries"]
    assert rec["event"] == "recovered", rec
    assert rec["lost_ranks"] == [1] and rec["world_size"] == 2, rec
    assert rec["step"] == 4 and rec["survivor_steps"] == [4, 4], rec   # no step lost
    assert re.search(r"PROC_FAILED|REVOKED|[Pp]rocess [Ff]ailure|revoked", rec["error"]), rec
    assert result["allclose_reference"], result
    assert result["allclose_serial"], result
    # The job itself ends normally: mpirun exits 0 although a rank was lost (None: the
    # survivors hung in MPI_Finalize after their work, see ulfm_job).
    assert job.returncode in (0, None), out
    assert "Traceback" not in out, out
    killed = float(re.search(r"^KILL (\d+\.\d+)", out, re.MULTILINE).group(1))
    print(f"recovery: kill -> next completed step {rec['next_step'] - killed:.3f} s, "
          f"shrink+agree {rec['shrink_seconds']:.3f} s")
    assert rec["next_step"] - killed < (timeout + 5.0 if where == "sigstop" else 5.0), rec
    if where == "sigstop":
        assert re.search(r"did not finish within 3 s \(timeout=3: a wait for the other ranks "
                         r"of the group\); world rank 1 \(pid \d+ on \S+\): evicted "
                         r"\(SIGKILL; it was in state T\)", out), out


def test_sigstopped_rank_is_named_in_the_fault_tolerant_runtime():
    # The stuck-rank diagnosis of tests/jobs/test_stall_stuck.py under Open MPI 5 with
    # ULFM: a stopped rank is alive, so no failure is reported; the timeout names it.
    _ft_or_skip()
    import socket

    from stuckjob import HOW, TIMEOUT
    from stuckjob import JOB as STUCK_JOB

    job = ulfm_job(3, STUCK_JOB.format(timeout=TIMEOUT, stuck=2, how=HOW["sigstop"]),
                   timeout=90)
    out = job.stdout
    assert job.returncode != 0, out
    assert "unreachable" not in out, out
    pid = re.search(r"^PID 2 (\d+)", out, re.MULTILINE).group(1)
    lines = [line for line in out.splitlines() if "did not finish within" in line]
    assert lines, out
    for line in lines:
        assert re.search(r"Iallreduce over the data-parallel group \(size 3\)", line), line
        assert (f"did not arrive: world rank 2 (pid {pid} on {socket.gethostname()}): is "
                f"stopped (/proc/{pid}/stat state T") in line, line


def test_fault_tolerance_option_is_checked_on_every_rank():
    # Here (plain pytest, not under `mpirun --with-ft ulfm`) ULFM is never available:
    # "ulfm" is an error saying why, "auto" is off.
    from mpi4py import MPI

    from mpishard import ShardingConfiguration
    from mpishard.comm import ulfm
    from mpishard.errors import MpiShardError

    ok, why = ulfm.available()
    assert not ok and why, why
    with pytest.raises(MpiShardError, match=re.escape(f"fault_tolerance='ulfm' but {why}")):
        ShardingConfiguration(MPI.COMM_SELF, fault_tolerance="ulfm")
    with pytest.raises(ValueError, match="fault_tolerance must be one of auto, ulfm, off, "
                                         "got 'on'"):
        ShardingConfiguration(MPI.COMM_SELF, fault_tolerance="on")
    config = ShardingConfiguration(MPI.COMM_SELF, evict_stuck=True)
    assert ulfm.wanted("auto", config.world) is False
    assert config.groups.dp.evict_stuck is False      # only where ULFM is on
    config.free()
