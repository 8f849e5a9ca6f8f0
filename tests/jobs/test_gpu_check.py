"""``scripts/gpu-check.sh`` and ``benchmarks/bench_gpu.py`` where they can run without a GPU.

Plain pytest. Their arguments, and the path on a machine without a GPU: one
JSON line saying so and exit code 3, before anything is installed or started.
What they do on a GPU is run there (the issue-23 device notes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mpishard.backend import cupy_available

REPO = Path(__file__).resolve().parents[2]
CHECK = REPO / "scripts" / "gpu-check.sh"
BENCH = REPO / "benchmarks" / "bench_gpu.py"


def run(*cmd: str, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_VENV": "/nonexistent", **env}
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=120, env=full,
                          cwd=REPO)


@pytest.mark.parametrize("args, message", [
    (["--bogus"], "unknown argument '--bogus'"),
    (["--no-bench", "--bench-only"], "leave nothing to run"),
])
def test_bad_arguments_exit_2(args, message):
    proc = run("bash", str(CHECK), *args)
    assert proc.returncode == 2 and message in proc.stderr and proc.stdout == ""


def test_help_describes_the_check():
    proc = run("bash", str(CHECK), "--help")
    assert proc.returncode == 0 and "--bench-only" in proc.stdout and "exit" in proc.stdout.lower()


@pytest.mark.skipif(cupy_available(), reason="a GPU is here: the check runs for real")
@pytest.mark.parametrize("args", [[], ["--no-bench"], ["--bench-only"]])
def test_without_a_gpu_one_json_line_and_exit_3(args, tmp_path):
    proc = run("bash", str(CHECK), *args, GPU_CHECK_LOGS=str(tmp_path))
    assert proc.returncode == 3, proc.stderr
    line, = proc.stdout.splitlines()
    record = json.loads(line)
    assert record["check"] == "gpu" and record["ok"] is False
    assert record["reason"].startswith("no GPU: ")


@pytest.mark.skipif(cupy_available(), reason="a GPU is here: the benchmark runs for real")
def test_benchmark_without_a_gpu_says_so():
    proc = run(sys.executable, str(BENCH), "--models", "mlp")
    assert proc.returncode == 3
    record = json.loads(proc.stdout)
    assert record["ok"] is False and record["reason"].startswith("no GPU: ")


@pytest.mark.parametrize("args, message", [
    (["--models", "resnet"], "--models: expecting some of mlp, gpt, got 'resnet'"),
    (["--kernels", "fast"], "--kernels: expecting some of reference, fused"),
    (["--steps", "0"], "--steps and --rounds must be positive"),
])
def test_benchmark_arguments(args, message):
    proc = run(sys.executable, str(BENCH), *args)
    assert proc.returncode == 2 and message in proc.stderr
