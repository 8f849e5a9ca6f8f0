"""Training data of every kind feeding a model on each array backend (``xp``).

Run under ``mpirun -n N python -m pytest --with-mpi`` for N = 1, 2, 3, 4. Each
test trains with ``optimize()`` (DDP, both ZeRO-2 reduce methods, the hybrid
strategy) a model on ``xp`` (NumPy here; CuPy, marked ``gpu``, where a device
is) from data held on the host or on ``xp`` (arrays, a growing dataset, a batch
stream, rank-local rows, an HDF5 file), and compares the parameters with one
NumPy process stepping through the same global batches (float64, rtol 1e-10).
The CuPy cases are the ones that failed before (``TypeError: Implicit
conversion to a NumPy array`` in the gather); their NumPy twins run the same
code path through ``xp`` here.
"""

from __future__ import annotations

import functools
import gc

import numpy as np
import pytest
from mpi4py import MPI
from strategies import STRATEGIES, whole
from worlds import batch_splits

from mpishard import ShardingConfiguration
from mpishard.backend import to_numpy
from mpishard.data import (
    ArrayDataset,
    BatchStream,
    LocalDataset,
    ShardedSampler,
    StreamingDataset,
    rank_rows,
)
from mpishard.nn import MLP, ParallelMLP
from mpishard.optim import Adam
from mpishard.strategies import HybridShardedModel, HybridShardedOptimizer

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD
SIZES = [6, 9, 4]          # 6*9+9 + 9*4+4 = 103 parameters: no multiple of 2, 3 or 4
BATCH, SAMPLES = 12, 60    # 5 batches an epoch
EPOCHS = 2


def make_data(seed: int = 5) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((SAMPLES, SIZES[0]))
    y = np.argmax(x @ rng.standard_normal((SIZES[0], SIZES[-1])), axis=1)
    return x, y


def model_on(xp, **parallel):
    """The MLP on ``xp``; with ``tp_comm``/``stage_layers`` the hybrid's ParallelMLP
    (whose parameters at tensor size 1 equal the MLP's)."""
    cls = ParallelMLP if parallel else MLP
    return cls(SIZES, activation="gelu", dtype=np.float64, seed=11, xp=xp, **parallel)


def make_opt() -> Adam:
    return Adam(lr=1e-2)


def reference(batches) -> np.ndarray:
    """One NumPy process stepping through ``batches`` (global ``(x, y)`` pairs)."""
    model, opt = model_on(np), make_opt()
    state = opt.init_state(model.params.size, model.params.dtype, np)
    for step, (x, y) in enumerate(batches, start=1):
        model.forward_backward(x, y)
        opt.update(model.params, model.grads, state, step, opt.lr)
    return model.params.copy()


def sampled_batches(x: np.ndarray, y: np.ndarray, seed: int = 0):
    sampler = ShardedSampler(len(x), BATCH, seed=seed)
    for _ in range(EPOCHS * sampler.batches_per_epoch):
        idx = sampler.batch_indices(0, BATCH)
        yield x[idx], y[idx]
        sampler.advance()


def data_parallel(name: str, xp, config, **options):
    """``STRATEGIES[name]`` for a model on ``xp``. ZeRO-2's ring sums host arrays:
    on CuPy it is refused on every rank (test_the_ring_refuses_device_arrays), so a
    CuPy case of it has nothing to train."""
    if name == "zero2-ring" and xp is not np:
        pytest.skip("reduce_method='ring' sums host (NumPy) arrays; on CuPy it is "
                    "refused (test_the_ring_refuses_device_arrays)")
    return STRATEGIES[name](make_opt(), config, **options)


def strategy_for(name: str, model):
    config = ShardingConfiguration(WORLD)
    if name == "hybrid":
        # tensor x pipeline x data = 1 x 1 x world: the hybrid's own data path
        sharded = HybridShardedModel(functools.partial(model_on, model.xp), config)
        return sharded, HybridShardedOptimizer(make_opt(), config, data_parallel="zero2",
                                               model=sharded)
    return model, data_parallel(name, model.xp, config, bucket_mb=1e-4)


ALL = [*STRATEGIES, "hybrid"]


def check(dist, expected) -> None:
    np.testing.assert_allclose(whole(dist), expected, rtol=1e-10, atol=1e-12)


