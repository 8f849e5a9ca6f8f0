"""Asynchronous checkpoints: the same file as the synchronous save, written later.

Run under ``mpirun -n N python -m pytest --with-mpi -m mpi`` for N = 1, 2, 4. The
reference of every test is the synchronous save in the same run: the file's
datasets, checksums and attributes (but ``created``) are equal bit for bit, a
training that saves asynchronously ends with the parameters of one that saves
synchronously, and a resume continues exactly as the uninterrupted run.
"""

from __future__ import annotations

import os

import h5py
import numpy as np
import pytest
from layouts import hybrid, mlp_data
from mpi4py import MPI
from worlds import batch_splits

from mpishard import CheckpointError, ShardingConfiguration
from mpishard.checkpoint import (
    CheckpointManager,
    background,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
    wait_for_checkpoint,
)
from mpishard.nn import MLP
from mpishard.optim import AdamW
from mpishard.strategies import DDPOptimizer, ElasticOptimizer, ZeRO2Optimizer, ZeRO3Optimizer

pytestmark = [pytest.mark.mpi, batch_splits(24)]   # BATCH, below

WORLD = MPI.COMM_WORLD
SIZES = [5, 7, 7, 3]   # 122 parameters: no shard boundary meets a tensor's
BATCH = 24
STRATEGIES = {"ddp": DDPOptimizer, "zero2": ZeRO2Optimizer, "zero3": ZeRO3Optimizer}


def make_data(n=96):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((n, 5))
    return x, np.argmax(x @ rng.standard_normal((5, 3)), axis=1)


def make(name):
    model = MLP(SIZES, activation="tanh", seed=7, dtype=np.float64)
    strategy = STRATEGIES[name](AdamW(lr=3e-3, weight_decay=0.05), ShardingConfiguration(WORLD),
                                bucket_mb=1e-4)
    strategy.attach(model)
    return model, strategy


def datasets(path):
    """Every dataset's values and attributes, and the root attributes but ``created``."""
    out = {}
    with h5py.File(path, "r") as f:
        def visit(name, obj):
            if isinstance(obj, h5py.Dataset):
                out[name] = (obj[()], {k: np.asarray(v) for k, v in obj.attrs.items()})
        f.visititems(visit)
        root = {k: v for k, v in f.attrs.items() if k != "created"}
    return out, root


def assert_same_file(a, b):
    da, ra = datasets(a)
    db, rb = datasets(b)
    assert sorted(da) == sorted(db)
    for name in da:
        assert da[name][0].dtype == db[name][0].dtype, name
        assert np.array_equal(da[name][0], db[name][0]), name
        assert sorted(da[name][1]) == sorted(db[name][1]), name
        for k in da[name][1]:
            assert np.array_equal(da[name][1][k], db[name][1][k]), (name, k)
    assert sorted(ra) == sorted(rb)
    for k in ra:
        assert np.array_equal(ra[k], rb[k]), k


def params_of(model, strategy):
    with strategy.gathered_parameters() as params:
        return np.array(params)


@pytest.mark.parametrize("name", ["ddp", "zero2", "zero3"])
def test_async_file_is_the_sync_file(name, mpi_tmp_path):
    model, strategy = make(name)
    strategy.optimize(model, make_data(), epochs=1, batch_size=BATCH)
    sync = save_checkpoint(mpi_tmp_path / "sync.h5", model, strategy)
    path = save_checkpoint(mpi_tmp_path / "async.h5", model, strategy, asynchronous=True)
    before = params_of(model, strategy)
    strategy.optimize(model, make_data(), epochs=2, batch_size=BATCH)   # changes the state
    assert not np.array_equal(before, params_of(model, strategy))
    assert wait_for_checkpoint() == path
    assert background.pending_checkpoint() is None
    if WORLD.rank == 0:
        assert_same_file(sync, path)
        verify_checkpoint(path)
        assert not [n for n in os.listdir(mpi_tmp_path) if ".tmp-" in n]
    WORLD.Barrier()


