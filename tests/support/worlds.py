"""World sizes of the MPI tests: a test that its world size does not fit skips, saying why.

The MPI tests run under ``mpirun -n N`` for N = 1, 2, 4 (8 for 3D layouts), and
any other N must give skips with the reason, never an error. These marks are
``skipif`` marks computed from what the test needs, the same on every rank (the
world size), so every rank skips alike and none waits in a collective for another:

* ``@batch_splits(rows, micro_batches)``: a global batch of ``rows`` rows split
  over the world's ranks x ``micro_batches`` (a strategy refuses any other);
* ``@world_multiple_of(size, what)``: a model-parallel group of ``size`` ranks
  (``tensor_parallel_size * pipeline_parallel_size``) tiles the world.

Inside a test, :func:`written_for` reads a table written for some group sizes
(unequal row counts by size, say) and skips at the others: every rank of the
group reads it at the same point with the same size, so all of them skip alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

import pytest
from mpi4py import MPI

__all__ = ["batch_splits", "world_multiple_of", "written_for"]

T = TypeVar("T")


def batch_splits(rows: int, micro_batches: int = 1) -> pytest.MarkDecorator:
    """Skip where a global batch of ``rows`` rows does not split over the world's
    ranks x ``micro_batches``."""
    size = MPI.COMM_WORLD.size
    return pytest.mark.skipif(
        rows % (size * micro_batches) != 0,
        reason=f"its global batch of {rows} rows does not split over {size} ranks x "
               f"{micro_batches} micro-batch(es)")


def world_multiple_of(size: int, what: str) -> pytest.MarkDecorator:
    """Skip where the world size is not a multiple of ``size`` (``what``: the layout)."""
    world = MPI.COMM_WORLD.size
    return pytest.mark.skipif(
        world % size != 0,
        reason=f"{what} needs a world of a multiple of {size} ranks, not {world}")


def written_for(table: Mapping[int, T], size: int, what: str) -> T:
    """``table[size]``, or skip saying for which sizes ``what`` is written (call it
    where every rank of a group of ``size`` ranks reads it)."""
    if size not in table:
        pytest.skip(f"{what}: written for groups of {sorted(table)} ranks, not {size}")
    return table[size]
