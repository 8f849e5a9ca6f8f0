"""``mpishard train`` and ``mpishard plot`` as a user runs them: whole jobs under ``mpirun``.

Each test starts its own ``mpirun`` (plain pytest, without ``--with-mpi``); the
settings layer is checked in one process by ``tests/unit/test_train_settings.py``. Every
job is small (seconds); the numbers checked are losses that fall by a factor,
step counts, checkpoints read back, and equal results of two ways of training.
"""

from __future__ import annotations

import json
import subprocess
import sys

import h5py
import numpy as np
import pytest
from mpijobs import mpi_env, mpirun_command

LAUNCH = pytest.mark.launch
ERROR = "mpishard train: error: "


def _command(n: int, args: list[str]) -> list[str]:
    # quiet: no Open MPI banner about the non-zero exit codes of bad-input tests.
    return mpirun_command(n, "-m", "mpishard", *args, quiet=True)


def mpishard(n: int, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(_command(n, list(args)), capture_output=True, text=True,
                          timeout=timeout, env=mpi_env())


def events(path, kind: str) -> list[dict]:
    with open(path) as f:
        return [r for r in map(json.loads, f) if r["event"] == kind]


def losses(path) -> list[float]:
    """The loss of each step of a run's ``metrics.jsonl``."""
    return [r["loss"] for r in events(path, "step")]


def params(path) -> dict[str, np.ndarray]:
    with h5py.File(path, "r") as f:
        return {k: f["params"][k][()] for k in f["params"]}, int(f.attrs["step"])


# --- whole jobs ------------------------------------------------------------------------------

@LAUNCH
def test_bad_input_is_one_line_on_rank_0_with_exit_code_2(tmp_path):
    toml = tmp_path / "bad.toml"
    toml.write_text("epochs = 1\nlearning_rate = 0.1\n")
    # A checkpoint of a model of another width, then a resume into this one.
    ck = tmp_path / "ck"
    first = mpishard(2, "train", "--example", "burgers", "--samples", "512", "--epochs", "1",
                     "--hidden", "32", "--checkpoint-dir", str(ck), "--out", str(tmp_path))
    assert first.returncode == 0, first.stderr
    cases = [
        (["--strategy", "zero4"],
         "unknown strategy 'zero4': choose one of ddp, zero2, zero3, hybrid"),
        (["--strategy", "hybrid", "--tp", "3"], "impossible layout: tp 3 x pp 1 does not fit 2"),
        (["--data", str(tmp_path / "missing.h5") + ":/x"], "missing.h5: no such file"),
        (["--config", str(toml)], "unknown key 'learning_rate'; valid keys: example, data,"),
        (["--example", "burgers", "--samples", "512", "--hidden", "64", "--checkpoint-dir",
          str(ck), "--resume"], "a different model: tensor 0.weight (number 0 of the"),
        (["--epochs", "three"], "argument --epochs: invalid int value: 'three'"),
    ]
    for args, message in cases:
        proc = mpishard(2, "train", *args, "--out", str(tmp_path))
        lines = proc.stderr.splitlines()
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert len(lines) == 1 and lines[0].startswith(ERROR) and message in lines[0], lines
        assert proc.stdout == "", proc.stdout   # nothing started, nothing printed
        assert "Traceback" not in proc.stderr


@LAUNCH
def test_no_arguments_both_examples_learn(tmp_path):
    """The main job's two runs, shortened (2 epochs of 1024 samples): both learn
    (validation losses 1.8 and 2.2 times lower at the end on the test machine)."""
    proc = mpishard(2, "train", "--epochs", "2", "--samples", "1024", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    for run, steps, factor in (("gpt", 64, 1.5), ("burgers", 8, 2.0)):
        start, = events(tmp_path / run / "metrics.jsonl", "start")
        end, = events(tmp_path / run / "metrics.jsonl", "end")
        assert end["step"] == steps
        assert end["val_loss"] < start["start_val_loss"] / factor, (run, start, end)
        assert f"{run} done: loss" in proc.stdout
        p, step = params(end["checkpoint"])
        assert step == steps and all(np.isfinite(v).all() for v in p.values())
    start, = events(tmp_path / "gpt" / "metrics.jsonl", "start")
    assert 4.4 < start["start_val_loss"] < 4.7           # ln(97): a uniform guess at first
    assert "memory per rank, MiB: peak RSS" in proc.stdout


@LAUNCH
def test_hybrid_layouts_match_ddp(tmp_path):
    """The GPT example, float64, 8 steps on 4 ranks, against DDP step by step:
    tp 2 x pp 2 with 4 micro-batches (1F1B) and ZeRO-2 across replicas (rtol 1e-9),
    and pp 2 x dp 2 with 2 micro-batches, ZeRO-3 over each stage's data group (its
    parameters gathered before each pass of the schedule; rtol 1e-12).

    One DDP run for both. Every tp x pp x dp layout of 4 (and 8) ranks, GPT and MLP,
    is compared with the serial reference in tests/mpi/test_hybrid.py; the Burgers
    example as tp 2 x pp 2 with ZeRO-2 under the command against one process in
    tests/cluster/test_cluster.py (the hybrid sbatch jobs, rtol 1e-10), and as a
    2-stage pipeline in test_train_command_reproducible_flag_and_toml_key."""
    common = ["train", "--samples", "256", "--epochs", "1", "--dtype", "float64",
              "--batch-size", "32", "--example", "gpt", "--log-every", "1"]
    layouts = {
        "tp2-pp2": (["--tp", "2", "--pp", "2", "--micro-batches", "4", "--schedule", "1f1b",
                     "--data-parallel", "zero2"], "tp 2 x pp 2 x dp 1", 1e-9),
        "pp2-dp2": (["--pp", "2", "--micro-batches", "2", "--data-parallel", "zero3"],
                    "tp 1 x pp 2 x dp 2, 2 micro-batches, 1f1b, zero3 across replicas (stage "
                    "gradient sharded)", 1e-12),
        "pp2-dp2-whole": (["--pp", "2", "--micro-batches", "2", "--data-parallel", "zero3",
                           "--stage-gradient", "whole"],
                          "tp 1 x pp 2 x dp 2, 2 micro-batches, 1f1b, zero3 across replicas "
                          "(stage gradient whole)", 1e-12),
    }
    ddp = mpishard(4, *common, "--out", str(tmp_path / "ddp"))
    assert ddp.returncode == 0, ddp.stderr
    a = losses(tmp_path / "ddp" / "gpt" / "metrics.jsonl")
    assert len(a) == 8 and a[-1] < a[0]
    for name, (args, says, rtol) in layouts.items():
        hybrid = mpishard(4, *common, "--strategy", "hybrid", *args,
                          "--out", str(tmp_path / name))
        assert hybrid.returncode == 0, hybrid.stderr
        assert says in hybrid.stdout, hybrid.stdout
        b = losses(tmp_path / name / "gpt" / "metrics.jsonl")
        assert len(b) == 8
        np.testing.assert_allclose(b, a, rtol=rtol, err_msg=name)


@LAUNCH
def test_hdf5_data_and_progress_bar(tmp_path):
    """--data trains from a file (time-series rule) and matches the same data
    written as explicit inputs and targets; --progress draws tqdm's bar."""
    rng = np.random.default_rng(0)
    u = np.cumsum(rng.standard_normal((257, 6)), axis=0) / 10
    path = tmp_path / "series.h5"
    with h5py.File(path, "w") as f:
        f["/flow/u"] = u
        f["/pairs/x"], f["/pairs/y"] = u[:-1], u[1:]
    common = ["train", "--epochs", "3", "--batch-size", "32", "--dtype", "float64",
              "--log-every", "1"]
    a = mpishard(2, *common, "--data", f"{path}:/flow/u", "--out", str(tmp_path / "a"),
                 "--progress")
    b = mpishard(2, *common, "--data", f"{path}:/pairs/x", "--targets", "/pairs/y",
                 "--out", str(tmp_path / "b"))
    assert a.returncode == 0 and b.returncode == 0, (a.stderr, b.stderr)
    assert "256 samples of" in a.stdout and "each row's target is the next row" in a.stdout
    assert "100%|" in a.stdout and "samples/s" in a.stdout   # the bar, with its last state
    la = [r["loss"] for r in events(tmp_path / "a" / "data" / "metrics.jsonl", "step")]
    lb = [r["loss"] for r in events(tmp_path / "b" / "data" / "metrics.jsonl", "step")]
    assert len(la) == 24 and la == lb
    assert np.mean(la[-3:]) < np.mean(la[:3]) / 2


@LAUNCH
def test_data_header_says_the_dtype_it_trains_in(tmp_path):
    """A float64 file trains in --dtype's precision (float32 by default): the header
    says so, and how to train in the file's; the --help of --dtype says it too."""
    path = tmp_path / "series.h5"
    with h5py.File(path, "w") as f:
        f["u"] = np.cumsum(np.random.default_rng(0).standard_normal((65, 3)), axis=0)
    said = {}
    for dtype in ("float32", "float64"):
        run = mpishard(1, "train", "--data", f"{path}:/u", "--dtype", dtype, "--max-steps",
                       "1", "--batch-size", "16", "--out", str(tmp_path / dtype))
        assert run.returncode == 0, run.stderr
        said[dtype] = run.stdout.splitlines()[0]
    assert said["float32"].endswith("read in parallel; stored as float64, trained as float32: "
                                    "--dtype float64 trains in the file's precision)"), said
    assert said["float64"].endswith("read in parallel)"), said
    helped = subprocess.run([sys.executable, "-m", "mpishard", "train", "--help"],
                            capture_output=True, text=True, timeout=60, env=mpi_env())
    assert "also the dtype --data is trained in" in " ".join(helped.stdout.split())


@LAUNCH
def test_plot_draws_the_loss_curve(tmp_path):
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.parent.mkdir()
    lines = [{"event": "start", "run": "demo", "first_step": 0, "start_val_loss": 4.0},
             *({"event": "step", "step": s, "loss": 4.0 / s} for s in range(1, 11)),
             {"event": "epoch", "epoch": 1, "step": 10, "loss": 1.0, "val_loss": 0.5},
             {"event": "step", "step": 10, "loss": 0.3}]   # a resumed run wrote step 10 again
    metrics.write_text("".join(json.dumps(r) + "\n" for r in lines))
    png = tmp_path / "loss.png"
    proc = subprocess.run([sys.executable, "-m", "mpishard", "plot", str(metrics), str(metrics),
                           "-o", str(png)], capture_output=True, text=True, env=mpi_env(),
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (770, 704)                # 7 x 6.4 inches at 110 dpi: 2 panels
    from mpishard.commands.plot import read_metrics

    curves = read_metrics(str(metrics))
    assert curves.name == "demo" and curves.train[10] == 0.3 and curves.train[2] == 2.0
    assert curves.validation == {0: 4.0, 10: 0.5}
    bad = subprocess.run([sys.executable, "-m", "mpishard", "plot", str(tmp_path / "none.jsonl")],
                         capture_output=True, text=True, env=mpi_env(), timeout=60)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "none.jsonl" in bad.stderr
