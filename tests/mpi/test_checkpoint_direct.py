"""The direct write (``driver="direct"``, what ``"auto"`` chooses): rank 0 lays the
file out, every rank ``pwrite``s its bytes into it, one commit.

Run under ``mpirun -n N python -m pytest --with-mpi -m mpi`` for N = 1, 2, 4. The
reference of every test is the HDF5 write in the same run (``mpio`` where h5py
has MPI, and ``serial``): the files are equal bit for bit in every dataset,
checksum and attribute (but ``created``), and load into the same state.
"""

from __future__ import annotations

import os

import h5py
import numpy as np
import pytest
from layouts import hybrid, mlp_data
from mpi4py import MPI
from test_async_checkpoint import assert_same_file, make, make_data, params_of
from worlds import batch_splits

from mpishard import CheckpointError
from mpishard.checkpoint import (
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
    wait_for_checkpoint,
)
from mpishard.checkpoint import write as checkpoint_write
from mpishard.checkpoint.collective import DRIVER_ENV, resolve_driver
from mpishard.comm import from_comm

pytestmark = [pytest.mark.mpi, batch_splits(24)]

WORLD = MPI.COMM_WORLD
HDF5_DRIVERS = ["serial"] + (["mpio"] if h5py.get_config().mpi else [])


@pytest.mark.parametrize("name", ["ddp", "zero2", "zero3"])
def test_direct_file_is_the_hdf5_drivers_file(name, mpi_tmp_path):
    model, strategy = make(name)
    strategy.optimize(model, make_data(), epochs=1, batch_size=24)
    direct = save_checkpoint(mpi_tmp_path / "direct.h5", model, strategy, driver="direct")
    others = [save_checkpoint(mpi_tmp_path / f"{d}.h5", model, strategy, driver=d)
              for d in HDF5_DRIVERS]
    if WORLD.rank == 0:
        for other in others:
            assert_same_file(direct, other)
        verify_checkpoint(direct)
        assert not [n for n in os.listdir(mpi_tmp_path) if ".tmp-" in n]
    saved = params_of(model, strategy)
    model, strategy = make(name)
    info = load_checkpoint(direct, model, strategy)
    assert info.step == strategy.step_count == 4
    assert np.array_equal(params_of(model, strategy), saved)


@pytest.mark.parametrize("tp", [1, 2])
def test_tensor_parallel_slices_are_written_where_hdf5_puts_them(tp, mpi_tmp_path):
    # tp=2: each rank's pieces are column slices of split weights, runs of one row each.
    if WORLD.size % tp:
        pytest.skip(f"tp={tp} needs a world size divisible by it, got {WORLD.size}")
    dp = WORLD.size // tp
    if 48 % (2 * dp):
        pytest.skip(f"a global batch of 48 rows does not split over {dp} data-parallel "
                    f"ranks x 2 micro-batches")
    model, opt = hybrid(WORLD, tp, 1, "zero2", reduce_method="reduce_scatter")
    opt.optimize(model, mlp_data(), epochs=1, batch_size=48)
    direct = save_checkpoint(mpi_tmp_path / "direct.h5", model, opt, driver="direct")
    serial = save_checkpoint(mpi_tmp_path / "serial.h5", model, opt, driver="serial")
    if WORLD.rank == 0:
        assert_same_file(direct, serial)
    WORLD.Barrier()


def test_auto_is_direct_unless_the_environment_names_a_driver(monkeypatch):
    monkeypatch.delenv(DRIVER_ENV, raising=False)
    assert checkpoint_write.choose_driver("auto", 4) == "direct"
    assert checkpoint_write.choose_driver("auto", 1) == "direct"
    monkeypatch.setenv(DRIVER_ENV, "serial")
    assert checkpoint_write.choose_driver("auto", 4) == "serial"
    assert checkpoint_write.choose_driver("direct", 4) == "direct"   # the argument wins
    monkeypatch.setenv(DRIVER_ENV, "direct")
    assert checkpoint_write.choose_driver("auto", 4) == "direct"
    with pytest.raises(ValueError, match="'auto', 'direct', 'mpio', 'serial'.*'posix'"):
        checkpoint_write.choose_driver("posix", 4)
    # Every public answer is the driver used: resolve_driver and `mpishard info`.
    from mpishard.cli import environment_info

    assert resolve_driver("auto", 4) == "direct"
    assert environment_info()["checkpoint_driver"] == f"direct ({DRIVER_ENV}={'direct'})"
    monkeypatch.delenv(DRIVER_ENV)
    assert environment_info()["checkpoint_driver"] == f"direct ({DRIVER_ENV} unset)"
    monkeypatch.setenv(DRIVER_ENV, "serial")
    assert resolve_driver("auto", 2) == checkpoint_write.choose_driver("auto", 2) == "serial"
    assert environment_info()["checkpoint_driver"].startswith("serial ")


