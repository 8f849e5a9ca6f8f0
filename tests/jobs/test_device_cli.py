"""``mpishard train --device cuda``, ``mpishard info``'s GPU map, and which GPU a rank takes.

Plain pytest: the rule's arithmetic and the settings directly; the commands as
whole ``mpirun -n 2`` jobs. Where CuPy and a device are missing (the CI machine)
the jobs check the clear refusal (exit 2, one line on rank 0); the GPU job
itself is marked ``gpu``.
"""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest
from mpijobs import mpi_env, mpirun_command

from mpishard.backend import cupy_available, gpu_for_rank
from mpishard.commands.config import UsageError, plan_runs

ERROR = "mpishard train: error: "


def mpishard(n: int, *args: str, timeout: float = 240, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(mpirun_command(n, "-m", "mpishard", *args, quiet=True),
                          capture_output=True, text=True, timeout=timeout, env=mpi_env(env))


@pytest.mark.parametrize("local, visible, index, expected", [
    (0, 1, None, 0), (3, 1, None, 0),          # one device (say --gpus-per-task=1): device 0
    (0, 4, None, 0), (3, 4, None, 3), (5, 4, None, 1),
    (1, 2, 0, 0), (0, 2, 1, 1),                # --gpu-index wins
])
def test_a_rank_takes_its_local_rank_modulo_the_visible_devices(local, visible, index, expected):
    device, why = gpu_for_rank(local, visible, index, "2,3" if visible == 2 else None)
    assert device == expected
    assert (f"--gpu-index {index}" in why) if index is not None else (f"{local} %" in why)


def test_no_device_or_an_index_out_of_range_is_named():
    with pytest.raises(ValueError, match=r"no CUDA device is visible.*CUDA_VISIBLE_DEVICES="):
        gpu_for_rank(0, 0, None, "")
    with pytest.raises(ValueError, match="--gpu-index 2 is not a device of this rank: it sees 2"):
        gpu_for_rank(0, 2, 2)


def test_device_settings_from_flags_and_toml(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('device = "cuda"\ngpu_index = 0\n')
    run, = plan_runs({"config": str(toml), "example": "burgers"}, 2)
    assert (run.device, run.gpu_index) == ("cuda", 0)
    run, = plan_runs({"example": "gpt"}, 2)
    assert (run.device, run.gpu_index) == ("cpu", None)
    with pytest.raises(UsageError, match="unknown device 'tpu': choose one of cpu, cuda"):
        plan_runs({"device": "tpu"}, 2)
    with pytest.raises(UsageError, match=r"--gpu-index 1 needs --device cuda \(got --device cpu"):
        plan_runs({"gpu_index": 1}, 2)
    with pytest.raises(UsageError, match="--gpu-index must be 0 or positive, got -1"):
        plan_runs({"device": "cuda", "gpu_index": -1}, 2)


@pytest.mark.launch
def test_info_shows_the_gpu_map_or_why_there_is_none():
    proc = mpishard(2, "info", "--json")
    assert proc.returncode == 0, proc.stderr
    gpus = json.loads(proc.stdout)["gpu_map"]
    if cupy_available():
        assert [line.split(" on ")[0] for line in gpus] == ["rank 0", "rank 1"]
        assert all("% " in line and "GPU " in line for line in gpus)
    else:
        assert isinstance(gpus, str)
        assert "CuPy is not installed" in gpus or "CuPy sees no CUDA device" in gpus
    table = mpishard(2, "info")
    assert table.returncode == 0 and "gpu_map" in table.stdout


@pytest.mark.launch
def test_device_cuda_without_a_gpu_is_one_line_on_rank_0(tmp_path):
    if cupy_available():
        pytest.skip("CuPy and a device are here: the GPU job runs instead (test below)")
    proc = mpishard(2, "train", "--example", "burgers", "--samples", "512", "--device", "cuda",
                    "--out", str(tmp_path))
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert len(lines) == 1 and lines[0].startswith(ERROR + "--device cuda: CuPy "), lines
    assert proc.stdout == ""


@pytest.mark.launch
@pytest.mark.gpu
@pytest.mark.parametrize("example", ["burgers", "gpt"])
def test_device_cuda_trains_as_the_cpu_does(tmp_path, example):
    """Both examples, 2 ranks sharing the GPU(s): the losses of the CUDA run follow
    the CPU run's (float64, a few steps: the same arithmetic up to rounding)."""
    if not cupy_available():
        pytest.skip("CuPy or a CUDA device is missing")
    args = ["train", "--example", example, "--samples", "256", "--batch-size", "32",
            "--epochs", "1", "--max-steps", "6", "--dtype", "float64", "--log-every", "1",
            "--d-model", "32", "--heads", "4", "--layers", "1", "--seq-len", "16"]
    losses = {}
    for device in ("cpu", "cuda"):
        out = tmp_path / device
        proc = mpishard(2, *args, "--device", device, "--out", str(out))
        assert proc.returncode == 0, proc.stderr
        with open(out / example / "metrics.jsonl") as f:
            losses[device] = [r["loss"] for r in map(json.loads, f) if r.get("event") == "step"
                              and "loss" in r]
        if device == "cuda":
            assert "GPUs (rank 0: GPU" in proc.stdout
    assert len(losses["cuda"]) == len(losses["cpu"]) > 0
    np.testing.assert_allclose(losses["cuda"], losses["cpu"], rtol=1e-9)


# --- the Slurm script ------------------------------------------------------------------

GPU_SCRIPT = "slurm/gpu.sbatch"


def _sbatch_test_only(script: str, tmp_path) -> subprocess.CompletedProcess:
    """``sbatch --test-only`` (checks the options against the running Slurm, submits
    nothing), on 1 task of 1 CPU so that the check fits this machine."""
    return subprocess.run(["sbatch", "--test-only", "--ntasks=1", "--cpus-per-task=1", script],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)


def test_the_gpu_script_asks_a_gpu_per_task_and_trains_on_it():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / GPU_SCRIPT).read_text()
    options = [line.split(None, 1)[1] for line in text.splitlines()
               if line.startswith("#SBATCH ")]
    assert "--gpus-per-task=1" in options
    assert "mpishard\" train --device cuda" in text
    proc = subprocess.run(["bash", "-n", "-c", text], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.launch
def test_the_gpu_script_is_valid_for_the_local_slurm(tmp_path):
    """Valid as it is where Slurm has GPUs (gres); where it has none, the only
    complaint is the GPU request, and without that line every other option is
    valid."""
    import shutil
    from pathlib import Path

    if shutil.which("sbatch") is None:
        pytest.skip("no sbatch here")
    script = Path(__file__).resolve().parents[2] / GPU_SCRIPT
    proc = _sbatch_test_only(str(script), tmp_path)
    if "Unable to contact slurm controller" in proc.stderr or "Socket timed out" in proc.stderr:
        pytest.skip(f"Slurm does not answer: {proc.stderr.strip()}")
    if proc.returncode == 0:
        return
    assert "Invalid generic resource (gres) specification" in proc.stderr, proc.stderr
    without = tmp_path / "no-gpu.sbatch"
    without.write_text("".join(line for line in script.read_text().splitlines(True)
                               if not line.startswith("#SBATCH --gpus-per-task")))
    proc = _sbatch_test_only(str(without), tmp_path)
    assert proc.returncode == 0, proc.stderr
