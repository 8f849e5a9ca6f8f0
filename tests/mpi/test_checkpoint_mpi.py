"""Parallel checkpoints: save on every rank, load at another size and strategy, go on.

Run under ``mpirun -n N python -m pytest --with-mpi -m mpi`` for N = 1, 2, 4 (and
8 for the 3D layouts). A file is written by all N ranks of ``COMM_WORLD`` with
each strategy of the registry (DDP, ZeRO-2, ZeRO-3: ``tests/support/strategies.py``);
it is loaded by the first M ranks (a sub-communicator of size M = 1, 2, 3, 4 <= N)
with each strategy (at M = 1 and 2 the writer's own, and one other pair each),
and training goes on. Each test computes its reference in
the same run: the same training never stopped, on all N ranks with the writer's
strategy, and the saved state handed to the reader's strategy in memory.

Tolerances: right after a load the parameters, the optimizer state, the step
and the data position equal the saved ones *exactly*, and the continued training
equals, bit for bit, the same state handed to the new layout in memory without
a file. Against the uninterrupted run it is bit for bit where the reader sums as
the writer did (the same ranks and strategy, or two sharded strategies with the
same reduce method, or one rank), and rtol 1e-10 (float64) otherwise, since a
different number of ranks sums the gradients in another order.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import h5py
import numpy as np
import pytest
from layouts import assert_slices, hybrid, mlp_data, mlp_factory
from mpi4py import MPI
from strategies import NAMES, SHARDED, build, whole
from worlds import batch_splits

from mpishard import CheckpointError, ShardingConfiguration
from mpishard.checkpoint import CheckpointManager, load_checkpoint, save_checkpoint
from mpishard.nn import MLP, FunctionModel
from mpishard.optim import SGD, AdamW
from mpishard.optim.schedules import CosineSchedule
from mpishard.strategies import STRATEGIES as REGISTRY
from mpishard.strategies import DDPOptimizer, ZeRO2Optimizer, ZeRO3Optimizer

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD
# 5*7+7 + 7*7+7 + 7*3+3 = 122 parameters: shards of 1, 2, 3, 4 ranks never align
# with tensor boundaries.
SIZES = [5, 7, 7, 3]
BATCH = 24                   # splits over 1, 2, 3 and 4 ranks
EPOCHS = 3                   # 96 samples: 4 steps per epoch, 12 in all
STOP = 6                     # the save: step 6, halfway through epoch 1
SCHEDULE = CosineSchedule(total_steps=12, warmup_steps=2)
# The data position at the save (strategy.data_position, the file's /data).
POSITION = {"epoch": 1, "samples_consumed": 48, "seed": 0, "batch_size": BATCH,
            "num_samples": 96, "shuffle": 1}


class Stop(Exception):
    """Raised from optimize()'s callback: a job that ends after step STOP."""


def make_data(n=96, features=5, classes=3, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, features))
    y = np.argmax(x @ rng.standard_normal((features, classes)), axis=1)
    return x, y


def make_model(seed=7):
    return MLP(SIZES, activation="tanh", seed=seed, dtype=np.float64)


def make_strategy(name, comm):
    kw = {"reduce_method": "reduce_scatter"} if name in SHARDED else {}
    return build(name, AdamW(lr=3e-3, weight_decay=0.05), ShardingConfiguration(comm),
                 schedule=SCHEDULE, bucket_mb=1e-4, **kw)


def train(strategy, model, epochs, stop=None):
    """optimize() for ``epochs`` epochs, or until step ``stop``; the losses."""
    losses = []

    def callback(step, loss):
        losses.append(loss)
        if step == stop:
            raise Stop

    try:
        strategy.optimize(model, make_data(), epochs=epochs, batch_size=BATCH, callback=callback)
    except Stop:
        pass
    return losses


def full_state(strategy):
    return {k: np.array(v) for k, v in strategy.synchronize_optimizer_state().items()}


_REFERENCES: dict[str, tuple] = {}


def reference(writer):
    """The uninterrupted run on all ranks (computed once per strategy)."""
    if writer not in _REFERENCES:
        model = make_model()
        strategy = make_strategy(writer, WORLD)
        losses = train(strategy, model, EPOCHS)
        assert strategy.step_count == 12
        _REFERENCES[writer] = (whole(strategy), np.array(losses), full_state(strategy))
    return _REFERENCES[writer]


