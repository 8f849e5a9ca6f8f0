"""A lost node of a real (namespace) cluster with spares on another node (ULFM).

Runs in the fault-tolerant runtime (``.venv-ft``) on the 2-node cluster of
``scripts/cluster-local.sh`` (the ``cluster`` fixture of ``tests/support/nscluster.py``);
skips, saying why, where either is missing. Each job starts 6 ranks through
``prterun``'s ssh launcher, placed by node with node 1 given 2 slots: ranks 0, 2, 4,
5 on node 0 and 1, 3 on node 1; with ``spares=2`` the training ranks 0-3 sit two on
each node and the spares 4, 5 on node 0. A float64 MLP (DDP, Adam, 24 steps) is
trained with a pause of 50 ms after each step; the test watches the job's output
and, after step 10, takes node 1 away from outside:

* **every rank of node 1 killed** (SIGKILL, its ``prted`` left alive): the
  survivors notice (the node's daemon reports its children's exits), promote both
  spares and end at full size equal to the run that lost nothing in the same job
  (rtol 1e-12); the seconds from the kill to the survivors' first call into the
  recovery are printed (measured, not asserted);
* **node 1 down** (``cluster-local.sh down 1``: every process in it, its
  ``prted`` too): Open MPI 5.0's PRRTE (3.0) does not survive a lost daemon, it
  ends the whole job with its one message naming the node ("lost communication
  with a remote daemon", or "a daemon failed to report back" when the exit of the
  launcher that started it is seen first); the test checks that the job ends (no
  hang), with that message, and prints how long it took. ``prterun`` then exits
  0; under ``mpishard run --fault-tolerance ulfm`` the agent sees that no worker
  finished its training (their ``train-R.json`` notes are left) and fails with
  one line and exit 1.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time

import pytest
from mpijobs import mpi_env
from nscluster import HOSTS, cluster_local
from test_ulfm import MPIRUN, _ft_or_skip

pytestmark = pytest.mark.launch

SUBNET = "10.213.0.0/24"   # scripts/cluster-local.sh's
NODE1 = "mpishard-n1"      # its namespace

JOB = r"""
import json, os, socket, sys, time
import numpy as np
from mpi4py import MPI
from mpishard import ShardingConfiguration
from mpishard.comm import ulfm
from mpishard.nn import MLP
from mpishard.optim import Adam
from mpishard.recovery import policy
from mpishard.strategies import DDPOptimizer

REFERENCE = {reference}
rank = MPI.COMM_WORLD.rank
print(f"HOST {{rank}} {{socket.gethostname()}}", flush=True)
rng = np.random.default_rng(0)
ROWS, STEPS = 24, 24
X = rng.standard_normal((STEPS * ROWS, 5))
Y = rng.integers(0, 3, STEPS * ROWS)
real = policy.RecoveryPolicy.recover
def recover(self, exc):       # when this survivor noticed the loss
    print(f"NOTICED {{rank}} {{time.time():.6f}}", flush=True)
    return real(self, exc)
policy.RecoveryPolicy.recover = recover


def run(label):
    model = MLP([5, 16, 3], activation="tanh", dtype=np.float64, seed=1)
    config = ShardingConfiguration(timeout=60, fault_tolerance="ulfm", spares=2)
    opt = DDPOptimizer(Adam(lr=1e-2), config, model=model)
    def callback(step, loss):
        if opt.config.world.rank == 0:
            print(f"STEP {{label}} {{step}}", flush=True)
        time.sleep(0.05)
    result = opt.optimize(model, (X, Y), epochs=1, batch_size=ROWS, seed=3, callback=callback)
    return opt, model, result


ref = np.zeros(5 * 16 + 16 + 16 * 3 + 3)
if REFERENCE:
    opt, model, result = run("reference")
    if result.spare != "unused":
        ref[...] = model.params
    MPI.COMM_WORLD.Bcast(ref, root=0)
opt, model, result = run("watched")
if result.spare != "unused":
    close = bool(np.allclose(model.params, ref, rtol=1e-12, atol=0))
    every = opt.config.world.allgather((rank, result.spare, close))
    if opt.config.world.rank == 0:
        print("RESULT " + json.dumps({{"recoveries": result.recoveries, "ranks": every,
                                      "steps": opt.step_count,
                                      "world_size": opt.config.world.size}}), flush=True)
