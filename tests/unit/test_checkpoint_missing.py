"""A missing checkpoint file: ``FileNotFoundError`` from every way of reading one, and
the errors page and ``CheckpointError``'s docstring say so (issue 34, item 6).

``FileNotFoundError`` is what Python code catches for an absent file; it is not a
``CheckpointError``, which is for a file that is there but cannot be used.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from mpi4py import MPI

from mpishard import CheckpointError, ShardingConfiguration
from mpishard.checkpoint import (
    CheckpointManager,
    inspect_checkpoint,
    load_checkpoint,
    verify_checkpoint,
)
from mpishard.models import load_model_into
from mpishard.nn import MLP
from mpishard.optim import SGD
from mpishard.strategies import DDPOptimizer

ERRORS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "guide" / "errors.md"


def test_missing_file_is_file_not_found_everywhere(tmp_path):
    absent = str(tmp_path / "absent.h5")
    model = MLP([3, 4, 2])
    strategy = DDPOptimizer(SGD(lr=0.1), ShardingConfiguration(MPI.COMM_SELF))
    calls = {
        "load_checkpoint (parameters)": lambda: load_checkpoint(absent, model,
                                                                comm=MPI.COMM_SELF),
        "load_checkpoint (strategy)": lambda: load_checkpoint(absent, model, strategy),
        "verify_checkpoint": lambda: verify_checkpoint(absent),
        "inspect_checkpoint": lambda: inspect_checkpoint(absent),
        "load_model_into": lambda: load_model_into(MLP([3, 4, 2]), absent),
    }
    for what, call in calls.items():
        with pytest.raises(FileNotFoundError) as err:
            call()
        assert not isinstance(err.value, CheckpointError), what
        assert "absent.h5" in str(err.value), (what, str(err.value))
    # An empty folder is no error: None, and nothing loaded.
    assert CheckpointManager(tmp_path / "none").load_latest(model, strategy) is None


def test_errors_page_and_docstring_agree():
    page = ERRORS_PAGE.read_text()
    # The table's row of the class (its name may be a link to the reference).
    row = next(line for line in page.splitlines()
               if line.startswith("|") and "`CheckpointError`" in line.split("|")[1])
    assert "missing" not in row.split(";")[0], row   # not among what it is raised for
    assert re.search(r"missing checkpoint[^|\n]*`FileNotFoundError`", page), \
        "the errors page does not say a missing checkpoint raises FileNotFoundError"
    assert "missing" not in (CheckpointError.__doc__ or "").split("(")[0]
    assert "FileNotFoundError" in (CheckpointError.__doc__ or "")