@pytest.mark.parametrize("tp", [1, 2])
def test_tensor_parallel_slices_land_where_the_sync_save_puts_them(tp, mpi_tmp_path):
    if WORLD.size % tp:
        pytest.skip(f"tp={tp} needs a world size divisible by it, got {WORLD.size}")
    dp = WORLD.size // tp
    if 48 % (2 * dp):
        pytest.skip(f"a global batch of 48 rows does not split over {dp} data-parallel "
                    f"ranks x 2 micro-batches")
    model, opt = hybrid(WORLD, tp, 1, "zero2", reduce_method="reduce_scatter")
    opt.optimize(model, mlp_data(), epochs=1, batch_size=48)
    sync = save_checkpoint(mpi_tmp_path / "sync.h5", model, opt)
    path = save_checkpoint(mpi_tmp_path / "async.h5", model, opt, asynchronous=True)
    wait_for_checkpoint()
    if WORLD.rank == 0:
        assert_same_file(sync, path)
    WORLD.Barrier()


@pytest.mark.parametrize("name", ["ddp", "zero3"])
def test_training_with_async_saves_ends_as_with_sync_saves(name, mpi_tmp_path):
    ends, files = {}, {}
    for mode in (False, True):
        folder = mpi_tmp_path / f"async-{mode}"
        manager = CheckpointManager(folder, keep=None, async_=mode)
        model, strategy = make(name)
        result = strategy.optimize(model, make_data(), epochs=3, batch_size=BATCH,
                                   checkpoints=manager, checkpoint_every=2)
        assert background.pending_checkpoint() is None   # committed by the end
        ends[mode] = params_of(model, strategy)
        files[mode] = manager.checkpoints()
        assert result.checkpoint == files[mode][-1][1]
    assert np.array_equal(ends[False], ends[True])
    assert [s for s, _ in files[False]] == [s for s, _ in files[True]] == [2, 4, 6, 8, 10, 12]
    if WORLD.rank == 0:
        for (_, a), (_, b) in zip(files[False], files[True]):
            assert_same_file(a, b)
    WORLD.Barrier()


@pytest.mark.parametrize("name", ["ddp", "zero2", "zero3"])
def test_resume_from_an_async_checkpoint_continues_exactly(name, mpi_tmp_path):
    data = make_data()
    model, strategy = make(name)
    strategy.optimize(model, data, epochs=3, batch_size=BATCH)
    reference = params_of(model, strategy)

    model, strategy = make(name)
    strategy.optimize(model, data, epochs=1, batch_size=BATCH)
    path = save_checkpoint(mpi_tmp_path / "mid.h5", model, strategy, asynchronous=True)
    strategy.optimize(model, data, epochs=2, batch_size=BATCH)   # the write overlaps this
    model, strategy = make(name)
    info = load_checkpoint(path, model, strategy)   # commits the save first
    assert info.step == 4 and strategy.step_count == 4
    strategy.optimize(model, data, epochs=3, batch_size=BATCH)
    assert np.array_equal(params_of(model, strategy), reference)


def test_failed_background_write_is_raised_on_every_rank(mpi_tmp_path, monkeypatch):
    model, strategy = make("zero2")
    strategy.optimize(model, make_data(), epochs=1, batch_size=BATCH)
    good = save_checkpoint(mpi_tmp_path / "good.h5", model, strategy)
    if WORLD.rank == WORLD.size - 1:
        def failing(*args):
            raise OSError(28, "No space left on device (injected)")
        monkeypatch.setattr(background.os, "pwrite", failing)
    path = save_checkpoint(mpi_tmp_path / "bad.h5", model, strategy, asynchronous=True)
    with pytest.raises(CheckpointError, match=f"failed on rank {WORLD.size - 1}.*injected"):
        wait_for_checkpoint()
    monkeypatch.undo()
    assert background.pending_checkpoint() is None
    WORLD.Barrier()
    assert not os.path.exists(path)
    assert not [n for n in os.listdir(mpi_tmp_path) if ".tmp-" in n]
    load_checkpoint(good, model, strategy)   # the previous one is untouched