@batch_splits(BATCH)
@pytest.mark.parametrize("strategy", ALL)
@pytest.mark.parametrize("where", ["device", "host"])
def test_arrays(xp, strategy, where):
    """Arrays on the model's backend (gathered there) or on the host (copied up)."""
    x, y = make_data()
    expected = reference(sampled_batches(x, y))
    model, dist = strategy_for(strategy, model_on(xp))
    data = (xp.asarray(x), xp.asarray(y)) if where == "device" else (x, y)
    result = dist.optimize(model, data, epochs=EPOCHS, batch_size=BATCH)
    assert result.steps == EPOCHS * SAMPLES // BATCH
    check(dist, expected)


@batch_splits(BATCH)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_device_data_of_another_dtype_is_cast(xp, strategy):
    """float32 inputs into a float64 model: the cast happens in the gather."""
    x, y = make_data()
    x32 = x.astype(np.float32)
    expected = reference(sampled_batches(x32.astype(np.float64), y))
    model, dist = strategy_for(strategy, model_on(xp))
    dist.optimize(model, ArrayDataset(xp.asarray(x32), xp.asarray(y)), epochs=EPOCHS,
                  batch_size=BATCH)
    check(dist, expected)


@batch_splits(BATCH)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_streaming_dataset(xp, strategy):
    """Rows appended between calls; each call trains one more epoch over all of them."""
    x, y = make_data()
    half = SAMPLES // 2
    data = StreamingDataset(x[:half], y[:half])
    model, dist = strategy_for(strategy, model_on(xp))
    dist.optimize(model, data, epochs=1, batch_size=BATCH)
    data.append(x[half:], y[half:])
    dist.optimize(model, data, epochs=2, batch_size=BATCH)
    batches = []   # epoch e over the n samples present at its start: order (seed 0, e)
    for epoch, n in ((0, half), (1, SAMPLES)):
        order = np.random.default_rng([0, epoch]).permutation(n)
        batches += [(x[order[b:b + BATCH]], y[order[b:b + BATCH]])
                    for b in range(0, n - BATCH + 1, BATCH)]
    check(dist, reference(batches))


@pytest.mark.parametrize("strategy", ALL)
@pytest.mark.parametrize("local", [False, True])
def test_batch_stream(xp, strategy, local):
    """Global batches on ``xp`` as they arrive (or each rank's own rows of them)."""
    x, y = make_data()
    batches = [(x[k:k + BATCH], y[k:k + BATCH]) for k in range(0, SAMPLES, BATCH)]
    model, dist = strategy_for(strategy, model_on(xp))
    dp = dist.config.groups.dp

    def arriving():
        for bx, by in batches:
            if local:
                lo, hi = rank_rows(len(bx), dp.size, dp.rank)
                bx, by = bx[lo:hi], by[lo:hi]
            yield xp.asarray(bx), xp.asarray(by)

    result = dist.optimize(model, BatchStream(arriving(), local=local))
    assert result.stopped == "exhausted" and result.steps == len(batches)
    check(dist, reference(batches))


@batch_splits(BATCH)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_local_rows(xp, strategy):
    """Rank-local host rows, moved by Alltoallv, into a model on ``xp``."""
    x, y = make_data()
    expected = reference(sampled_batches(x, y))
    model, dist = strategy_for(strategy, model_on(xp))
    dp = dist.config.groups.dp
    lo, hi = rank_rows(SAMPLES, dp.size, dp.rank)
    data = LocalDataset(x[lo:hi], y[lo:hi], dist.config)
    dist.optimize(model, data, epochs=EPOCHS, batch_size=BATCH)
    check(dist, expected)


@batch_splits(BATCH)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_hdf5_file(xp, strategy, tmp_path_factory):
    """Rows read from an HDF5 file, each rank its own, into a model on ``xp``."""
    h5py = pytest.importorskip("h5py")
    from mpishard.data import HDF5Dataset

    x, y = make_data()
    y = np.eye(SIZES[-1])[y]   # regression targets: the MLP with an MSE loss
    path = None
    if WORLD.rank == 0:
        path = str(tmp_path_factory.mktemp("h5") / "rows.h5")
        with h5py.File(path, "w") as f:
            f["x"], f["y"] = x, y
    path = WORLD.bcast(path, root=0)

    def mse(xp_):
        return MLP(SIZES, activation="tanh", loss="mse", dtype=np.float64, seed=2, xp=xp_)

    ref, opt = mse(np), make_opt()
    state = opt.init_state(ref.params.size, ref.params.dtype, np)
    for step, (bx, by) in enumerate(sampled_batches(x, y), start=1):
        ref.forward_backward(bx, by)
        opt.update(ref.params, ref.grads, state, step, opt.lr)
    model = mse(xp)
    dist = data_parallel(strategy, xp, ShardingConfiguration(WORLD))
    with HDF5Dataset(path, "/x", "/y", comm=dist.config.world) as data:
        dist.optimize(model, data, epochs=EPOCHS, batch_size=BATCH)
    check(dist, ref.params)


