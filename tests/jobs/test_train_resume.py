"""``mpishard train`` stopped and resumed, and ``--reproducible``: whole jobs under ``mpirun``.

The resume half of ``test_train_cli.py`` (its helpers), in a file of its own so that
pytest-xdist's ``--dist loadfile`` (scripts/test.sh) runs the two halves on two
workers: as one file it was the longest worker's work, most of the folder's time.
"""

from __future__ import annotations

import signal
import subprocess
import time

import h5py
import numpy as np
import pytest
from mpijobs import mpi_env, mpirun_command
from strategies import NAMES
from test_train_cli import LAUNCH, _command, events, losses, mpishard, params

from mpishard.commands.config import plan_runs


@LAUNCH
def test_resume_with_more_epochs_says_the_schedule_in_one_line(tmp_path):
    """``--resume`` with a larger ``--epochs`` (issue 34, item 2): the cosine schedule
    is this run's (16 -> 32 steps, the warm-up 1 -> 3: what --epochs plans), and
    rank 0 says so in one line with the jump of the learning rate; no warning with
    its source line on stderr. The first resumed step's lr is the new schedule's."""
    from mpishard.optim import CosineSchedule

    common = ["train", "--example", "burgers", "--samples", "1024", "--batch-size", "64",
              "--no-progress", "--log-every", "1", "--out", str(tmp_path)]
    first = mpishard(2, *common, "--epochs", "1")
    assert first.returncode == 0, first.stderr
    again = mpishard(2, *common, "--epochs", "2", "--resume")
    assert again.returncode == 0, again.stderr
    lines = [line for line in (again.stdout + again.stderr).splitlines() if "schedule" in line]
    said = [line for line in lines if "learning-rate schedule" in line]
    assert len(said) == 1, again.stdout + again.stderr
    assert ("this run's --epochs 2 plans CosineSchedule(total_steps=32, warmup_steps=3, "
            "min_ratio=0.0); the checkpoint's was CosineSchedule(total_steps=16, "
            "warmup_steps=1, min_ratio=0.0): the learning rate goes from 0 to ") in said[0], said
    assert "Warning" not in again.stderr and "warnings.warn" not in again.stderr, again.stderr
    assert "load_checkpoint(" not in again.stderr, again.stderr   # no source line
    steps = {r["step"]: r for r in events(tmp_path / "burgers/metrics.jsonl", "step")}
    assert steps[17]["lr"] == pytest.approx(2e-3 * CosineSchedule(32, 3)(17), rel=1e-12)
    # The same --epochs again: the same schedule, nothing said.
    same = mpishard(2, *common, "--epochs", "2", "--resume")
    assert same.returncode == 0, same.stderr
    assert "schedule:" not in same.stdout + same.stderr, same.stdout


