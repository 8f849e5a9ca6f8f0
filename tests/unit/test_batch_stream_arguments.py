"""A :class:`mpishard.data.BatchStream` checks its arguments and casts only what it must.

Plain pytest (streams against one process, under ``mpirun``:
``tests/mpi/test_batch_stream.py``).
"""

from __future__ import annotations

import numpy as np
import pytest

from mpishard.data import BatchStream


def test_a_stream_checks_its_arguments_and_casts_only_what_it_must():
    with pytest.raises(ValueError, match="first must be a non-negative integer"):
        BatchStream([], first=-1)
    stream = BatchStream([])
    x = np.arange(6.0).reshape(3, 2)
    assert stream._placed(x, np, np.float64, "x") is x          # no copy
    as32 = stream._placed(x, np, np.float32, "x")
    assert as32.dtype == np.float32 and np.array_equal(as32, x)
    labels = np.array([1, 2, 3])
    assert stream._placed(labels, np, np.float32, "y") is labels   # integers kept