def handed_over(reader, comm, params, state):
    """The reference for a resumed run: the saved state copied into a new strategy
    in memory (no file), then trained to the end."""
    model = make_model(seed=98)
    model.params[...] = params
    strategy = make_strategy(reader, comm)
    strategy.attach(model)
    r, mine = strategy.optimizer_state_shard()
    for k in mine:
        mine[k][...] = state[k][r.start:r.stop]
    strategy.step_count = STOP
    strategy.data_position = dict(POSITION)
    return strategy, train(strategy, model, EPOCHS)   # epochs: the total


def sub_communicator(m):
    """The first ``m`` ranks of the world, or COMM_NULL on the others."""
    return WORLD.Split(0 if WORLD.rank < m else MPI.UNDEFINED, WORLD.rank)


def shared_folder(mpi_tmp_path):
    return str(mpi_tmp_path)


def no_mpi_h5py(monkeypatch):
    class NoMPI:
        mpi = False

    monkeypatch.setattr(h5py, "get_config", lambda: NoMPI())


# Every writer x reader pair at 3 and 4 readers; at 1 and 2 the writer's own strategy
# (the cross pairs at 1 and 2 readers: the serial and no-mpi-h5py cases below).
CASES = [(w, r, m, "auto") for w in NAMES for r in NAMES for m in (1, 2, 3, 4)
         if m >= 3 or w == r]
CASES += [("zero2", "ddp", m, "serial") for m in (1, 3)] + [("ddp", "zero2", 2, "no-mpi-h5py")]


# Loading at m ranks needs a world of at least m.
@batch_splits(BATCH)
@pytest.mark.parametrize("writer,reader,m,driver",
                         [pytest.param(*case, marks=pytest.mark.mpi(min_size=case[2]))
                          for case in CASES])
