"""What a checkpoint's architecture record holds and what loading compares (issue 34,
item 6): the record stores the model's seed and dtype (``mpishard ckpt inspect``
prints them); the seed is not compared, the dtype is compared as the parameters'
dtype. The checkpoints page says the same.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from mpishard import CheckpointError
from mpishard.checkpoint import load_checkpoint, save_checkpoint
from mpishard.cli import main
from mpishard.nn import MLP

PAGE = Path(__file__).resolve().parents[2] / "docs" / "guide" / "checkpoints.md"


def test_seed_and_dtype_stored_seed_not_compared(tmp_path):
    model = MLP([3, 8, 2], activation="tanh", seed=5, dtype=np.float32)
    path = save_checkpoint(tmp_path / "m.h5", model, comm=MPI.COMM_SELF)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["ckpt", "inspect", path]) == 0
    row = next(line for line in out.getvalue().splitlines() if line.startswith("architecture"))
    assert "seed=5" in row and '"float32"' in row, row
    other_seed = MLP([3, 8, 2], activation="tanh", seed=6, dtype=np.float32)
    info = load_checkpoint(path, other_seed, comm=MPI.COMM_SELF)
    assert info.architecture["args"]["seed"] == 5
    np.testing.assert_array_equal(other_seed.params, model.params)
    with pytest.raises(CheckpointError, match="float32 parameters, the model float64"):
        load_checkpoint(path, MLP([3, 8, 2], activation="tanh", seed=5), comm=MPI.COMM_SELF)


def test_checkpoints_page_says_stored_not_compared():
    text = " ".join(PAGE.read_text().split())
    assert "The seed and the dtype are not part of it" not in text
    assert "stores the model's seed and dtype" in text, "the page does not say they are stored"
    assert "the seed is not compared" in text
