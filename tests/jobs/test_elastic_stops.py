"""Worker scripts that ignore ``ElasticOptimizer.exit_code`` (written for 0.1, whose
``optimize()`` exited the process) under ``mpishard run``.

The agent asks the workers to stop (a resize: the slots file grows from 2 to 3; a
preemption: SIGTERM to the agent); they checkpoint and then exit 0. The job must
not end as finished: after the resize the agent relaunches at 3 and training runs
to its end, bit for bit as plain runs that make the same resize at the same step
on purpose; after SIGTERM it exits 75. Each worker job that stopped prints at exit
the line that says what to change in the script, and so does the agent.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from elastic import WORKER, run_reference
from mpijobs import mpi_env

from mpishard.exitcodes import EXIT_STOPPED

pytestmark = pytest.mark.launch

#: 96 samples, batches of 12: 8 steps an epoch, 24 in all.
ARGS = ["--every", "1000", "--epochs", "3", "--step-seconds", "0.15"]
STEPS = 24
FIX = "raise SystemExit(opt.exit_code)"


def _events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _ready(proc: subprocess.Popen) -> bool:
    return bool(list(Path(tempfile.gettempdir()).glob(f"mpishard-agent-{proc.pid}-*/ready")))


def _agent(tmp: Path, during, *, timeout: float = 150) -> tuple[int, str, list[dict]]:
    (tmp / "slots").write_text("2")
    log = tmp / "agent.log"
    cmd = [sys.executable, "-m", "mpishard", "run", "--min-workers=1", "--max-workers=4",
           f"--slots-file={tmp / 'slots'}", "--launcher=mpirun",
           "--launcher-args=--oversubscribe", f"--checkpoint-dir={tmp / 'ckpt'}",
           f"--log={log}", "--", *WORKER, "--ckpt", str(tmp / "ckpt"),
           "--events", str(tmp / "events"), "--out", str(tmp / "elastic.npy"),
           "--exit-zero", *ARGS]
    proc = subprocess.Popen(cmd, env=mpi_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
        during(proc)
    if proc.poll() is None:
        proc.kill()
        pytest.fail(f"the agent did not finish in {timeout} s:\n{proc.communicate()[0]}")
    return proc.returncode, proc.communicate()[0], _events(log)


def test_workers_that_exit_zero_after_a_resize_are_relaunched_and_finish(tmp_path):
    grown = []

    def grow(proc):
        if not grown and _ready(proc):
            time.sleep(0.6)                       # a few steps in
            (tmp_path / "slots").write_text("3")
            grown.append(time.time())

    code, out, log = _agent(tmp_path, grow)
    assert grown, out
    assert code == 0, out
    launches = [(e["workers"], e["reason"]) for e in log if e["event"] == "launch"]
    assert launches == [(2, "start"), (3, "resize")], out
    first, last = _events(tmp_path / "events")
    assert first["stopped"] == "SIGUSR1" and 0 < first["final_step"] < STEPS, first
    assert last["workers"] == 3 and last["final_step"] == STEPS, last
    unfinished = next(e for e in log if e["event"] == "unfinished")
    assert (unfinished["reason"], unfinished["step"]) == ("resize", first["final_step"])
    said = [line for line in out.splitlines() if line.startswith("[mpishard run] the workers")]
    assert len(said) == 1 and FIX in said[0] and "relaunches them at the new size" in said[0]
    warned = [line for line in out.splitlines() if "never read opt.exit_code" in line]
    assert len(warned) == 1 and FIX in warned[0], out   # rank 0 of the stopped launch only
    reference = run_reference(tmp_path, [(2, first["final_step"]), (3, None)], ARGS)
    assert np.array_equal(np.load(tmp_path / "elastic.npy"), reference)


def test_workers_that_exit_zero_after_sigterm_make_the_agent_exit_75(tmp_path):
    sent = []

    def preempt(proc):
        if not sent and _ready(proc):
            time.sleep(0.6)
            proc.send_signal(signal.SIGTERM)
            sent.append(time.time())

    code, out, log = _agent(tmp_path, preempt)
    assert sent, out
    assert code == EXIT_STOPPED, out
    stopped = _events(tmp_path / "events")
    assert len(stopped) == 1 and stopped[0]["stopped"] == "SIGTERM", stopped
    assert 0 < stopped[0]["final_step"] < STEPS, stopped
    assert [e["event"] for e in log][-2:] == ["unfinished", "stopped"], log
    assert any(FIX in line and f"exits {EXIT_STOPPED}" in line for line in out.splitlines()
               if line.startswith("[mpishard run] the workers")), out