def test_resume_at_any_size_and_strategy(writer, reader, m, driver, mpi_tmp_path, monkeypatch):
    if driver == "no-mpi-h5py":
        no_mpi_h5py(monkeypatch)      # "auto" must fall back to the rank-0 writer
    ref_params, ref_losses, ref_state = reference(writer)
    path = os.path.join(shared_folder(mpi_tmp_path), "step6.h5")

    model = make_model()
    strategy = make_strategy(writer, WORLD)
    first = train(strategy, model, EPOCHS, stop=STOP)
    np.testing.assert_array_equal(first, ref_losses[:STOP])
    save_checkpoint(path, model, strategy, driver="auto" if driver == "no-mpi-h5py" else driver)
    saved_params, saved_state = whole(strategy), full_state(strategy)
    # The file holds the logical tensors, whatever held them.
    if WORLD.rank == 0:
        with h5py.File(path, "r") as f:
            for spec in make_model().layout:
                np.testing.assert_array_equal(
                    f[f"params/{spec.name}"][...],
                    saved_params[spec.offset:spec.offset + spec.size].reshape(spec.shape))
                np.testing.assert_array_equal(
                    f[f"optimizer/exp_avg/{spec.name}"][...].ravel(),
                    saved_state["exp_avg"][spec.offset:spec.offset + spec.size])

    comm = sub_communicator(m)
    if comm != MPI.COMM_NULL:
        fresh = make_model(seed=99)                       # other parameters: they must be loaded
        resumed = make_strategy(reader, comm)
        info = load_checkpoint(path, fresh, resumed)
        assert info.step == resumed.step_count == STOP
        assert info.lr == strategy.current_lr() == resumed.current_lr()
        assert info.schedule == SCHEDULE.to_dict()
        assert info.layout == {"world_size": WORLD.size, "dp": WORLD.size, "tp": 1, "pp": 1,
                               "strategy": writer}
        assert resumed.data_position == POSITION
        if REGISTRY[reader].cost.sharded_params:    # loaded into the shard, not the model
            assert fresh.params is None and len(resumed.core.parameter_shard()[1]) == \
                len(resumed.core.shard)
        np.testing.assert_array_equal(whole(resumed), saved_params)
        loaded = full_state(resumed)
        assert sorted(loaded) == sorted(saved_state) == ["exp_avg", "exp_avg_sq"]
        for k in saved_state:
            np.testing.assert_array_equal(loaded[k], saved_state[k])
        rest = train(resumed, fresh, EPOCHS)   # epochs is the total: the rest of the run
        assert resumed.step_count == 12 and len(rest) == 12 - STOP
        # Exact: the same as handing the state over in memory, without a file.
        twin, twin_losses = handed_over(reader, comm, saved_params, saved_state)
        np.testing.assert_array_equal(whole(resumed), whole(twin))
        np.testing.assert_array_equal(rest, twin_losses)
        # Equal bits where the sums are: same ranks, gradients cut alike (ZeRO's row blocks).
        same_sums = m == WORLD.size and (reader == writer or {reader, writer} <= set(SHARDED))
        if same_sums:
            np.testing.assert_array_equal(whole(resumed), ref_params)
            np.testing.assert_array_equal(rest, ref_losses[STOP:])
        np.testing.assert_allclose(whole(resumed), ref_params, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(rest, ref_losses[STOP:], rtol=1e-12)
        final = full_state(resumed)
        for k in ref_state:
            np.testing.assert_allclose(final[k], ref_state[k], rtol=1e-9, atol=1e-15)
        resumed.verify_in_sync()
        comm.Free()
    WORLD.Barrier()


@batch_splits(BATCH)
def test_plain_h5py_reads_what_all_ranks_wrote(mpi_tmp_path):
    model = make_model()
    strategy = make_strategy("zero2", WORLD)
    train(strategy, model, 1)
    path = save_checkpoint(os.path.join(str(mpi_tmp_path), "plain.h5"), model, strategy)
    state = full_state(strategy)
    if WORLD.rank == 0:
        with h5py.File(path, "r") as f:
            order = json.loads(f["params"].attrs["order"])
            assert order == list(model.layout.names)
            flat = np.concatenate([f[f"params/{n}"][...].ravel() for n in order])
            m = np.concatenate([f[f"optimizer/exp_avg_sq/{n}"][...].ravel() for n in order])
            assert int(f.attrs["world_size"]) == WORLD.size
            assert f.attrs["strategy"] == "zero2"
        np.testing.assert_array_equal(flat, model.params)
        np.testing.assert_array_equal(m, state["exp_avg_sq"])
    WORLD.Barrier()


@batch_splits(BATCH)
def test_damaged_data_fails_on_every_rank_and_changes_nothing(mpi_tmp_path):
    model = make_model()
    strategy = make_strategy("zero2", WORLD)
    train(strategy, model, 1)
    folder = str(mpi_tmp_path)
    path = save_checkpoint(os.path.join(folder, "good.h5"), model, strategy)
    bad = os.path.join(folder, "bad.h5")
    if WORLD.rank == 0:
        raw = bytearray(Path(path).read_bytes())
        with h5py.File(path, "r") as f:
            # The last element of the last tensor's state: read by the last rank only.
            at = f["optimizer/exp_avg/4.bias"].id.get_offset() + 2 * 8 + 5
        raw[at] ^= 0x01
        with open(bad, "wb") as out:
            out.write(raw)
    WORLD.Barrier()
    target = make_model(seed=3)
    victim = make_strategy("zero2", WORLD)
    victim.attach(target)
    before, state_before = target.params.copy(), full_state(victim)
    with pytest.raises(CheckpointError, match="corrupt data.*optimizer/exp_avg/4.bias") as err:
        load_checkpoint(bad, target, victim)
    assert bad in str(err.value)
    np.testing.assert_array_equal(target.params, before)
    for k, v in full_state(victim).items():
        np.testing.assert_array_equal(v, state_before[k])
    assert victim.step_count == 0 and victim.data_position is None
    other = MLP([5, 7, 3], seed=1)
    with pytest.raises(CheckpointError, match="a different model"):
        load_checkpoint(path, other, make_strategy("ddp", WORLD))
    with pytest.raises(CheckpointError, match="optimizer AdamW, loading into SGD"):
        load_checkpoint(path, make_model(), DDPOptimizer(SGD(lr=0.1, momentum=0.9),
                                                         ShardingConfiguration(WORLD)))
    with pytest.raises(FileNotFoundError):
        load_checkpoint(os.path.join(folder, "absent.h5"), make_model(), comm=WORLD)
    WORLD.Barrier()


@batch_splits(12)
def test_function_model_and_parameters_only(mpi_tmp_path):
    rng = np.random.default_rng(4)
    a = rng.standard_normal((48, 11))
    b = a @ rng.standard_normal(11)

    def f(p, x, y):
        r = x @ p - y
        return float(r @ r) / len(x), 2.0 * x.T @ r / len(x)

    model = FunctionModel(f, np.zeros(11))
    zero2 = ZeRO2Optimizer(SGD(lr=0.05, momentum=0.9), ShardingConfiguration(WORLD))
    zero2.optimize(model, (a, b), epochs=2, batch_size=12)
    path = save_checkpoint(os.path.join(str(mpi_tmp_path), "fm.h5"), model, zero2)
    params_only = save_checkpoint(os.path.join(str(mpi_tmp_path), "p.h5"), model)
    comm = sub_communicator(1)
    if comm != MPI.COMM_NULL:
        alone = FunctionModel(f, np.ones(11))
        ddp = DDPOptimizer(SGD(lr=0.05, momentum=0.9), ShardingConfiguration(comm))
        load_checkpoint(path, alone, ddp)
        np.testing.assert_array_equal(alone.params, model.params)
        assert ddp.step_count == zero2.step_count == 8
        comm.Free()
    again = FunctionModel(f, np.ones(11))
    info = load_checkpoint(params_only, again, comm=WORLD)
    assert info.optimizer is None
    np.testing.assert_array_equal(again.params, model.params)
    WORLD.Barrier()


@batch_splits(BATCH)
def test_manager_at_every_rank(mpi_tmp_path):
    folder = os.path.join(str(mpi_tmp_path), "run")
    model = make_model()
    strategy = make_strategy("zero2", WORLD)
    manager = CheckpointManager(folder, keep=2, durable=False)
    assert manager.load_latest(model, strategy) is None
    written = []
    for epochs in (1, 2, 3):   # epochs is the total: one more each time
        train(strategy, model, epochs)
        written.append(manager.save(model, strategy))
    assert [s for s, _ in manager.checkpoints()] == [8, 12]
    assert manager.latest() == written[-1]
    fresh, resumed = make_model(seed=5), make_strategy("ddp", WORLD)
    info = manager.load_latest(fresh, resumed)
    assert info.step == 12 and resumed.data_position["epoch"] == 3
    np.testing.assert_array_equal(fresh.params, model.params)
    WORLD.Barrier()


@pytest.mark.parametrize("name", [n for n in NAMES if REGISTRY[n].cost.sharded_params])
def test_without_the_strategy_is_a_clear_error(name, mpi_tmp_path):
    """A model whose parameters are sharded (ZeRO-3) holds no whole vector: saving
    or loading it without its strategy says what to do, on every rank."""
    model = make_model()
    strategy = make_strategy(name, WORLD)
    strategy.attach(model)
    path = os.path.join(str(mpi_tmp_path), "bare.h5")
    with pytest.raises(CheckpointError, match="gathered_parameters"):
        save_checkpoint(path, model)
    with strategy.gathered_parameters():
        save_checkpoint(path, model)            # the whole vector: a parameters-only file
    with pytest.raises(CheckpointError, match="gathered_parameters"):
        load_checkpoint(path, model)
    other = make_model(seed=3)
    load_checkpoint(path, other)
    np.testing.assert_array_equal(other.params, whole(strategy))
    WORLD.Barrier()


# --- tensor and pipeline parallelism: the same file format ------------------------

@pytest.mark.layout3d   # also at 8 ranks: tp2 x dp4 (the replicated copies kept equal)
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)], ids=["tp2", "pp2", "tp2-pp2"])
def test_tensor_and_pipeline_parallel_reshard(tp, pp, mpi_tmp_path):
    if WORLD.size % (tp * pp):
        pytest.skip(f"tp={tp} x pp={pp} does not divide a world of {WORLD.size}")
    dp_size = WORLD.size // (tp * pp)
    if 16 % WORLD.size or 16 % (dp_size * 2):     # layouts.hybrid: 2 micro-batches
        pytest.skip(f"its global batch of 16 rows does not split over the {WORLD.size} "
                    f"ranks of the whole model's DDP, or {dp_size} data-parallel ranks x "
                    f"2 micro-batches")
    folder = str(mpi_tmp_path)
    data = mlp_data()
    model, opt = hybrid(WORLD, tp, pp, "zero2")
    opt.optimize(model, data, epochs=1, batch_size=16)
    path = save_checkpoint(os.path.join(folder, "hybrid.h5"), model, opt)
    # The file holds logical tensors: every rank's slice, its part of the state.
    r, state = opt.optimizer_state_shard()
    with h5py.File(path, "r") as f:
        assert json.loads(f["params"].attrs["order"]) == list(mlp_factory()().layout.names)
        assert (int(f.attrs["tp"]), int(f.attrs["pp"])) == (tp, pp)
        for spec in model.layout:
            shard = model.tensor_shards()[spec.name]
            local = model.layout.view(model.params, spec.name)
            np.testing.assert_array_equal(f[f"params/{shard.logical_name}"][shard.index], local)
            part = spec.range.intersect(r)
            if len(part):
                logical = f[f"optimizer/exp_avg/{shard.logical_name}"][shard.index].ravel()
                np.testing.assert_array_equal(
                    logical[part.start - spec.offset:part.stop - spec.offset],
                    state["exp_avg"][part.start - r.start:part.stop - r.start])
    # The whole model with DDP over every rank loads it and goes on, as the
    # model-parallel run does: the same logical parameters (rtol 1e-10).
    whole = mlp_factory()(seed=9)
    ddp = DDPOptimizer(AdamW(lr=1e-2, weight_decay=0.01), ShardingConfiguration(WORLD))
    info = load_checkpoint(path, whole, ddp)
    assert info.layout["strategy"] == "hybrid-zero2" and ddp.step_count == opt.step_count == 3
    assert_slices(model, model.params, whole.params, whole.layout)
    opt.optimize(model, data, epochs=2, batch_size=16)     # epochs is the total
    ddp.optimize(whole, data, epochs=2, batch_size=16)
    assert ddp.step_count == opt.step_count == 6
    for name, shard in model.tensor_shards().items():
        np.testing.assert_allclose(model.layout.view(model.params, name),
                                   whole.layout.view(whole.params, shard.logical_name)[shard.index],
                                   rtol=1e-10, atol=1e-12)
    # And back: the whole model's file into a fresh model-parallel layout (DDP inside).
    back = save_checkpoint(os.path.join(folder, "whole.h5"), whole, ddp)
    other, other_opt = hybrid(WORLD, tp, pp, "ddp", seed_shift=1.0)
    load_checkpoint(back, other, other_opt)
    assert_slices(other, other.params, whole.params, whole.layout)
    for name, shard in other.tensor_shards().items():
        np.testing.assert_array_equal(
            other.layout.view(other_opt.state["exp_avg_sq"], name),
            whole.layout.view(ddp.state["exp_avg_sq"], shard.logical_name)[shard.index])
    assert other_opt.step_count == 6 and other_opt.data_position["epoch"] == 2
    WORLD.Barrier()