def test_row_mover_casts_and_reuses_its_buffers(xp):
    """The mover behind every dataset: rows cast into the buffer's dtype, the same
    buffers (device indices, pinned staging) reused batch after batch. Local."""
    from mpishard.data.transfer import RowMover

    rng = np.random.default_rng(0)
    host = rng.standard_normal((20, 3))
    mover = RowMover()
    out = xp.empty((7, 3), dtype=np.float32)
    seen = set()
    for _ in range(3):
        idx = rng.permutation(20)[:7]
        for source in (host, xp.asarray(host)):
            mover.take(source, idx, out)
            np.testing.assert_array_equal(to_numpy(out), host[idx].astype(np.float32))
        mover.put(host[idx][::-1].copy(), out, order=np.arange(6, -1, -1))
        np.testing.assert_array_equal(to_numpy(out), host[idx].astype(np.float32))
        seen.add(tuple(id(v[0]) for v in mover._pinned.values()))
        if mover._index is not None:
            seen.add(("index", id(mover._index)))
    # One set of buffers, made at the first batch (NumPy has none to make).
    assert len({s for s in seen if s and s[0] != "index"}) <= 1
    assert len({s for s in seen if s and s[0] == "index"}) <= 1


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("kernels", ["0", "1"])
@pytest.mark.parametrize("model_name", ["mlp", "gpt"])
def test_no_allocation_in_the_step_loop(strategy, kernels, model_name, monkeypatch):
    """CuPy's memory pool holds no more bytes after step 30 than after step 3:
    nothing is allocated and kept in the step loop (host data, device model)."""
    from backends import cupy_or_skip as _cupy_or_skip

    from mpishard.nn import GPT

    cp = _cupy_or_skip()
    monkeypatch.setenv("MPISHARD_GPU_KERNELS", kernels)
    rng = np.random.default_rng(0)
    if model_name == "mlp":
        model = MLP([32, 64, 64, 8], activation="gelu", layer_norm=True, dtype=np.float32,
                    xp=cp)
        x = rng.standard_normal((960, 32)).astype(np.float32)
        y = rng.integers(0, 8, 960)
    else:
        model = GPT(40, 16, 32, 4, 2, dtype=np.float32, xp=cp)
        x = rng.integers(0, 40, (960, 16))
        y = rng.integers(0, 40, (960, 16))
    pool = cp.get_default_memory_pool()
    used = {}

    def record(step, loss):
        if step in (3, 30):
            cp.cuda.get_current_stream().synchronize()
            gc.collect()        # what only the cyclic collector frees is not kept
            used[step] = pool.used_bytes()

    dist = data_parallel(strategy, cp, ShardingConfiguration(WORLD), bucket_mb=0.01)
    dist.optimize(model, (x, y), epochs=1, batch_size=32, callback=record)
    # Nothing kept: no more bytes in use after step 30 than after step 3. (On an
    # H100 some runs of the GPT at 2 ranks held 4.7 MB more at step 3 than at 30:
    # a transient of the first steps, not kept.)
    assert set(used) == {3, 30} and used[30] <= used[3], used


@pytest.mark.gpu
def test_the_ring_refuses_device_arrays():
    """ZeRO-2's reduce_method="ring" adds host (NumPy) buffers: a CuPy model is an
    error naming both, raised on every rank (no rank left waiting)."""
    from backends import cupy_or_skip as _cupy_or_skip

    cp = _cupy_or_skip()
    x, y = make_data()
    dist = STRATEGIES["zero2-ring"](make_opt(), ShardingConfiguration(WORLD))
    with pytest.raises(ValueError, match=r"reduce_method='ring' sums host \(NumPy\) arrays, "
                                         "got CuPy ones"):
        dist.optimize(model_on(cp), (x, y), epochs=1, batch_size=BATCH)
    WORLD.Barrier()
