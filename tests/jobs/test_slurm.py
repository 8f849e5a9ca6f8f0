"""The batch scripts in ``slurm/`` submitted with ``sbatch`` to a real single-node Slurm.

When no Slurm answers, ``scripts/slurm-local.sh start`` installs Debian's
slurm-wlm and munge if needed and starts slurmctld and slurmd on this machine;
the tests are skipped (with the reason) only where that cannot be done. Each
job is small: a few seconds of training on 4 tasks. Checked: the job state and
exit code, the log, the checkpoints read back, losses that fall, and a job
stopped by SIGUSR1, requeued and resumed that ends with exactly the parameters
of an uninterrupted job.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from mpijobs import REPO
from slurmjobs import FINAL, checkpoint, job_info, log, slurm_run, submit, wait

pytestmark = pytest.mark.launch

# The GPT job of the DDP and the requeue tests: 32 steps of 32 windows (enough to
# lower the validation loss 1.4 times, and for SIGUSR1 to land in the middle).
GPT_ARGS = ["--example", "gpt", "--samples", "512", "--epochs", "2", "--log-every", "2"]
GPT_STEPS = 32


def _slurm_answers() -> bool:
    if not shutil.which("sinfo"):
        return False
    try:
        proc = slurm_run("sinfo", "-h", "-N", "-o", "%t", timeout=20)
    except subprocess.TimeoutExpired:
        return False
    return proc.returncode == 0 and bool(re.search(r"^(idle|mix|alloc)", proc.stdout, re.M))


@pytest.fixture(scope="module")
def slurm() -> None:
    """A Slurm that takes jobs: the running one, or one started here."""
    if _slurm_answers():
        return
    installed = shutil.which("slurmctld") and shutil.which("munged")
    if not installed and not shutil.which("apt-get"):
        pytest.skip("Slurm is not running, not installed, and this is no Debian machine "
                    "(no apt-get) to install slurm-wlm and munge from")
    if os.geteuid() != 0 and not shutil.which("sudo"):
        pytest.skip("Slurm is not running and starting it needs root (or sudo)")
    proc = slurm_run("bash", str(REPO / "scripts" / "slurm-local.sh"), "start", timeout=900)
    if proc.returncode != 0 or not _slurm_answers():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        pytest.skip(f"Slurm could not be installed or started here: {' | '.join(tail)}")


def events(path: Path, kind: str) -> list[dict]:
    with open(path) as f:
        return [r for r in map(json.loads, f) if r["event"] == kind]


@pytest.fixture(scope="module")
def ddp_job(slurm, tmp_path_factory):
    """The DDP script on the GPT example; the requeue test compares with it."""
    tmp = tmp_path_factory.mktemp("slurm-ddp")
    job = submit("ddp.sbatch", tmp, *GPT_ARGS, MPISHARD_OUT=str(tmp / "run"))
    return tmp, job, wait(job)


def test_ddp_job(ddp_job):
    tmp, job, info = ddp_job
    text = log(tmp, "mpishard-ddp", job)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), text
    assert f"job {job}: 4 tasks" in text and "ddp on 4 rank(s)" in text and "gpt done" in text
    params, attrs = checkpoint(tmp / f"run/gpt/checkpoints/ckpt-{GPT_STEPS:010d}.h5")
    assert (attrs["step"], attrs["world_size"], attrs["strategy"]) == (GPT_STEPS, 4, "ddp")
    start, = events(tmp / "run/gpt/metrics.jsonl", "start")
    end, = events(tmp / "run/gpt/metrics.jsonl", "end")
    assert end["val_loss"] < start["start_val_loss"] / 1.4   # 4.58 at the start


def test_zero2_job(slurm, tmp_path):
    job = submit("zero2.sbatch", tmp_path, "--example", "burgers", "--samples", "2048",
                 "--epochs", "4", MPISHARD_OUT=str(tmp_path / "run"))
    info = wait(job)
    text = log(tmp_path, "mpishard-zero2", job)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), text
    assert "zero2 on 4 rank(s)" in text
    _, attrs = checkpoint(tmp_path / "run/burgers/checkpoints/ckpt-0000000032.h5")
    assert (attrs["step"], attrs["strategy"], attrs["dp"]) == (32, "zero2", 4)
    start, = events(tmp_path / "run/burgers/metrics.jsonl", "start")
    end, = events(tmp_path / "run/burgers/metrics.jsonl", "end")
    assert end["val_loss"] < start["start_val_loss"] / 4


def test_hybrid_job(slurm, tmp_path):
    job = submit("hybrid.sbatch", tmp_path, "--example", "burgers", "--samples", "1024",
                 "--epochs", "4", MPISHARD_OUT=str(tmp_path / "run"), MPISHARD_SCHEDULE="gpipe")
    info = wait(job)
    text = log(tmp_path, "mpishard-hybrid", job)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), text
    assert "hybrid on 4 rank(s): tp 2 x pp 2 x dp 1, 4 micro-batches, gpipe, zero2" in text
    start, = events(tmp_path / "run/burgers/metrics.jsonl", "start")
    end, = events(tmp_path / "run/burgers/metrics.jsonl", "end")
    assert (start["tp"], start["pp"], end["step"]) == (2, 2, 16)
    assert end["val_loss"] < start["start_val_loss"] / 3


def test_requeued_job_resumes_and_ends_like_an_uninterrupted_one(ddp_job, tmp_path):
    """SIGUSR1 (as ``--signal=USR1@120`` sends it before the time limit) stops the
    job with a checkpoint; the script requeues it; the second run resumes there
    and ends with the parameters of the uninterrupted DDP job, bit for bit."""
    out = tmp_path / "run"
    job = submit("elastic-requeue.sbatch", tmp_path, *GPT_ARGS, MPISHARD_OUT=str(out),
                 MPISHARD_STRATEGY="ddp")
    metrics = out / "gpt" / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:   # training has begun: the handlers are in place
        if metrics.exists() and '"step"' in metrics.read_text():
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"no training step in 240 s: {job_info(job)}")
    assert slurm_run("scancel", "--signal=USR1", job).returncode == 0   # to every task
    info = wait(job, until={"PENDING"} | FINAL)
    assert info["JobState"] == "PENDING" and info["Restarts"] == "1", info
    # Slurm holds a requeued job until its old credential expires (Reason=BeginTime):
    # 10 s on the test cluster (scripts/slurm-local.sh sets cred_expire). Forcing
    # StartTime=now races that expiry ("Job credential revoked") and fails the job.
    info = wait(job)
    text = log(tmp_path, "mpishard-requeue", job)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), text
    stopped = int(re.search(r"gpt stopped by SIGUSR1 at step (\d+)", text).group(1))
    assert 2 <= stopped < GPT_STEPS
    assert "checkpoint written, requeueing (restart 1)" in text
    assert f"job {job} (restart 1)" in text
    assert f"resumed from {out}/gpt/checkpoints/ckpt-{stopped:010d}.h5 at step {stopped}" in text
    assert [s["first_step"] for s in events(metrics, "start")] == [0, stopped]
    assert [e["step"] for e in events(metrics, "end")] == [stopped, GPT_STEPS]
    got, attrs = checkpoint(out / f"gpt/checkpoints/ckpt-{GPT_STEPS:010d}.h5")
    ref, _ = checkpoint(ddp_job[0] / f"run/gpt/checkpoints/ckpt-{GPT_STEPS:010d}.h5")
    assert attrs["step"] == GPT_STEPS
    for name in ref:
        np.testing.assert_array_equal(got[name], ref[name], err_msg=name)
