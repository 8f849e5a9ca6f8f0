"""``mpishard info``'s reproducibility section: the BLAS that NumPy loaded, as
threadpoolctl reads it (library, version, core type, threads), NumPy's version
and SIMD target, the C library, Numba's target (docs/guide/reproducible.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mpishard.comm import reproducibility_info, reproducibility_line

threadpoolctl = pytest.importorskip("threadpoolctl")


def blas_library() -> dict:
    found = [p for p in threadpoolctl.threadpool_info() if p["user_api"] == "blas"]
    assert found, threadpoolctl.threadpool_info()
    return found[0]


def test_the_section_reports_the_blas_core_and_threads():
    blas = blas_library()
    info = reproducibility_info()
    assert info["blas"] == f"{blas['internal_api']} {blas['version']}"
    assert info["blas_core"] == blas["architecture"]
    assert info["blas_threads"] == blas["num_threads"]
    assert info["OPENBLAS_CORETYPE"] == os.environ.get("OPENBLAS_CORETYPE", "unset")
    import numpy

    assert info["numpy"] == numpy.__version__
    assert info["numpy_exp_log"]            # X86_V3, X86_V4, baseline(...) or unknown
    with threadpoolctl.threadpool_limits(1, user_api="blas"):
        assert reproducibility_info()["blas_threads"] == 1
    line = reproducibility_line(info)
    assert f"core {blas['architecture']} threads {blas['num_threads']}" in line
    assert f"numpy {numpy.__version__}" in line


def test_mpishard_info_reports_the_core_type_and_threads_the_blas_runs():
    """A core type and a thread count set in the environment (read by OpenBLAS when
    it loads: a new process) are what `mpishard info --json` reports."""
    blas = blas_library()
    if blas["internal_api"] != "openblas" or not blas.get("architecture"):
        pytest.skip(f"NumPy's BLAS is {blas['internal_api']}: OPENBLAS_CORETYPE picks "
                    f"the kernels of OpenBLAS built for several processors only")
    # Nehalem's kernels (SSE4.2) run wherever NumPy 2's baseline (x86-64-v2) does;
    # elsewhere keep the core chosen. (Prescott would read back as Katmai.)
    core = "Nehalem" if os.uname().machine == "x86_64" else blas["architecture"]
    env = {**os.environ, "OPENBLAS_CORETYPE": core, "OPENBLAS_NUM_THREADS": "1",
           "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "mpishard", "info", "--json"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    said = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("{")))
    section = said["reproducibility"]
    assert section["blas_core"] == core
    assert section["OPENBLAS_CORETYPE"] == core
    assert section["blas_threads"] == 1
