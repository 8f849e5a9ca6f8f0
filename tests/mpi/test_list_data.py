"""Python lists as training data (issue 34, item 5).

``optimize(model, (list_x, list_y))`` failed with ``AttributeError: 'list' object
has no attribute 'shape'``. An array-like without ``shape`` and ``dtype`` (a list,
nested lists, a tuple) is converted once with ``numpy.asarray``; training on it
gives the bits of training on the same data given as NumPy arrays. Data that does
not convert to numbers is refused on every rank with a message naming what is
accepted. Run under ``mpirun -n N python -m pytest --with-mpi`` (N = 1, 2).
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from mpishard import ShardingConfiguration
from mpishard.nn import MLP
from mpishard.optim import Adam
from mpishard.strategies import DDPOptimizer, ZeRO2Optimizer

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD


def _train(cls, data):
    model = MLP([4, 6, 3], seed=2, dtype=np.float32)
    opt = cls(Adam(lr=1e-2), ShardingConfiguration(WORLD))
    # 4 rows a rank: a global batch that splits at every world size (8 did not at 3).
    result = opt.optimize(model, data, epochs=2, batch_size=4 * WORLD.size, seed=3)
    with opt.gathered_parameters() as params:
        return np.array(params), result.losses


@pytest.mark.parametrize("cls", [DDPOptimizer, ZeRO2Optimizer], ids=["ddp", "zero2"])
def test_lists_train_as_the_same_arrays(cls):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 4))             # float64 data, a float32 model
    y = rng.integers(0, 3, 32)
    as_lists = _train(cls, (x.tolist(), y.tolist()))
    as_arrays = _train(cls, (x, y))
    np.testing.assert_array_equal(as_lists[0], as_arrays[0])
    assert as_lists[1] == as_arrays[1]
    rows = [tuple(r) for r in x.tolist()]        # a list of tuples, a tuple of ints
    np.testing.assert_array_equal(_train(cls, (rows, tuple(y.tolist())))[0], as_arrays[0])


def test_data_that_is_not_numbers_is_refused():
    x = [["a", "b", "c", "d"]] * 16
    with pytest.raises(ValueError, match=r"expecting an \(inputs, targets\) pair of arrays"
                                         r".*inputs.*numbers.*<U1"):
        _train(DDPOptimizer, (x, [0] * 16))
    ragged = [[1.0, 2.0], [3.0]] * 8
    with pytest.raises(ValueError, match=r"expecting an \(inputs, targets\) pair of arrays"):
        _train(DDPOptimizer, (ragged, [0] * 16))