def test_failed_direct_write_is_raised_on_every_rank(mpi_tmp_path, monkeypatch):
    model, strategy = make("zero2")
    strategy.optimize(model, make_data(), epochs=1, batch_size=24)
    good = save_checkpoint(mpi_tmp_path / "good.h5", model, strategy, driver="direct")
    if WORLD.rank == WORLD.size - 1:
        def failing(*args):
            raise OSError(28, "No space left on device (injected)")
        monkeypatch.setattr(checkpoint_write.os, "pwrite", failing)
    with pytest.raises(CheckpointError, match=f"failed on rank {WORLD.size - 1}.*injected"):
        save_checkpoint(mpi_tmp_path / "bad.h5", model, strategy, driver="direct")
    monkeypatch.undo()
    WORLD.Barrier()
    assert not os.path.exists(mpi_tmp_path / "bad.h5")
    assert not [n for n in os.listdir(mpi_tmp_path) if ".tmp-" in n]
    load_checkpoint(good, model, strategy)   # the previous one is untouched


def test_pieces_that_miss_or_overlap_are_refused_on_every_rank(mpi_tmp_path):
    """One allgather tells every rank every rank's pieces: the coverage and a
    rank's own problem are raised alike everywhere, with no agreement after it."""
    from mpishard.checkpoint.format import TensorRecord

    path = str(mpi_tmp_path / "bad.h5")
    t = TensorRecord("params", "w", (8, 4), "<f8", 0)
    whole = np.zeros((8, 4))
    world = from_comm(WORLD, "test")
    # Every rank gives the whole tensor: an overlap from 2 ranks on, a gap alone.
    block = (slice(0, 8 if WORLD.size > 1 else 4), slice(0, 4))
    pieces = [checkpoint_write.Piece(t, block, whole[block])]
    with pytest.raises(CheckpointError, match="do not cover each dataset exactly once: "
                                              "params/w"):
        checkpoint_write.write_checkpoint_file(path, world, [t], pieces, {"/": {}},
                                               driver="direct")
    last = WORLD.size - 1
    wrong = np.zeros((8, 4), dtype=np.float32) if WORLD.rank == last else whole
    pieces = [checkpoint_write.Piece(t, (slice(0, 8), slice(0, 4)), wrong)]
    with pytest.raises(CheckpointError, match="holds float32, the tensor is float64"):
        checkpoint_write.write_checkpoint_file(path, world, [t], pieces, {"/": {}},
                                               driver="direct")
    WORLD.Barrier()
    assert not [n for n in os.listdir(mpi_tmp_path) if n.startswith("bad.h5")]


def test_a_rank_that_cannot_open_the_file_fails_the_save_on_every_rank(mpi_tmp_path,
                                                                     monkeypatch):
    """The open is no agreement of its own: its failure is agreed on with the
    write's, at the seal (synchronous) or the commit (asynchronous)."""
    model, strategy = make("zero2")
    strategy.optimize(model, make_data(), epochs=1, batch_size=24)
    last = WORLD.size - 1
    real = checkpoint_write.os.open

    def refusing(path, flags, *args):
        if ".tmp-" in str(path) and flags & os.O_WRONLY:
            raise OSError(2, "No such file or directory")
        return real(path, flags, *args)

    if WORLD.rank == last:
        monkeypatch.setattr(checkpoint_write.os, "open", refusing)
    for asynchronous in (False, True):
        with pytest.raises(CheckpointError, match=f"rank {last} cannot open the temporary"):
            save_checkpoint(mpi_tmp_path / "bad.h5", model, strategy,
                            asynchronous=asynchronous)
            wait_for_checkpoint()
    monkeypatch.undo()
    WORLD.Barrier()
    assert not [n for n in os.listdir(mpi_tmp_path) if n.startswith("bad.h5")]


def test_no_two_ranks_write_one_page_of_a_large_dataset(mpi_tmp_path, monkeypatch):
    """DDP's replicated vectors: each rank's share ends where a 4 KiB page of the
    file begins (the shares of `shard_ranges` cut the 2 MiB weight mid-page), and
    every ``pwrite`` after a run's first starts on a page."""
    from mpishard import ShardingConfiguration
    from mpishard.nn import MLP
    from mpishard.optim import Adam
    from mpishard.strategies import DDPOptimizer

    model = MLP([64, 512, 512, 10], activation="tanh", seed=3, dtype=np.float64)
    strategy = DDPOptimizer(Adam(lr=1e-3), ShardingConfiguration(WORLD))
    strategy.attach(model)
    calls = []
    real = checkpoint_write.os.pwrite

    def recording(fd, data, offset):
        calls.append((offset, len(data)))
        return real(fd, data, offset)

    monkeypatch.setattr(checkpoint_write.os, "pwrite", recording)
    path = save_checkpoint(mpi_tmp_path / "pages.h5", model, strategy, driver="direct")
    monkeypatch.undo()
    every = WORLD.allgather(calls)
    if WORLD.rank == 0:
        with h5py.File(path, "r") as f:
            large = [(f[p].id.get_offset(), f[p].id.get_storage_size())
                     for p in ("params/0.weight", "params/2.weight", "optimizer/exp_avg/2.weight")]
        owner = {}
        for rank, writes in enumerate(every):
            for offset, n in writes:
                for page in range(offset // 4096, (offset + n - 1) // 4096 + 1):
                    if any(a // 4096 <= page <= (a + s - 1) // 4096 for a, s in large):
                        assert owner.setdefault(page, rank) == rank, (page, owner[page], rank)
    verify_checkpoint(path) if WORLD.rank == 0 else None
    assert checkpoint_write.aligned_chunks(100, 10000, 4096) == [(0, 3996), (3996, 8092),
                                                                 (8092, 10000)]
    assert checkpoint_write.aligned_chunks(8192, 10, 4096) == [(0, 10)]
