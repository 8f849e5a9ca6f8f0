"""A program's standard output holds only what it printed: no terminal escape codes.

Under ``mpirun`` each rank's standard output is a pseudo-terminal. Numba, at its
first compilation, initialises colorama (to highlight its error messages), and
colorama writes ``ESC[0m`` to that terminal at exit; a program that parses its
ranks' output read it at the start of its next line. ``mpishard.kernels`` imports
Numba with that highlighting off (issue 34, item 4).
"""

from __future__ import annotations

import pytest
from mpijobs import mpirun

pytestmark = pytest.mark.launch

# The fused SGD update is compiled (or loaded from Numba's cache) by the first call.
KERNEL_JOB = """
import numpy as np
from mpishard.kernels import numba_optim
p = np.ones(64, np.float32)
numba_optim.sgd_plain(p, np.ones_like(p), np.float32(0.5))
print("updated", p[0])
"""


@pytest.mark.parametrize("n", [1, 2])
def test_numba_kernel_program_has_no_escape(n):
    pytest.importorskip("numba")
    job = mpirun(n, KERNEL_JOB, timeout=120)
    assert job.returncode == 0, job.output
    assert job.output.count("updated 0.5") == n, job.output
    assert "\x1b" not in job.output, repr(job.output)


def test_train_command_has_no_escape(tmp_path):
    # The main job: its Burgers MLP (66,000 parameters) takes the fused update.
    pytest.importorskip("numba")
    pytest.importorskip("h5py")
    job = mpirun(2, ["-m", "mpishard", "train", "--example", "burgers", "--samples", "512",
                     "--epochs", "1", "--no-progress", "--out", str(tmp_path)], timeout=240)
    assert job.returncode == 0, job.output
    assert "burgers done" in job.output, job.output
    assert "\x1b" not in job.output, repr(job.output)
