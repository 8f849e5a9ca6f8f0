"""Elastic training: workers killed and slots returned under ``mpishard run``.

Each scenario runs the real agent over real ``mpirun`` jobs, then a reference
that performs the same resizes at the same steps on purpose (separate ``mpirun``
runs that stop at those steps and resume), and compares the final parameters
exactly (float64, bit for bit).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from elastic import WORKER, run_reference
from mpijobs import mpi_env
from strategies import NAMES

MPISHARD = [sys.executable, "-m", "mpishard"]


def _env() -> dict[str, str]:
    return mpi_env()   # also without MPISHARD_ELASTIC_RESTARTS: each job is a first launch


def read_events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def run_elastic(tmp: Path, worker_args: list[str], *, min_workers=2, max_workers=4,
                grow_back=True, timeout=150) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """The agent with a slots file of 4; after the failure relaunch, the slot "returns"."""
    slots = tmp / "slots"
    slots.write_text("4")
    log = tmp / "agent.log"
    cmd = MPISHARD + ["run", f"--min-workers={min_workers}", f"--max-workers={max_workers}",
                      f"--slots-file={slots}", "--launcher=mpirun",
                      "--launcher-args=--oversubscribe", f"--checkpoint-dir={tmp / 'ckpt'}",
                      f"--log={log}", "--"] + WORKER + [
        "--ckpt", str(tmp / "ckpt"), "--events", str(tmp / "events"),
        "--out", str(tmp / "elastic.npy"), "--slow-after-restart", "0.25"] + worker_args
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    deadline = time.monotonic() + timeout
    grown = not grow_back
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
        if not grown and any(e.get("reason") == "failure" and e["event"] == "launch"
                             for e in read_events(log)):
            time.sleep(0.5)
            slots.write_text("4")     # the lost slot comes back
            grown = True
    if proc.poll() is None:
        proc.kill()
        pytest.fail(f"the elastic job did not finish in {timeout} s:\n{proc.communicate()[0]}")
    out = proc.communicate()[0]
    return subprocess.CompletedProcess(cmd, proc.returncode, out), read_events(log)


KILL_POINTS = sorted(random.Random(2026).sample(range(5, 20), 2))
# One strategy per kill point: what this test adds is the agent's part (the kill, the
# shrink to 3, the slot that returns, the relaunch at 4) over real jobs. ZeRO-3 (it
# shards the parameters) and DDP here; ZeRO-2 under ElasticOptimizer stops and resumes
# bit for bit in tests/mpi/test_resume_rules.py, and every strategy's checkpoint is
# read back by every strategy at 1 to 4 ranks, 3 included, by
# tests/mpi/test_checkpoint_mpi.py::test_resume_at_any_size_and_strategy.
KILLS = list(zip(("ddp", "zero3"), KILL_POINTS))
assert {name for name, _ in KILLS} <= set(NAMES), NAMES


@pytest.mark.launch
@pytest.mark.parametrize(("strategy", "kill_at"), KILLS, ids=[f"{s}-{k}" for s, k in KILLS])
def test_killed_worker_shrinks_then_grows_back_exactly(tmp_path, kill_at, strategy):
    args = ["--strategy", strategy, "--every", "4"]
    proc, log = run_elastic(tmp_path, args + ["--kill-at", str(kill_at), "--kill-rank", "2"])
    assert proc.returncode == 0, proc.stdout
    launches = [(e["workers"], e["reason"]) for e in log if e["event"] == "launch"]
    assert launches == [(4, "start"), (3, "failure"), (4, "resize")], launches
    events = read_events(tmp_path / "events")
    shrunk, grown = events[0], events[1]
    assert shrunk["workers"] == 3 and shrunk["reason"] == "resize"
    # Resumed from the last checkpoint before the kill.
    resumed = shrunk["resumed_step"]
    assert resumed == (kill_at // 4) * 4
    assert grown["resumed_step"] == shrunk["final_step"] and grown["final_step"] == 24
    reference = run_reference(tmp_path, [(4, resumed), (3, shrunk["final_step"]), (4, None)],
                              ["--strategy", strategy, "--every", "4"])
    assert np.array_equal(np.load(tmp_path / "elastic.npy"), reference)


@pytest.mark.launch
def test_kill_during_checkpoint_write_uses_the_previous_one(tmp_path):
    args = ["--every", "4"]
    proc, log = run_elastic(tmp_path, args + ["--kill-in-save", "8", "--kill-rank", "1"],
                            grow_back=False)
    assert proc.returncode == 0, proc.stdout
    events = read_events(tmp_path / "events")
    assert events[0]["workers"] == 3 and events[0]["resumed_step"] == 4   # not 8
    assert events[0]["resumed_from"].endswith("ckpt-0000000004.h5")
    reference = run_reference(tmp_path, [(4, 4), (3, None)], args)
    assert np.array_equal(np.load(tmp_path / "elastic.npy"), reference)


@pytest.mark.launch
def test_below_minimum_stops_with_the_last_checkpoint(tmp_path):
    proc, log = run_elastic(tmp_path, ["--every", "4", "--kill-at", "10", "--kill-rank", "0"],
                            min_workers=4, grow_back=False)
    assert proc.returncode == 1
    last = proc.stdout.strip().splitlines()[-1]
    assert "fewer than --min-workers 4" in last
    assert f"the last good checkpoint is {tmp_path / 'ckpt' / 'ckpt-0000000008.h5'}" in last


@pytest.mark.launch
def test_restarts_run_out(tmp_path):
    proc, _ = run_elastic(tmp_path, ["--every", "4", "--kill-at", "6", "--kill-rank", "1"],
                          grow_back=False, min_workers=1)
    assert proc.returncode == 0   # one failure, within the default 3 restarts
    slots = tmp_path / "slots2"
    slots.write_text("2")
    cmd = MPISHARD + ["run", "--min-workers=1", "--max-workers=2", f"--slots-file={slots}",
                      "--max-restarts=0", "--launcher-args=--oversubscribe", "--",
                      sys.executable, "-c", "import sys; sys.exit(3)"]
    proc = subprocess.run(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=60)
    assert proc.returncode == 1
    assert "the 0 restart(s) allowed are used up" in proc.stdout