ulfm.exit_now(0)      # not MPI_Finalize: it may wait for the dead ranks (ompi#11404)
"""


@pytest.fixture(scope="module", autouse=True)
def fault_tolerant_runtime() -> None:
    """Skip before the cluster is started where this is not the ULFM runtime."""
    _ft_or_skip()


def _kill_ranks_of_node1() -> None:
    """SIGKILL every rank of the job in node 1 (its ``prted`` stays)."""
    pids = subprocess.run(["ip", "netns", "pids", NODE1], capture_output=True,
                          text=True).stdout.split()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"job.py" not in f.read():
                    continue
            subprocess.run(["kill", "-9", pid], check=False)
        except OSError:
            pass


def _watched_job(cluster, tmp_path, take_node_away, *, reference: bool, timeout: float = 150,
                 under_agent: bool = False):
    """Run the job (``under_agent``: through ``mpishard run --fault-tolerance ulfm
    --spares 2 --max-restarts 0``), call ``take_node_away()`` after step 10 of the
    watched run; ``(output, return code, time.time() of the loss, seconds from it to
    the end)``."""
    script = tmp_path / "job.py"
    script.write_text(JOB.format(reference=reference))
    agent = re.search(r"plm_rsh_agent (\S+)", cluster["MPISHARD_CLUSTER_MPIRUN_FLAGS"]).group(1)
    flags = ["--host", f"{HOSTS[0]}:4,{HOSTS[1]}:2",
             "--prtemca", "plm_ssh_agent", agent, "--prtemca", "plm_ssh_no_tree_spawn", "1",
             "--prtemca", "oob_tcp_if_include", SUBNET, "--mca", "btl_tcp_if_include",
             SUBNET, "--mca", "btl", "tcp,sm,self", "--map-by", "node"]
    worker = [sys.executable, str(script)]
    if under_agent:   # mpirun --with-ft ulfm --mca coll ^han -n 6 FLAGS (the agent's)
        launch = [sys.executable, "-m", "mpishard", "run", "--fault-tolerance", "ulfm",
                  "--spares", "2", "--workers", "6", "--min-workers", "3", "--max-restarts", "0",
                  f"--launcher-args={shlex.join(flags)}", "--", *worker]
    else:
        launch = [str(MPIRUN), "--with-ft", "ulfm", "--mca", "coll", "^han", *flags,
                  "-n", "6", *worker]
    command = [*cluster["MPISHARD_CLUSTER_EXEC"].split(), *launch]
    env = mpi_env({"PATH": f"{MPIRUN.parent}:{mpi_env()['PATH']}"})   # prted on each node
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, start_new_session=True)
    lines, lost, started = [], None, time.time()
    try:
        for line in proc.stdout:
            lines.append(line)
            if lost is None and line.startswith("STEP watched 10"):
                lost = time.time()
                take_node_away()
            if time.time() - started > timeout:
                break
        proc.wait(timeout=max(1.0, timeout - (time.time() - started)))
    except subprocess.TimeoutExpired:
        pass
    finally:
        if proc.poll() is None:
            subprocess.run(["kill", "-9", f"-{proc.pid}"], check=False)   # its session
            proc.wait()
            lines.append(f"KILLED after {timeout:g} s\n")
    ended = time.time()
    return "".join(lines), proc.returncode, lost, ended - (lost or ended)


def test_every_rank_of_a_node_killed_spares_on_the_other_node_take_their_places(
        cluster, tmp_path):
    out, code, lost, _ = _watched_job(cluster, tmp_path, _kill_ranks_of_node1, reference=True)
    match = re.search(r"^RESULT (.*)$", out, re.MULTILINE)
    assert match and lost is not None, out
    assert "Traceback" not in out, out
    hosts = dict(re.findall(r"^HOST (\d) (\S+)$", out, re.MULTILINE))
    assert hosts == {"0": HOSTS[0], "1": HOSTS[1], "2": HOSTS[0], "3": HOSTS[1],
                     "4": HOSTS[0], "5": HOSTS[0]}, out
    result = json.loads(match.group(1))
    [rec] = result["recoveries"]
    assert rec["from"] == "spares" and rec["lost_ranks"] == [1, 3], rec
    assert rec["promoted"] == [4, 5] and rec["world_size"] == 4 and rec["step"] == 10, rec
    assert result["world_size"] == 4 and result["steps"] == 24, result
    assert sorted(r for r, _, _ in result["ranks"]) == [0, 2, 4, 5], result
    assert all(close for _, _, close in result["ranks"]), result
    noticed = [float(t) for t in re.findall(r"^NOTICED \d+ (\S+)$", out, re.MULTILINE)]
    print(f"every rank of {HOSTS[1]} killed: noticed after {min(noticed) - lost:.3f} s to "
          f"{max(noticed) - lost:.3f} s (a 50 ms pause after each step), recovery "
          f"{rec['seconds']:.3f} s, {rec['sent_bytes']} bytes to the newcomers")
    assert code in (0, None), out


def test_a_node_down_with_its_daemon_ends_the_job_with_prrtes_message(cluster, tmp_path):
    try:
        out, code, lost, seconds = _watched_job(
            cluster, tmp_path, lambda: cluster_local("down", "1"), reference=False,
            timeout=120)
    finally:
        cluster_local("up", "1")
    assert lost is not None, out
    assert "KILLED after" not in out, out         # it ended by itself: no hang
    assert "RESULT" not in out, out
    # PRRTE's message, whichever of its paths noticed first: the daemon's TCP
    # connection, or the exit of the launcher that started it (the rsh agent).
    lost_daemon = re.search(rf"PRTE has lost communication with a remote daemon\..*"
                            rf"Remote daemon: \S+ on node {HOSTS[1]}", out, re.DOTALL)
    launcher = re.search(rf"A daemon failed to report back after being spawned\..*"
                         rf"Remote host: +{HOSTS[1]}", out, re.DOTALL)
    assert lost_daemon or launcher, out
    print(f"{HOSTS[1]} down (daemon too): the job ended {seconds:.2f} s later, exit {code}")


def test_a_node_down_under_mpishard_run_fails_with_one_line(cluster, tmp_path):
    # The same loss under `mpishard run`: PRRTE still ends the job and exits 0,
    # but no worker finished its training (each one's train-R.json note is left
    # in the launch folder): the agent takes it as a failure, and with no
    # restart allowed ends with one line and exit 1 (it exited 0 before).
    try:
        out, code, lost, seconds = _watched_job(
            cluster, tmp_path, lambda: cluster_local("down", "1"), reference=False,
            timeout=120, under_agent=True)
    finally:
        cluster_local("up", "1")
    assert lost is not None and "KILLED after" not in out, out
    assert "RESULT" not in out, out
    assert code == 1, out
    lines = [line for line in out.splitlines() if line.startswith("mpishard run:")]
    assert len(lines) == 1 and lines[0].startswith(
        "mpishard run: a worker failed (the launcher exited 0, but no worker finished its "
        "training: a lost node ends an Open MPI 5.0 job) and the 0 restart(s) allowed are "
        "used up"), out
    print(f"{HOSTS[1]} down under mpishard run: ended {seconds:.2f} s later, exit {code}")