def test_failure_is_raised_at_the_next_save(mpi_tmp_path, monkeypatch):
    model, strategy = make("ddp")
    strategy.optimize(model, make_data(), epochs=1, batch_size=BATCH)
    if WORLD.rank == 0:
        monkeypatch.setattr(background.os, "fsync",
                            lambda fd: (_ for _ in ()).throw(OSError(5, "I/O error (injected)")))
    save_checkpoint(mpi_tmp_path / "a.h5", model, strategy, asynchronous=True)
    with pytest.raises(CheckpointError, match="failed on rank 0"):
        save_checkpoint(mpi_tmp_path / "b.h5", model, strategy, asynchronous=True)
    monkeypatch.undo()
    assert background.pending_checkpoint() is None   # the failed call started nothing
    path = save_checkpoint(mpi_tmp_path / "b.h5", model, strategy, asynchronous=True)
    assert wait_for_checkpoint() == path and os.path.exists(path)


def test_manager_prunes_only_after_the_newer_file_is_durable(mpi_tmp_path):
    model, strategy = make("zero2")
    manager = CheckpointManager(mpi_tmp_path, keep=1, async_=True)
    strategy.optimize(model, make_data(), epochs=1, batch_size=BATCH)
    first = manager.save(model, strategy)
    assert manager.wait() == first
    strategy.optimize(model, make_data(), epochs=2, batch_size=BATCH)
    second = manager.save(model, strategy)
    # In flight: the older is still the latest complete one, and kept.
    assert os.path.exists(first) and not os.path.exists(second)
    assert manager.latest() == first
    WORLD.Barrier()
    assert manager.wait() == second
    assert os.path.exists(second) and not os.path.exists(first)
    assert [p for _, p in manager.checkpoints()] == [second]


def test_discarded_save_leaves_no_file(mpi_tmp_path):
    model, strategy = make("ddp")
    strategy.optimize(model, make_data(), epochs=1, batch_size=BATCH)
    path = save_checkpoint(mpi_tmp_path / "dropped.h5", model, strategy, asynchronous=True)
    assert background.discard_checkpoint() == path   # local: what a recovery does
    assert background.pending_checkpoint() is None and wait_for_checkpoint() is None
    WORLD.Barrier()
    assert not os.listdir(mpi_tmp_path)
    path = save_checkpoint(mpi_tmp_path / "next.h5", model, strategy, asynchronous=True)
    assert wait_for_checkpoint() == path and os.path.exists(path)


def test_elastic_stop_while_a_save_is_in_flight_completes_it(mpi_tmp_path, monkeypatch):
    # A resize (request_stop, as SIGUSR1) right after an interval save started: the
    # stop's checkpoint commits the save in flight first, and both are complete on
    # disk when optimize() returns, for the agent's relaunch.
    monkeypatch.setenv(background.SLOW_ENV, "32,0.02")   # about a second per save
    model = MLP(SIZES, activation="tanh", seed=7, dtype=np.float64)
    opt = ElasticOptimizer(AdamW(lr=3e-3), ShardingConfiguration(WORLD),
                           checkpoint_dir=str(mpi_tmp_path), checkpoint_every=2, keep=None)
    assert opt.manager.async_
    in_flight = []

    def callback(step, loss):
        if step == 3:
            in_flight.append(background.pending_checkpoint())
            opt.request_stop("resize")

    result = opt.optimize(model, make_data(), epochs=3, batch_size=BATCH, callback=callback)
    assert opt.stop_reason == "resize" and opt.exit_code == 75
    assert in_flight == [str(mpi_tmp_path / "ckpt-0000000002.h5")]
    assert background.pending_checkpoint() is None
    assert [s for s, _ in opt.manager.checkpoints()] == [2, 3]
    assert result.checkpoint == str(mpi_tmp_path / "ckpt-0000000003.h5")
    if WORLD.rank == 0:
        for _, path in opt.manager.checkpoints():
            verify_checkpoint(path)
        assert not [n for n in os.listdir(mpi_tmp_path) if ".tmp-" in n]
    fresh = MLP(SIZES, activation="tanh", seed=8, dtype=np.float64)
    load_checkpoint(result.checkpoint, fresh)
    assert np.array_equal(fresh.params, model.params)


