"""Reproducible mode's units: rows per unit from the batch, ``unit_rows`` and
``reproducible_sizes``, and the checks on those arguments. No MPI world."""

from __future__ import annotations

import math

import numpy as np
import pytest
from mpi4py import MPI

from mpishard import ShardingConfiguration
from mpishard.parallel.repro import unit_rows_for


def test_reproducible_sizes_set_the_units():
    """A batch of B rows is cut into gcd(B, lcm(sizes)) units (gcd(B, 24) without
    sizes); ``unit_rows`` fixes them itself."""
    for batch, sizes in ((48, None), (48, (1, 2, 4)), (48, (2, 3)), (40, (1, 3)),
                         (240, (1, 2, 3, 4)), (36, (8,))):
        units = math.gcd(batch, math.lcm(*(sizes or (24,))))
        assert unit_rows_for(batch, None, sizes) == batch // units, (batch, sizes)
    assert unit_rows_for(48, None) == 2                     # gcd(48, 24) = 24 units
    assert unit_rows_for(48, None, (1, 2, 4)) == 12         # 4 units
    assert unit_rows_for(48, 6, None) == 6


def test_reproducible_sizes_arguments():
    config = ShardingConfiguration(MPI.COMM_SELF, reproducible=True,
                                   reproducible_sizes=[np.int64(1), 2])
    assert config.reproducible_sizes == (1, 2)
    config.free()
    for bad in ((0, 2), (), "1,2", (1.5,), 3):
        with pytest.raises(ValueError, match="reproducible_sizes must be data-parallel sizes"):
            ShardingConfiguration(MPI.COMM_SELF, reproducible=True, reproducible_sizes=bad)
    with pytest.raises(ValueError, match="not both"):
        ShardingConfiguration(MPI.COMM_SELF, reproducible=True, unit_rows=4,
                              reproducible_sizes=(1, 2))