@LAUNCH
def test_stop_and_resume_continue_exactly(tmp_path):
    """Stopped at step 5 and resumed, ZeRO-2 ends with the parameters of an
    uninterrupted run. (A checkpoint of step 5 resumed at another world size and
    strategy: test_every_strategy_trains_alike_and_resumes_under_another.)"""
    common = ["train", "--example", "burgers", "--samples", "2048", "--epochs", "2",
              "--strategy", "zero2", "--dtype", "float64"]
    whole = mpishard(2, *common, "--out", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr
    part = mpishard(2, *common, "--out", str(tmp_path / "part"), "--max-steps", "5")
    assert part.returncode == 0 and "stopped at --max-steps 5" in part.stdout, part.stderr
    resumed = mpishard(2, *common, "--out", str(tmp_path / "part"), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "at step 5" in resumed.stdout and "11 steps" in resumed.stdout
    ref, ref_step = params(tmp_path / "whole/burgers/checkpoints/ckpt-0000000016.h5")
    got, step = params(tmp_path / "part/burgers/checkpoints/ckpt-0000000016.h5")
    assert ref_step == step == 16
    # Equal but for the order of ZeRO-2's sums (it picks Reduce_scatter or
    # Allreduce by timing them at start): float64, rtol 1e-12.
    for name in ref:
        np.testing.assert_allclose(got[name], ref[name], rtol=1e-12, atol=0, err_msg=name)


@LAUNCH
def test_every_strategy_trains_alike_and_resumes_under_another(tmp_path):
    """``--strategy`` of each name of the registry trains the Burgers example alike
    (float64 on 2 ranks: each sum has two terms, so the strategies' losses are
    equal, to rtol 1e-12 step by step); a ZeRO-3 checkpoint resumes under
    ZeRO-2 at another size with the steps of the uninterrupted run.

    The flag is what is checked here, on one example: each strategy against the
    serial reference, GPT included, is tests/mpi (test_strategies.py, test_zero3.py's
    GPT cases); the GPT example under the command runs in
    test_no_arguments_both_examples_learn and test_hybrid_layouts_match_ddp."""
    common = ["train", "--samples", "512", "--epochs", "2", "--dtype", "float64",
              "--log-every", "1", "--batch-size", "32", "--example", "burgers"]
    runs = {}
    for strategy in NAMES:
        proc = mpishard(2, *common, "--strategy", strategy, "--out", str(tmp_path / strategy))
        assert proc.returncode == 0, proc.stderr
        assert f"{strategy} on 2 rank(s)" in proc.stdout, proc.stdout
        runs[strategy] = losses(tmp_path / strategy / "burgers" / "metrics.jsonl")
    first = runs[NAMES[0]]
    assert len(first) == 32 and first[-1] < first[0]
    for strategy in NAMES[1:]:
        np.testing.assert_allclose(runs[strategy], first, rtol=1e-12, atol=0,
                                   err_msg=strategy)
    # ZeRO-3 stopped at step 5, in the middle of the first epoch (its checkpoint),
    # resumed by ZeRO-2 on 4 ranks: the data position is resharded, and the steps
    # are those of the uninterrupted ZeRO-3 run (to rtol 1e-9: 4 ranks sum in
    # another order than 2).
    part = mpishard(2, *common, "--strategy", "zero3", "--max-steps", "5",
                    "--out", str(tmp_path / "part"))
    assert part.returncode == 0 and "stopped at --max-steps 5" in part.stdout, part.stderr
    ckpt = tmp_path / "part/burgers/checkpoints/ckpt-0000000005.h5"
    again = mpishard(4, *common, "--strategy", "zero2", "--resume", str(ckpt),
                     "--out", str(tmp_path / "four"))
    assert again.returncode == 0 and "at step 5" in again.stdout, again.stderr
    assert "27 steps" in again.stdout, again.stdout
    rest = losses(tmp_path / "four" / "burgers" / "metrics.jsonl")
    assert len(rest) == 27
    np.testing.assert_allclose(rest, runs["zero3"][5:], rtol=1e-9)


@LAUNCH
def test_sigusr1_writes_a_checkpoint_and_exits_75(tmp_path):
    out = tmp_path / "run"
    args = ["train", "--example", "gpt", "--samples", "1024", "--epochs", "2", "--log-every", "2",
            "--out", str(out)]
    proc = subprocess.Popen(_command(2, args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=mpi_env())
    metrics = out / "gpt" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and '"step"' in metrics.read_text():
            break
        time.sleep(0.1)
    proc.send_signal(signal.SIGUSR1)   # mpirun forwards SIGUSR1 to every rank
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 75, (stdout, stderr)
    end, = events(metrics, "end")
    assert end["stopped"] == "SIGUSR1" and 2 <= end["step"] < 64
    assert f"stopped by SIGUSR1 at step {end['step']}" in stdout
    _, step = params(end["checkpoint"])
    assert step == end["step"]
    again = mpishard(2, *args, "--resume")
    assert again.returncode == 0, again.stderr
    assert events(metrics, "end")[-1]["step"] == 64
    assert [s["first_step"] for s in events(metrics, "start")] == [0, end["step"]]


# --- mpishard train --reproducible (and its TOML key) ------------------------------------

@LAUNCH
def test_train_command_reproducible_flag_and_toml_key(tmp_path):
    """``mpishard train --reproducible`` on 1 rank (DDP), from a TOML file on 2
    ranks (ZeRO-2), and as a 2-stage pipeline of 4 micro-batches writes the same
    final parameters, bit for bit."""
    common = ["train", "--example", "burgers", "--samples", "128", "--epochs", "1",
              "--batch-size", "48", "--hidden", "16,16"]
    toml = tmp_path / "run.toml"
    toml.write_text('reproducible = true\nstrategy = "zero2"\n')
    assert plan_runs({"config": str(toml), "example": "burgers"}, 2)[0].reproducible
    assert not plan_runs({"example": "burgers"}, 2)[0].reproducible
    sized = tmp_path / "sized.toml"
    sized.write_text('reproducible = true\nreproducible_sizes = [1, 2, 4]\n')
    assert plan_runs({"config": str(sized), "example": "burgers"}, 2)[0].reproducible_sizes \
        == [1, 2, 4]
    # (ranks, arguments): one process; ZeRO-2 from the TOML file; a 2-stage pipeline
    # whose 4 micro-batches are 4 of the 24 units of 2 rows (issue 21: a unit cut
    # into micro-batches changed the bits, and 4 were refused).
    runs = {"one": (1, [*common, "--reproducible"]),
            "two": (2, [*common, "--config", str(toml)]),
            "pipe": (2, [*common, "--reproducible", "--strategy", "hybrid", "--pp", "2",
                         "--micro-batches", "4"])}
    final = {}
    for name, (n, args) in runs.items():
        job = subprocess.run(mpirun_command(n, "-m", "mpishard", *args, "--out",
                                            str(tmp_path / name)),
                             capture_output=True, text=True, timeout=240, env=mpi_env())
        assert job.returncode == 0, job.stdout + job.stderr
        assert "reproducible" in job.stdout
        folder = tmp_path / name / "burgers" / "checkpoints"
        (path,) = sorted(folder.glob("*.h5"))[-1:]
        with h5py.File(path, "r") as f:
            final[name] = {k: f["params"][k][()] for k in f["params"]}
    for other in ("two", "pipe"):
        assert sorted(final["one"]) == sorted(final[other])
        for key in final["one"]:
            assert final["one"][key].tobytes() == final[other][key].tobytes(), (other, key)
