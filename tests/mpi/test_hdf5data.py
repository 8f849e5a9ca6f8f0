"""``HDF5Dataset``: training from a file equals training from the same arrays in memory,
and each rank reads only its rows.

Run at 1, 2 and 4 ranks (``mpirun -n N python -m pytest --with-mpi``). float64
throughout: the reference is the in-memory run at the same world size (equal
parameters, exactly) and one process on the global batch (rtol 1e-10).
"""

from __future__ import annotations

import h5py
import numpy as np
import pytest
from mpi4py import MPI
from reference import sampler_batches, train_serial
from worlds import batch_splits

from mpishard import ShardingConfiguration
from mpishard.data import ArrayDataset, HDF5Dataset, parse_data_spec
from mpishard.nn import MLP
from mpishard.optim import Adam
from mpishard.strategies import DDPOptimizer, ZeRO2Optimizer

pytestmark = pytest.mark.mpi

COMM = MPI.COMM_WORLD
N_SAMPLES, N_IN, N_OUT, BATCH, EPOCHS = 96, 5, 3, 16, 2


def arrays():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((N_SAMPLES, N_IN))
    y = np.tanh(x[:, :N_OUT] * 1.5) + 0.1 * rng.standard_normal((N_SAMPLES, N_OUT))
    return x, y


@pytest.fixture
def h5file(mpi_tmp_path):
    """A file with inputs, targets and a time series; written by rank 0, read by all."""
    path = mpi_tmp_path / "data.h5"
    if COMM.rank == 0:
        x, y = arrays()
        with h5py.File(path, "w") as f:
            f["/train/x"] = x
            f["/train/y"] = y
            f["/series/u"] = np.cumsum(np.random.default_rng(3).standard_normal((41, 4)), axis=0)
            f["/series/scalar"] = np.arange(10.0)
    COMM.Barrier()
    return str(path)


def model():
    return MLP([N_IN, 16, N_OUT], activation="tanh", loss="mse", dtype=np.float64, seed=3)


def train(strategy_cls, data):
    m = model()
    # ZeRO-2 would otherwise pick its reduction by timing it: fix it, so that
    # the two runs sum in the same order.
    extra = {"reduce_method": "reduce_scatter"} if strategy_cls is ZeRO2Optimizer else {}
    opt = strategy_cls(Adam(lr=1e-2), ShardingConfiguration(COMM), **extra)
    result = opt.optimize(m, data, epochs=EPOCHS, batch_size=BATCH)
    return m, result


def serial_reference():
    """One process, whole global batch, Adam called directly (``reference``)."""
    x, y = arrays()
    return train_serial(model(), Adam(lr=1e-2), sampler_batches(x, y, BATCH, EPOCHS)).model


@batch_splits(BATCH)
@pytest.mark.parametrize("strategy_cls", [DDPOptimizer, ZeRO2Optimizer], ids=["ddp", "zero2"])
def test_file_trains_like_memory(h5file, strategy_cls):
    with HDF5Dataset(h5file, "/train/x", "/train/y", comm=COMM) as ds:
        from_file, res_file = train(strategy_cls, ds)
        steps = res_file.steps
        local = BATCH // COMM.size
        # Each step read exactly this rank's rows of the global batch, once.
        assert ds.rows_read == {"inputs": steps * local, "targets": steps * local}
    from_memory, res_mem = train(strategy_cls, ArrayDataset(*arrays()))
    assert steps == EPOCHS * (N_SAMPLES // BATCH) == 12
    np.testing.assert_array_equal(from_file.params, from_memory.params)
    assert res_file.losses == res_mem.losses
    np.testing.assert_allclose(from_file.params, serial_reference().params, rtol=1e-10,
                               atol=1e-13)


@batch_splits(BATCH)
def test_each_rank_reads_only_its_share(h5file):
    """Over an epoch the ranks read disjoint rows, 1/N of the file each."""
    seen: list[int] = []
    with HDF5Dataset(h5file, "/train/x", "/train/y", comm=COMM) as ds:
        original = ds._rows

        def spy(dset, rows, role):
            if role == "inputs":
                seen.extend(int(r) for r in rows)
            return original(dset, rows, role)

        ds._rows = spy
        m = model()
        DDPOptimizer(Adam(lr=1e-2), ShardingConfiguration(COMM)).optimize(
            m, ds, epochs=1, batch_size=BATCH)
    every = COMM.allgather(seen)
    share = N_SAMPLES // COMM.size
    assert [len(s) for s in every] == [share] * COMM.size
    assert len(set().union(*map(set, every))) == N_SAMPLES   # disjoint, and all of them
    if COMM.size > 1:
        assert len(seen) < N_SAMPLES                         # no rank read the whole file


def test_time_series_rule(h5file):
    with h5py.File(h5file, "r") as f:
        u = f["/series/u"][()]
        scalar = f["/series/scalar"][()]
    with HDF5Dataset(h5file, "/series/u", comm=COMM) as ds:
        assert len(ds) == len(u) - 1 == 40
        x, y = ds.read(0, len(ds))
        np.testing.assert_array_equal(x, u[:-1])
        np.testing.assert_array_equal(y, u[1:])
        # Sample i's target is row i + 1, in any order, duplicates included.
        idx = np.array([7, 3, 39, 3])
        bx, by = ds.buffers(4, np, np.float32)
        ds.gather(idx, bx, by)
        np.testing.assert_array_equal(bx, u[idx].astype(np.float32))
        np.testing.assert_array_equal(by, u[idx + 1].astype(np.float32))
    with HDF5Dataset(h5file, "/series/scalar", comm=COMM) as ds:   # a 1-D series: one feature
        x, y = ds.read(2, 5)
        assert x.shape == (3, 1)
        np.testing.assert_array_equal(y[:, 0], scalar[3:6])


def test_driver(h5file):
    with HDF5Dataset(h5file, "/train/x", "/train/y", comm=COMM) as ds:
        parallel = h5py.get_config().mpi and COMM.size > 1
        assert ds.driver == ("mpio" if parallel else "serial")


def test_errors_on_every_rank(h5file, mpi_tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        HDF5Dataset(str(mpi_tmp_path / "missing.h5"), "/x", comm=COMM)
    with pytest.raises(ValueError, match="no dataset /train/z .* /series/u, .*/train/x"):
        HDF5Dataset(h5file, "/train/z", comm=COMM)
    with pytest.raises(ValueError, match="96 rows but targets /series/u have 41"):
        HDF5Dataset(h5file, "/train/x", "/series/u", comm=COMM)
    # Only rank 0's copy is missing: every rank still raises (no hang).
    local = mpi_tmp_path / f"only-here-{COMM.rank}.h5"
    if COMM.rank != 0:
        with h5py.File(local, "w") as f:
            f["x"] = np.zeros((4, 2))
    COMM.Barrier()
    with pytest.raises(FileNotFoundError):
        HDF5Dataset(str(mpi_tmp_path / "only-here-X.h5").replace("X", str(COMM.rank)), "/x",
                    comm=COMM)
    assert parse_data_spec("runs/a:b.h5:/g/x") == ("runs/a:b.h5", "/g/x")
    with pytest.raises(ValueError, match="FILE.h5:/group/dataset"):
        parse_data_spec("data.h5")