@pytest.mark.layout3d   # also at 8 ranks: tp2-pp2-dp2
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)],
                         ids=["tp1-pp1", "tp2", "pp2", "tp2-pp2"])
def test_3d_zero3_to_whole_zero3_and_back(tp, pp, mpi_tmp_path):
    """A tensor/pipeline-parallel ZeRO-3 run's file is loaded by ZeRO-3 on the
    whole model over every rank, both go on alike; the whole model's file is
    loaded back by a fresh 3D ZeRO-3 layout."""
    if WORLD.size % (tp * pp):
        pytest.skip(f"tp={tp} x pp={pp} does not divide a world of {WORLD.size}")
    dp_size = WORLD.size // (tp * pp)
    if 16 % WORLD.size or 16 % (dp_size * 2):     # layouts.hybrid: 2 micro-batches
        pytest.skip(f"its global batch of 16 rows does not split over the {WORLD.size} "
                    f"ranks of the whole model's ZeRO-3, or {dp_size} data-parallel ranks x "
                    f"2 micro-batches")
    folder = str(mpi_tmp_path)
    data = mlp_data()
    model, opt = hybrid(WORLD, tp, pp, "zero3", reduce_method="reduce_scatter")
    opt.optimize(model, data, epochs=1, batch_size=16)
    path = save_checkpoint(os.path.join(folder, "hybrid.h5"), model, opt)
    flat = mlp_factory()()
    plain = ZeRO3Optimizer(AdamW(lr=1e-2, weight_decay=0.01), ShardingConfiguration(WORLD),
                           reduce_method="reduce_scatter")
    info = load_checkpoint(path, flat, plain)
    assert info.layout["strategy"] == "hybrid-zero3" and plain.step_count == opt.step_count == 3
    with opt.gathered_parameters() as params:
        assert_slices(model, params, whole(plain), flat.layout, rtol=1e-12)
    opt.optimize(model, data, epochs=2, batch_size=16)     # epochs is the total
    plain.optimize(flat, data, epochs=2, batch_size=16)
    assert plain.step_count == opt.step_count == 6
    full = whole(plain)
    with opt.gathered_parameters() as params:
        assert_slices(model, params, full, flat.layout, rtol=1e-12)
    back = save_checkpoint(os.path.join(folder, "whole.h5"), flat, plain)
    other, other_opt = hybrid(WORLD, tp, pp, "zero3", seed_shift=1.0,
                              reduce_method="reduce_scatter")
    load_checkpoint(back, other, other_opt)
    with other_opt.gathered_parameters() as params:
        assert_slices(other, params, full, flat.layout, rtol=1e-12)
    assert other_opt.step_count == 6 and other_opt.data_position["epoch"] == 2
    WORLD.Barrier()