def test_saves_count_their_memory_without_tracemalloc(mpi_tmp_path, monkeypatch):
    """tracemalloc made rank 0's HDF5 layout about three times as slow (35
    against 13 ms CPU, 25M MLP): both saves are counted in the "save" phase
    without it (the synchronous one was traced until it failed here),
    ``allocated_save`` being the growth of the resident memory."""
    import tracemalloc

    from mpishard.checkpoint import state

    model, strategy = make("zero3")
    strategy.optimize(model, make_data(), epochs=1, batch_size=24)
    tracing = []
    for name in ("write_checkpoint_file", "start_background_write"):
        real = getattr(state, name)
        monkeypatch.setattr(state, name, lambda *a, real=real, **k: (
            tracing.append(tracemalloc.is_tracing()), real(*a, **k))[1])
    save_checkpoint(mpi_tmp_path / "async.h5", model, strategy, asynchronous=True)
    wait_for_checkpoint()
    save_checkpoint(mpi_tmp_path / "sync.h5", model, strategy)
    assert tracing == [False, False] and not tracemalloc.is_tracing()
    report = strategy.memory_report()
    assert report["peak_save"] > 0 and report["rss_peak_save"] > 0
    if os.path.exists("/proc/self/clear_refs"):
        assert 0 <= report["allocated_save"] < report["rss_peak_save"]


def _count_collectives(monkeypatch):
    """The outermost collective calls of every FlatComm, by name, in order."""
    from mpishard.comm import FlatComm

    calls, depth = [], [0]
    for name in ("allgather", "bcast", "dup", "allreduce", "Allreduce", "first_finding",
                 "agree", "Barrier", "Allgatherv", "Bcast"):
        real = getattr(FlatComm, name, None)
        if real is None:
            continue

        def counted(self, *args, real=real, name=name, **kwargs):
            depth[0] += 1
            try:
                if depth[0] == 1:
                    calls.append(name)
                return real(self, *args, **kwargs)
            finally:
                depth[0] -= 1

        monkeypatch.setattr(FlatComm, name, counted)
    return calls


def test_a_save_synchronises_the_ranks_only_where_it_must(mpi_tmp_path, monkeypatch):
    """The asynchronous call: the agreement on the model, the save's duplicate
    of the world, the datasets and their coverage (one allgather), rank 0's
    layout (one broadcast); a rank that cannot open the file is agreed on at
    the commit. The commit and the synchronous seal: the checksums with the
    count of failures (one Allreduce), then rank 0's outcome. (7 and 10 before.)"""
    if WORLD.size == 1:
        pytest.skip("one process holds no collective")
    model, strategy = make("ddp")
    strategy.optimize(model, make_data(), epochs=1, batch_size=24)
    calls = _count_collectives(monkeypatch)
    save_checkpoint(mpi_tmp_path / "async.h5", model, strategy, asynchronous=True)
    assert calls == ["first_finding", "dup", "allgather", "bcast"]
    del calls[:]
    wait_for_checkpoint()
    assert calls == ["Allreduce", "first_finding"]
    del calls[:]
    save_checkpoint(mpi_tmp_path / "sync.h5", model, strategy)
    assert calls == ["first_finding", "dup", "allgather", "bcast", "Allreduce", "first_finding"]
    monkeypatch.undo()
    if WORLD.rank == 0:
        for name in ("async.h5", "sync.h5"):
            verify_checkpoint(mpi_tmp_path / name)
