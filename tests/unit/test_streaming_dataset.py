"""The datasets of a growing stream, without MPI: a ``StreamingDataset`` appends and
keeps its rows, a pair of h5py datasets is read by sorted row selections (training
on growing data: ``tests/mpi/test_stream.py``).
"""

from __future__ import annotations

import numpy as np
import pytest

from mpishard.data import StreamingDataset


def stream(total=96, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((total, 5))
    return x, np.argmax(x @ rng.standard_normal((5, 3)), axis=1)


def test_streaming_dataset_appends_and_keeps_its_rows():
    x, y = stream(total=40)
    data = StreamingDataset(input_shape=(5,), dtype=np.float64, target_dtype=np.int64)
    assert len(data) == 0
    for a in range(0, 40, 7):
        data.append(x[a:a + 7], y[a:a + 7])
    data.append(x[0], y[0])        # one sample
    assert len(data) == 41
    xb, yb = data.buffers(4, np, np.float32)
    data.gather(np.array([40, 3, 39, 0]), xb, yb)
    np.testing.assert_array_equal(xb, x[[0, 3, 39, 0]].astype(np.float32))
    np.testing.assert_array_equal(yb, y[[0, 3, 39, 0]])
    with pytest.raises(ValueError, match="expecting rows of shape"):
        data.append(np.ones((2, 4)), np.ones(2))


def test_h5py_datasets_as_a_pair_read_by_rows(tmp_path):
    """``optimize(model, (f["x"], f["y"]))``: the pair is read by sorted row
    selections, never as a whole array."""
    import h5py

    from mpishard.data import ArrayDataset

    x, y = stream(total=30)
    with h5py.File(tmp_path / "d.h5", "w") as f:
        f["x"], f["y"] = x, y
    class Counted:
        """An h5py dataset that records the selections read from it."""

        def __init__(self, dset):
            self.dset, self.shape, self.dtype, self.reads = dset, dset.shape, dset.dtype, []

        def __len__(self):
            return len(self.dset)

        def __getitem__(self, sel):
            self.reads.append(np.asarray(sel).tolist())
            return self.dset[sel]

    with h5py.File(tmp_path / "d.h5", "r") as f:
        cx, cy = Counted(f["x"]), Counted(f["y"])
        data = ArrayDataset(cx, cy)
        xb, yb = data.buffers(5, np, np.float32)
        idx = np.array([29, 3, 3, 0, 17])
        data.gather(idx, xb, yb)
        np.testing.assert_array_equal(xb, x[idx].astype(np.float32))
        np.testing.assert_array_equal(yb, y[idx])
        assert cx.reads == cy.reads == [[0, 3, 17, 29]]
