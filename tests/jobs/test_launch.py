"""Whole jobs started with their own ``mpirun``: failures must end the job.

These run without ``--with-mpi``: plain pytest starts each job with the ``mpirun``
fixture (``tests/support/mpijobs.py``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from elastic import WORKER, run_reference
from mpijobs import mpi_env, mpirun_command

from mpishard.exitcodes import EXIT_STOPPED

pytestmark = pytest.mark.launch


def test_uncaught_exception_on_one_rank_aborts_the_job(mpirun):
    code, out, seconds = mpirun(3, """
        from mpi4py import MPI
        import numpy as np
        from mpishard import ShardingConfiguration
        config = ShardingConfiguration(MPI.COMM_WORLD)
        if MPI.COMM_WORLD.rank == 1:
            raise RuntimeError("boom on rank one")
        MPI.COMM_WORLD.Barrier()   # the others would wait here forever
        print("unreachable")
    """)
    assert code != 0
    # One report, from the rank that failed, naming it in the world and in its group.
    reports = re.findall(r"\[mpishard\] world rank (\d+) on \S+ \(rank (\d+) of the training "
                         r"group\): uncaught RuntimeError: boom on rank one; MPI_Abort ends all "
                         r"3 processes of MPI.COMM_WORLD .*; aborting the job", out)
    assert reports == [("1", "1")], out
    assert "RuntimeError: boom on rank one" in out
    assert "unreachable" not in out
    assert seconds < 100


@pytest.mark.timing      # ShardingConfiguration(timeout=2.0): both ranks arrive in time
def test_collective_timeout_names_the_collective_and_group(mpirun):
    code, out, _ = mpirun(2, """
        from mpi4py import MPI
        import numpy as np
        from mpishard import ShardingConfiguration
        from mpishard.comm import FlatComm
        config = ShardingConfiguration(MPI.COMM_WORLD, timeout=2.0)
        dp = config.groups.dp
        if MPI.COMM_WORLD.rank == 0:
            dp.Allreduce(np.ones(4))   # rank 1 never joins
        else:
            import time; time.sleep(60)
    """)
    assert code != 0
    assert "Iallreduce over the data-parallel group (size 2) did not finish within 2 s" in out


def test_info_command(mpirun):
    code, out, _ = mpirun(2, """
        from mpishard.cli import main
        main(["info"])
    """)
    assert code == 0, out
    assert "Open MPI" in out and "world_size" in out and "h5py_mpi" in out
    assert "cuda_aware_mpi" in out
    assert out.count("world_size") == 1   # rank 0 prints
    assert re.search(r"^world_size\s+2$", out, re.MULTILINE), out
    # What MPI granted (mpi4py asks for "multiple"; Open MPI 4.1 grants it).
    assert re.search(r"^mpi_thread_level\s+(single|funneled|serialized|multiple)$", out,
                     re.MULTILINE), out


def test_mpirun_helper_sets_mpienv_and_kills_a_hung_job(mpirun, monkeypatch):
    # The job sees scripts/mpienv.sh's settings, the extra variables, and not the
    # variables of an enclosing job (as when pytest itself runs under mpirun).
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "7")
    monkeypatch.setenv("MPISHARD_TEST_GONE", "1")
    code, out, _ = mpirun(2, """
        import os
        from mpi4py import MPI
        seen = (MPI.COMM_WORLD.size, os.environ["OMPI_MCA_mpi_yield_when_idle"],
                os.environ["MPISHARD_TEST_EXTRA"], "MPISHARD_TEST_GONE" in os.environ)
        rows = MPI.COMM_WORLD.gather(seen, root=0)
        if MPI.COMM_WORLD.rank == 0:
            print("SEEN", rows)
    """, env={"MPISHARD_TEST_EXTRA": "x", "MPISHARD_TEST_GONE": None})
    assert code == 0, out
    yield_when_idle = os.environ.get("OMPI_MCA_mpi_yield_when_idle", "1")   # mpienv.sh's default
    assert f"SEEN {[(2, yield_when_idle, 'x', False)] * 2}" in out, out
    # A job that outlives its timeout is killed with its ranks, and the test fails.
    marker = f"mpishard-hung-{os.getpid()}"
    with pytest.raises(pytest.fail.Exception, match="did not finish within 3 s"):
        mpirun(2, ["-c", "import sys, time; time.sleep(120)", marker], timeout=3)
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True)
    assert left.stdout == "", f"ranks left running: {left.stdout}"


# --------------------------------------------------------------------------- the agent
# `mpishard run` over real mpirun jobs of tests/support/elastic_worker.py (a float64 MLP with
# ElasticOptimizer, checkpointing every 4 steps), with real SIGKILL and SIGTERM; each
# result is compared bit for bit with a reference that makes the same size changes at
# the same steps on purpose (plain mpirun runs that stop there and resume).


def _events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _agent(tmp: Path, worker_args: list[str], *, slots: str = "4", min_workers: int = 1,
           max_workers: int = 4, during=None, timeout: float = 150):
    """Run the agent (a slots file holding ``slots``) until it exits; ``during(proc)`` is
    called every 20 ms while it runs. Returns (exit status, output, agent log events)."""
    (tmp / "slots").write_text(slots)
    log = tmp / "agent.log"
    cmd = [sys.executable, "-m", "mpishard", "run", f"--min-workers={min_workers}",
           f"--max-workers={max_workers}", f"--slots-file={tmp / 'slots'}",
           "--launcher=mpirun", "--launcher-args=--oversubscribe",
           f"--checkpoint-dir={tmp / 'ckpt'}", f"--log={log}", "--", *WORKER,
           "--ckpt", str(tmp / "ckpt"), "--events", str(tmp / "events"),
           "--out", str(tmp / "elastic.npy"), *worker_args]
    proc = subprocess.Popen(cmd, env=mpi_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
        if during is not None:
            during(proc)
    if proc.poll() is None:
        proc.kill()
        pytest.fail(f"the agent did not finish in {timeout} s:\n{proc.communicate()[0]}")
    return proc.returncode, proc.communicate()[0], _events(log)


def _launches(log: list[dict]) -> list[tuple[int, str]]:
    return [(e["workers"], e["reason"]) for e in log if e["event"] == "launch"]


@pytest.mark.timing      # the agent's polls (0.1 s) bound recovery_seconds to 0.5 s
def test_agent_two_workers_killed_at_once_relaunch_two_fewer(tmp_path):
    # Ranks 1 and 2 SIGKILL themselves after step 6; the slots file still says 4.
    args = ["--every", "4"]
    code, out, log = _agent(tmp_path, args + ["--kill-at", "6", "--kill-rank", "1,2"],
                            min_workers=2)
    assert code == 0, out
    assert _launches(log) == [(4, "start"), (2, "failure")], out
    failure = next(e for e in log if e["event"] == "failure")
    assert failure["lost"] == 2 and not failure["slots_rewritten"], failure
    shrunk = _events(tmp_path / "events")[0]
    assert shrunk["workers"] == 2 and shrunk["resumed_step"] == 4, shrunk
    # recovery_seconds counts from the death (the agent's last look with every worker
    # alive: at most one poll, 0.1 s, before it), not from when the agent noticed.
    death = float((tmp_path / "events.death").read_text())
    true = shrunk["first_step_time"] - death
    assert true - 0.02 <= shrunk["recovery_seconds"] <= true + 0.5, (shrunk, death)
    assert np.array_equal(np.load(tmp_path / "elastic.npy"),
                          run_reference(tmp_path, [(4, 4), (2, None)], args))


@pytest.mark.timing      # the rewrite must land within the dying job's teardown (~0.5 s)
def test_agent_keeps_a_slot_change_made_while_the_dead_job_ends(tmp_path):
    # Rank 2 dies after step 6; the slots file is rewritten (to 4) as soon as the
    # death is seen, while the dying job is still being torn down: the source has
    # spoken after the death, so the agent relaunches at 4, not 3.
    args = ["--every", "4"]
    death = tmp_path / "events.death"
    rewritten = []

    def rewrite(proc):
        if not rewritten and death.exists():
            (tmp_path / "slots").write_text("4")
            rewritten.append(time.time())

    code, out, log = _agent(tmp_path, args + ["--kill-at", "6", "--kill-rank", "2"],
                            min_workers=2, during=rewrite)
    assert code == 0, out
    assert rewritten, out
    assert _launches(log) == [(4, "start"), (4, "failure")], out
    failure = next(e for e in log if e["event"] == "failure")
    assert failure["lost"] == 1 and failure["slots_rewritten"], failure
    assert np.array_equal(np.load(tmp_path / "elastic.npy"),
                          run_reference(tmp_path, [(4, 4), (4, None)], args))


def test_agent_sigterm_reaches_the_workers_and_exits_75(tmp_path):
    # Steps of 2.5 s (longer than the 2 s after which Open MPI 4.1's mpirun SIGKILLs
    # the ranks it forwarded SIGTERM to); no periodic checkpoint. SIGTERM to the agent
    # once the workers are running: they finish the step, checkpoint and exit 75, and
    # so does the agent. Resumed by a plain run, the job ends exactly as one never
    # interrupted.
    args = ["--every", "1000", "--epochs", "1"]
    sent = []

    def preempt(proc):
        ready = list(Path(tempfile.gettempdir()).glob(f"mpishard-agent-{proc.pid}-*/ready"))
        if not sent and ready:
            time.sleep(1.0)
            proc.send_signal(signal.SIGTERM)
            sent.append(time.time())

    code, out, log = _agent(tmp_path, args + ["--step-seconds", "2.5"], slots="2",
                            during=preempt)
    assert sent, out
    assert code == EXIT_STOPPED, out
    forward = next(e for e in log if e["event"] == "forward")
    assert forward["signal"] == "SIGTERM" and forward["direct"] == 2, forward
    stopped = _events(tmp_path / "events")[0]
    assert stopped["stopped"] == "SIGTERM" and stopped["reason"] == "preempt", stopped
    step = stopped["final_step"]
    assert 1 <= step < 8, stopped
    saved = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert saved == [f"ckpt-{step:010d}.h5"], saved
    # Finish from that checkpoint, and compare with a run that was never stopped.
    resume = subprocess.run(mpirun_command(2, *WORKER[1:]) + [
        "--ckpt", str(tmp_path / "ckpt"), "--events", str(tmp_path / "events"),
        "--out", str(tmp_path / "elastic.npy"), *args], env=mpi_env(),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    assert resume.returncode == 0, resume.stdout
    assert np.array_equal(np.load(tmp_path / "elastic.npy"),
                          run_reference(tmp_path, [(2, None)], args))


def test_elastic_optimizer_takes_the_agents_worker_range(mpirun):
    # min_workers/max_workers are given once, to `mpishard run`: the workers'
    # ElasticOptimizer takes them from the variables the agent sets.
    code, out, _ = mpirun(2, """
        from mpishard import ShardingConfiguration
        from mpishard.optim import SGD
        from mpishard.strategies import ElasticOptimizer
        opt = ElasticOptimizer(SGD(lr=0.1), ShardingConfiguration())
        rows = opt.config.world.gather((opt.min_workers, opt.max_workers))
        if opt.config.world.rank == 0:
            print("RANGE", rows, flush=True)
    """, env={"MPISHARD_ELASTIC_MIN_WORKERS": "2", "MPISHARD_ELASTIC_MAX_WORKERS": "3"})
    assert code == 0, out
    assert "RANGE [(2, 3), (2, 3)]" in out, out
    code, out, _ = mpirun(2, """
        from mpishard import ShardingConfiguration
        from mpishard.optim import SGD
        from mpishard.strategies import ElasticOptimizer
        ElasticOptimizer(SGD(lr=0.1), ShardingConfiguration())
    """, env={"MPISHARD_ELASTIC_MIN_WORKERS": "3"}, quiet=True)
    assert code != 0
    assert "2 workers, outside the allowed range [3, 1024]" in out, out
