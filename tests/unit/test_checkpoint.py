"""Checkpoints without an MPI world: pure arithmetic, damaged files, the model API,
the ``mpishard ckpt`` command.

Run with plain pytest. Whole ``mpirun`` jobs killed in the middle of a save:
``tests/jobs/test_checkpoint_killed.py``; the collective save/load at 1, 2 and 4
ranks: ``tests/mpi/test_checkpoint_mpi.py``.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from mpishard import CheckpointError, ShardingConfiguration
from mpishard.checkpoint import (
    CheckpointManager,
    inspect_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from mpishard.checkpoint.blocks import (
    block_size,
    flat_blocks,
    full_block,
    is_contiguous_run,
    share_of_block,
    split_block,
)
from mpishard.checkpoint.checksum import Checksum, block_checksum, run_checksum
from mpishard.checkpoint.collective import DRIVER_ENV, resolve_driver
from mpishard.checkpoint.container import seal_file, seal_image, verify_image
from mpishard.cli import main
from mpishard.models import (
    build_architecture,
    deserialize,
    load_model,
    load_model_into,
    model_from_bytes,
    save_model,
    serialize,
)
from mpishard.nn import (
    GELU,
    GPT,
    MLP,
    Dropout,
    FunctionModel,
    LayerNorm,
    Linear,
    Sequential,
    SoftmaxCrossEntropy,
)
from mpishard.optim import SGD, Adam
from mpishard.strategies import DDPOptimizer, ZeRO2Optimizer

MASK = (1 << 64) - 1


# --------------------------------------------------------------- pure arithmetic

def brute_checksum(values: np.ndarray, index: np.ndarray) -> Checksum:
    """The definition, element by element with Python integers: element ``i`` is
    ``u_i << (bits * (i % per))`` of 64-bit word ``i // per``; then sum(W) and
    sum((q + 1) * W) mod 2**64."""
    width = values.dtype.itemsize
    per = 8 // width
    total = weighted = 0
    for i, u in zip(index.ravel(), values.view(f"<u{width}").ravel()):
        c = int(u) << (8 * width * (int(i) % per))
        total += c
        weighted += (int(i) // per + 1) * c
    return Checksum(total & MASK, weighted & MASK)


def words_checksum(tensor: np.ndarray) -> Checksum:
    """The definition as stated: the tensor's bytes as zero-padded 64-bit words."""
    raw = np.ascontiguousarray(tensor).astype(tensor.dtype.newbyteorder("<")).tobytes()
    words = np.frombuffer(raw + bytes(-len(raw) % 8), dtype="<u8")
    total = sum(int(w) for w in words) & MASK
    weighted = sum((q + 1) * int(w) for q, w in enumerate(words)) & MASK
    return Checksum(total, weighted)


def test_flat_blocks_cover_the_range_in_order():
    rng = np.random.default_rng(0)
    for _ in range(300):
        shape = tuple(int(s) for s in rng.integers(1, 5, size=rng.integers(1, 5)))
        n = math.prod(shape)
        a, b = sorted(int(v) for v in rng.integers(0, n + 1, size=2))
        blocks = flat_blocks(a, b, shape)
        assert len(blocks) <= 2 * len(shape) - 1
        index = np.arange(n).reshape(shape)
        got = np.concatenate([index[blk].ravel() for blk in blocks]) if blocks else np.array([])
        np.testing.assert_array_equal(got, np.arange(a, b))
        assert all(is_contiguous_run(blk, shape) for blk in blocks)


def test_flat_blocks_example_and_errors():
    assert flat_blocks(3, 17, (4, 5)) == [(slice(0, 1), slice(3, 5)), (slice(1, 3), slice(0, 5)),
                                          (slice(3, 4), slice(0, 2))]
    assert flat_blocks(0, 1, ()) == [()]
    assert flat_blocks(2, 2, (4,)) == []
    with pytest.raises(ValueError, match="not inside"):
        flat_blocks(0, 21, (4, 5))


def test_split_block_keeps_every_element_once():
    shape = (6, 7, 5)
    block = (slice(1, 6), slice(0, 7), slice(0, 5))
    parts = split_block(block, 40)
    assert all(block_size(p) <= 40 for p in parts) and len(parts) == 5
    seen = np.zeros(shape, dtype=int)
    for p in parts:
        seen[p] += 1
    expect = np.zeros(shape, dtype=int)
    expect[block] = 1
    np.testing.assert_array_equal(seen, expect)


def test_shares_of_a_replicated_block_partition_it():
    shape = (4, 6, 5)
    block = (slice(1, 2), slice(1, 6), slice(0, 5))   # a tensor-parallel slice of row 1
    for parts in (1, 2, 3, 7):
        seen = np.zeros(shape, dtype=int)
        for part in range(parts):
            share = share_of_block(block, parts, part)
            if share is not None:
                seen[share] += 1
        expect = np.zeros(shape, dtype=int)
        expect[block] = 1
        np.testing.assert_array_equal(seen, expect)
    assert share_of_block((slice(2, 3),), 4, 0) == (slice(2, 3),)
    assert share_of_block((slice(2, 3),), 4, 1) is None


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_checksum_is_additive_and_positional(dtype):
    rng = np.random.default_rng(1)
    shape = (13, 7, 3)
    x = rng.standard_normal(shape).astype(dtype)
    index = np.arange(x.size).reshape(shape)
    whole = block_checksum(x, full_block(shape), shape)
    assert whole == brute_checksum(x, index) == words_checksum(x)
    # Any partition into flat ranges adds up to the whole.
    cuts = sorted(set(int(c) for c in rng.integers(0, x.size, size=6)) | {0, x.size})
    total = Checksum()
    for a, b in zip(cuts, cuts[1:]):
        for blk in flat_blocks(a, b, shape):
            total = total + block_checksum(x[blk], blk, shape)
    assert total == whole
    # A general (non-contiguous) hyperslab, as a tensor-parallel column slice.
    blk = (slice(2, 9), slice(1, 4), slice(0, 2))
    assert not is_contiguous_run(blk, shape)
    assert block_checksum(x[blk], blk, shape) == brute_checksum(x[blk], index[blk])
    # Chunked runs (longer than one 64K-word chunk), starting at an odd element and
    # unaligned in memory, against the definition.
    y = rng.standard_normal(140_003).astype(dtype)
    for first in (12345, 12346):
        index = np.arange(first, first + y.size - 1)
        assert run_checksum(y[1:], first) == brute_checksum(y[1:], index)
    # Moving data changes the positional half; altering data changes both.
    swapped = x.copy().ravel()
    swapped[[2, 4]] = swapped[[4, 2]]
    moved = block_checksum(swapped.reshape(shape), full_block(shape), shape)
    assert moved.total == whole.total and moved.weighted != whole.weighted


def test_seal_detects_any_change_outside_raw_data():
    image = bytearray(np.random.default_rng(2).integers(0, 256, 20000, dtype=np.uint8).tobytes())
    extents = [(8192, 4000), (14000, 1000)]
    seal_image(image, 4096, extents)
    assert verify_image(image) == 4096
    for at in (0, 20, 100, 4095, 4096, 8191, 12192, 13999, 15000, 19999):
        bad = bytearray(image)
        bad[at] ^= 0x40
        with pytest.raises(CheckpointError, match="<bytes>"):
            verify_image(bad)
    inside = bytearray(image)
    inside[9000] ^= 1   # raw data: covered by the dataset checksums instead
    assert verify_image(inside) == 4096


def test_driver_choice_and_the_one_line_warning(monkeypatch, capsys):
    # resolve_driver answers the driver a write uses: "auto" is "direct" (it needs
    # no MPI-IO), unless the variable names an HDF5 driver.
    from mpishard.checkpoint import collective

    monkeypatch.setattr(collective, "_warned", [])
    monkeypatch.delenv(DRIVER_ENV, raising=False)
    assert resolve_driver("auto", 1) == "direct"
    assert resolve_driver("auto", 4) == "direct"
    assert resolve_driver("serial", 1) == "serial"
    has_mpi = bool(h5py.get_config().mpi)
    monkeypatch.setenv(DRIVER_ENV, "serial")
    assert resolve_driver("auto", 4) == "serial"
    assert resolve_driver("direct", 4) == "direct"   # an explicit driver beats the variable
    if has_mpi:
        assert resolve_driver("mpio", 4) == "mpio"
    monkeypatch.setenv(DRIVER_ENV, "bogus")
    with pytest.raises(ValueError, match=DRIVER_ENV):
        resolve_driver("auto", 4)
    monkeypatch.delenv(DRIVER_ENV)

    class NoMPI:
        mpi = False

    monkeypatch.setattr(h5py, "get_config", lambda: NoMPI())
    assert resolve_driver("auto", 2) == "direct"
    with pytest.raises(ValueError, match="without MPI|no MPI"):
        resolve_driver("mpio", 2)
    err = capsys.readouterr().err.splitlines()
    assert sum("written through rank 0" in line for line in err) == 1


# ------------------------------------------------------------- files for the tests

SIZES = [5, 16, 16, 3]


def make_data(n=64, features=5, classes=3, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, features))
    return x, np.argmax(x @ rng.standard_normal((features, classes)), axis=1)


def trained(strategy_cls=DDPOptimizer, opt=lambda: Adam(lr=1e-2), seed=7, epochs=1):
    """A model and a strategy on COMM_SELF after ``epochs`` epochs."""
    model = MLP(SIZES, activation="tanh", seed=seed)
    strategy = strategy_cls(opt(), ShardingConfiguration(MPI.COMM_SELF))
    strategy.optimize(model, make_data(), epochs=epochs, batch_size=16)
    return model, strategy


@pytest.fixture(scope="module")
def base_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("base")
    model, strategy = trained(ZeRO2Optimizer, epochs=2)
    path = save_checkpoint(folder / "base.h5", model, strategy, comm=MPI.COMM_SELF)
    return path, model, strategy


def reseal(path):
    """Seal a file again after editing it with h5py (what a damaged-but-sealed file is)."""
    with h5py.File(path, "r") as f:
        ub = f.userblock_size
        extents = []

        def visit(_, obj):
            if isinstance(obj, h5py.Dataset) and obj.size:
                extents.append((obj.id.get_offset(), obj.id.get_storage_size()))
        f.visititems(visit)
    seal_file(path, ub, extents, durable=False)


def test_single_process_plain_h5py_reads_a_parameter(base_file):
    path, model, strategy = base_file
    with h5py.File(path, "r") as f:   # nothing but h5py: a laptop, a notebook
        assert f.attrs["format"] == "mpishard-checkpoint"
        assert int(f.attrs["step"]) == strategy.step_count == 8
        w = f["params/2.weight"][...]
        m = f["optimizer/exp_avg/2.weight"][...]
        assert f.userblock_size >= 4096
        assert json.loads(f["params"].attrs["order"]) == list(model.layout.names)
    np.testing.assert_array_equal(w, model.layout.view(model.params, "2.weight"))
    np.testing.assert_array_equal(m, model.layout.view(strategy.state["exp_avg"], "2.weight"))
    info = verify_checkpoint(path)
    assert info.data == {"epoch": 2, "samples_consumed": 0, "seed": 0, "batch_size": 16,
                         "num_samples": 64, "shuffle": True}
    assert info.optimizer["name"] == "Adam" and info.state_names == ["exp_avg", "exp_avg_sq"]
    assert info.layout == {"world_size": 1, "dp": 1, "tp": 1, "pp": 1, "strategy": "zero2"}
    rebuilt = load_model(path)   # the architecture is in the training checkpoint too
    np.testing.assert_array_equal(rebuilt.predict(make_data()[0]), model.predict(make_data()[0]))


def test_same_layout_resume_is_bitwise_identical(tmp_path):
    data = make_data()
    ref_model, ref = trained(DDPOptimizer, epochs=3)
    model, strategy = trained(DDPOptimizer, epochs=1)
    path = save_checkpoint(tmp_path / "c.h5", model, strategy, comm=MPI.COMM_SELF)
    fresh = MLP(SIZES, activation="tanh", seed=99)
    resumed = DDPOptimizer(Adam(lr=1e-2), ShardingConfiguration(MPI.COMM_SELF))
    info = load_checkpoint(path, fresh, resumed)
    assert info.step == resumed.step_count == 4
    resumed.optimize(fresh, data, epochs=3, batch_size=16)   # epochs is the total
    np.testing.assert_array_equal(fresh.params, ref_model.params)
    for k in ref.state:
        np.testing.assert_array_equal(resumed.state[k], ref.state[k])
    assert resumed.step_count == ref.step_count == 12


# ------------------------------------------------------------------ damaged files

def _expect_error(path, loader):
    with pytest.raises(CheckpointError) as info:
        loader(path)
    assert str(path) in str(info.value), str(info.value)
    return str(info.value)


def test_a_hundred_and_more_damaged_files_each_a_clear_error(base_file, tmp_path):
    base, model, _ = base_file
    raw = Path(base).read_bytes()
    size = len(raw)
    rng = np.random.default_rng(20240605)
    cases: list[tuple[str, bytes]] = []
    for k, n in enumerate(sorted({0, 1, 15, 100, 4095, 4096, 5000, size - 1} |
                                 set(int(v) for v in rng.integers(1, size, 24)))):
        cases.append((f"truncated-{k}", raw[:n]))
    for k, at in enumerate(rng.integers(0, size, 60)):
        b = bytearray(raw)
        b[at] ^= int(rng.integers(1, 256))
        cases.append((f"flip-{k}", bytes(b)))
    for k, at in enumerate(rng.integers(4096, 4096 + 2048, 16)):   # HDF5 superblock and root
        b = bytearray(raw)
        b[at] ^= int(rng.integers(1, 256))
        cases.append((f"flip-header-{k}", bytes(b)))
    cases.append(("appended", raw + b"\0" * 10))
    cases.append(("garbage", rng.integers(0, 256, 5000, dtype=np.uint8).tobytes()))
    cases.append(("text", b"this is not a checkpoint\n" * 10))
    cases.append(("seal-only", raw[:4096]))
    paths = []
    for name, content in cases:
        p = tmp_path / f"{name}.h5"
        p.write_bytes(content)
        paths.append(p)

    def edited(name, edit, seal=True):
        p = tmp_path / f"{name}.h5"
        p.write_bytes(raw)
        with h5py.File(p, "r+") as f:
            edit(f)
        if seal:
            reseal(p)
        paths.append(p)
        return p

    def set_attr(obj, key, value):
        return lambda f: (f[obj] if obj != "/" else f).attrs.__setitem__(key, value)

    expected = {
        edited("missing-param", lambda f: f.__delitem__("params/2.weight")):
            "dataset params/2.weight is missing",
        edited("missing-state", lambda f: f.__delitem__("optimizer/exp_avg_sq/0.bias")):
            "dataset optimizer/exp_avg_sq/0.bias is missing",
        edited("missing-unsealed", lambda f: f.__delitem__("params/0.bias"), seal=False):
            "digest",
        edited("version-2", set_attr("/", "format_version", 2)): "format_version 2",
        edited("format-name", set_attr("/", "format", "something-else")):
            "not an mpishard checkpoint",
        edited("step-string", set_attr("/", "step", "eight")): "'step'",
        edited("order-not-json", set_attr("params", "order", "[0.weight")): "not valid JSON",
        edited("checksum-attr", set_attr("params/0.weight", "checksum",
                                         np.array([1, 2], dtype=np.uint64))): "corrupt data",
        edited("data-edited", lambda f: f["params/4.bias"].__setitem__(0, 123.0)):
            "corrupt data",
        edited("no-checksum", lambda f: f["params/4.bias"].attrs.__delitem__("checksum")):
            "'checksum'",
        edited("no-optimizer-name", lambda f: f["optimizer"].attrs.__delitem__("name")):
            "'name'",
    }
    foreign = tmp_path / "foreign.h5"
    with h5py.File(foreign, "w") as f:
        f["params/0.weight"] = np.ones((5, 16))
    paths.append(foreign)
    foreign_ub = tmp_path / "foreign-userblock.h5"
    with h5py.File(foreign_ub, "w", userblock_size=4096) as f:
        f["x"] = np.arange(10.0)
    paths.append(foreign_ub)
    expected[foreign] = expected[foreign_ub] = "not an mpishard checkpoint"
    assert len(paths) >= 100

    kinds = {}
    for p in paths:
        message = _expect_error(p, verify_checkpoint)
        if p in expected:
            assert expected[p] in message, message
        kinds[p.name] = message
    # The strategy's load too, into a live model: refused, and the model untouched.
    before = model.params.copy()
    target = ZeRO2Optimizer(Adam(lr=1e-2), ShardingConfiguration(MPI.COMM_SELF), model=model)
    state_before = {k: v.copy() for k, v in target.state.items()}
    for p in paths[::3] + list(expected):
        _expect_error(p, lambda q: load_checkpoint(q, model, target))
        np.testing.assert_array_equal(model.params, before)
        for k, v in state_before.items():
            np.testing.assert_array_equal(target.state[k], v)
        assert target.step_count == 0
    # Truncations say so; a flip is caught by the seal or by a dataset checksum.
    assert all("truncated" in m or "empty" in m for n, m in kinds.items()
               if n.startswith("truncated-"))
    # (a flip in the seal's own fields says which: magic, size, version, table).
    known = ("digest", "corrupt data", "corrupt seal", "seal version", "not an mpishard",
             "truncated", "longer than written")
    flips = [m for n, m in kinds.items() if n.startswith("flip")]
    assert all(any(k in m for k in known) for m in flips), flips
    assert sum("digest" in m for m in flips) > 30 and sum("corrupt data" in m for m in flips) > 5


def test_incompatible_models_and_optimizers(base_file):
    path, _, _ = base_file
    other = MLP([5, 16, 8, 3], activation="tanh")
    _expect_error(path, lambda p: load_checkpoint(p, other, comm=MPI.COMM_SELF))
    with pytest.raises(CheckpointError, match=r"tensor 2.weight \(number 2 of the 6 in the "
                                              r"file\) is \(16, 16\) in the file, \(16, 8\) "
                                              r"in the model"):
        load_checkpoint(path, other, comm=MPI.COMM_SELF)
    fewer = MLP([5, 16, 16], activation="tanh")   # the same first tensors, no last layer
    with pytest.raises(CheckpointError, match="the file has 6 tensors, the model 4"):
        load_checkpoint(path, fewer, comm=MPI.COMM_SELF)
    f32 = MLP(SIZES, activation="tanh", dtype=np.float32)
    with pytest.raises(CheckpointError, match="float64 parameters, the model float32"):
        load_checkpoint(path, f32, comm=MPI.COMM_SELF)
    model = MLP(SIZES, activation="tanh")
    sgd = DDPOptimizer(SGD(lr=0.1, momentum=0.9), ShardingConfiguration(MPI.COMM_SELF))
    with pytest.raises(CheckpointError, match="optimizer Adam, loading into SGD"):
        load_checkpoint(path, model, sgd)
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        load_checkpoint(os.path.dirname(path) + "/absent.h5", model, comm=MPI.COMM_SELF)


# ------------------------------------------------------------------ the model API

def test_sequential_bytes_and_files_round_trip(tmp_path):
    x, y = make_data()
    model = MLP(SIZES, activation="gelu", seed=3, layer_norm=True, dropout=0.1)
    losses = [model.train(x[:16], y[:16]) for _ in range(3)]
    data = serialize(model)
    assert isinstance(data, bytes) and data[:8] != b"\x80\x04\x95"   # not a pickle
    rebuilt = model_from_bytes(data)
    assert type(rebuilt) is MLP and rebuilt.config() == model.config()
    np.testing.assert_array_equal(rebuilt.params, model.params)
    np.testing.assert_array_equal(rebuilt.predict(x), model.predict(x))
    assert rebuilt.get_model_metadata()["history"] == {"steps": 3, "losses": losses}
    into = MLP(SIZES, activation="gelu", seed=4, layer_norm=True, dropout=0.1)
    assert deserialize(into, data) is into
    np.testing.assert_array_equal(into.params, model.params)
    path = save_model(model, tmp_path / "m.h5")
    np.testing.assert_array_equal(load_model(path).params, model.params)
    np.testing.assert_array_equal(load_model(path).predict(x), model.predict(x))
    other = MLP(SIZES, activation="gelu", seed=5, layer_norm=True, dropout=0.1)
    np.testing.assert_array_equal(load_model_into(other, path).params, model.params)
    with pytest.raises(FileNotFoundError):
        load_model_into(other, tmp_path / "absent.h5")
    (tmp_path / "junk.h5").write_bytes(b"junk" * 100)
    with pytest.raises(CheckpointError, match="junk.h5"):
        load_model_into(other, tmp_path / "junk.h5")
    with pytest.raises(CheckpointError, match="a different model"):
        load_model_into(MLP([5, 4, 3]), path)
    broken = bytearray(data)
    broken[len(broken) // 2] ^= 0xFF
    with pytest.raises(CheckpointError, match="serialized model"):
        model_from_bytes(bytes(broken))
    with pytest.raises(TypeError):
        deserialize(model, "not bytes")


def test_train_predict_metadata_against_a_manual_step():
    x, y = make_data()
    model = MLP(SIZES, activation="tanh", seed=1)
    manual = model.clone()
    assert type(manual) is MLP and manual.sizes == SIZES
    loss = model.train(x, y)                       # default: SGD(lr=0.01)
    manual_loss = manual.forward_backward(x, y)
    expect = manual.params - 0.01 * manual.grads
    assert loss == manual_loss
    np.testing.assert_array_equal(model.params, expect)
    np.testing.assert_array_equal(model.predict(x), model.forward(x))
    meta = model.get_model_metadata()
    assert meta["parameter_count"] == 5 * 16 + 16 + 16 * 16 + 16 + 16 * 3 + 3
    assert meta["layers"][0]["parameters"] == {"0.weight": [5, 16], "0.bias": [16]}
    assert meta["metrics"] == {"steps": 1, "last_loss": loss, "min_loss": loss}
    adam = Adam(lr=1e-2)
    model.train(x, y, adam)
    model.train(x, y)                              # keeps Adam and its state
    assert model.get_model_metadata()["history"]["steps"] == 3


def test_clone_and_with_parameters_are_independent():
    x, y = make_data()
    model = MLP(SIZES, activation="relu", seed=2, dropout=0.2)
    model.train(x, y)
    twin = model.clone()
    np.testing.assert_array_equal(twin.params, model.params)
    before = model.params.copy()
    twin.train(x, y)
    np.testing.assert_array_equal(model.params, before)      # training the clone left it
    assert not np.array_equal(twin.params, before)
    vector = np.linspace(-1, 1, model.layout.size)
    other = model.with_parameters(vector)
    np.testing.assert_array_equal(other.params, vector)
    np.testing.assert_array_equal(model.params, before)
    np.testing.assert_array_equal(other.layers[0].params["weight"],
                                  vector[:80].reshape(5, 16))   # views of the new vector
    with pytest.raises(ValueError, match="shape"):
        model.with_parameters(np.zeros(3))


def least_squares(params, x, y):
    r = x @ params - y
    return float(r @ r) / len(x), 2.0 * x.T @ r / len(x)


def test_function_model_round_trip_needs_its_function(tmp_path):
    x = np.random.default_rng(0).standard_normal((40, 6))
    y = x @ np.arange(6.0)
    model = FunctionModel(least_squares, np.zeros(6), predict=lambda p, a: a @ p)
    for _ in range(4):
        model.train(x, y, None)
    assert model.get_model_metadata()["history"]["steps"] == 4
    data = serialize(model)
    other = deserialize(FunctionModel(least_squares, np.ones(6)), data)
    np.testing.assert_array_equal(other.params, model.params)
    path = save_model(model, tmp_path / "f.h5")
    rebuilt = load_model(path, least_squares, predict=lambda p, a: a @ p)
    assert type(rebuilt) is FunctionModel and rebuilt.training_metadata()["steps"] == 4
    np.testing.assert_array_equal(rebuilt.forward(x), model.forward(x))
    with pytest.raises(CheckpointError, match="records no architecture"):
        load_model(path)
    copy = model.clone()
    copy.train(x, y)
    assert not np.array_equal(copy.params, model.params)


def test_records_rebuild_a_sequential_of_layers_a_gpt_and_version_1_files(tmp_path):
    x, _ = make_data()
    model = Sequential([Linear(5, 8), LayerNorm(8), GELU(), Dropout(0.1, seed=2), Linear(8, 3)],
                       SoftmaxCrossEntropy(), seed=7)
    model.train(x, make_data()[1])
    rebuilt = load_model(save_model(model, tmp_path / "s.h5"))
    assert type(rebuilt) is Sequential and rebuilt.config() == model.config()
    np.testing.assert_array_equal(rebuilt.predict(x), model.predict(x))
    # A GPT's training checkpoint records the whole model: one process rebuilds it.
    gpt = GPT(vocab_size=11, seq_len=6, d_model=8, n_heads=2, n_layers=1, seed=5)
    gpt.params[...] = np.random.default_rng(0).standard_normal(gpt.params.size)
    path = save_checkpoint(tmp_path / "gpt.h5", gpt, comm=MPI.COMM_SELF)
    again = load_model(path)
    tokens = np.random.default_rng(1).integers(0, 11, size=(2, 6))
    assert type(again) is GPT
    np.testing.assert_array_equal(again.params, gpt.params)
    np.testing.assert_array_equal(again.forward(tokens), gpt.forward(tokens))
    # Files written before layers described themselves hold a version-1 record.
    version_1 = {"version": 1, "class": "Sequential", "loss": "SoftmaxCrossEntropy",
                 "dtype": "float64", "seed": 7, "layers": [
                     {"type": "Linear", "args": {"in_features": 5, "out_features": 8,
                                                 "bias": True}},
                     {"type": "LayerNorm", "args": {"features": 8, "eps": 1e-5}},
                     {"type": "GELU", "args": {}},
                     {"type": "Dropout", "args": {"p": 0.1, "seed": 2}},
                     {"type": "Linear", "args": {"in_features": 8, "out_features": 3,
                                                 "bias": True}}]}
    old = build_architecture(version_1, "old.h5")
    assert old.config() == model.config()
    with pytest.raises(CheckpointError, match="old.h5: its architecture cannot be built"):
        build_architecture({**version_1, "version": 3}, "old.h5")


# ----------------------------------------------------------------- the command line

def test_ckpt_inspect_and_verify(base_file, tmp_path, capsys):
    path, model, _ = base_file
    assert main(["ckpt", "inspect", path]) == 0
    out = capsys.readouterr().out
    assert "step          8 (epoch 2)" in out
    assert "strategy zero2" in out and "Adam" in out
    line = next(x for x in out.splitlines() if x.strip().startswith("params/2.weight"))
    assert "(16, 16)" in line and "float64" in line and line.endswith(" ok")
    assert "checksums: 18 of 18 verified" in out
    assert main(["ckpt", "inspect", "--json", path]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["parameters"] == model.layout.size
    assert {t["path"]: t["shape"] for t in report["tensors"]}["params/0.weight"] == [5, 16]
    damaged = tmp_path / "damaged.h5"
    raw = bytearray(Path(path).read_bytes())
    with h5py.File(path, "r") as f:
        at = f["params/2.weight"].id.get_offset()
    raw[at + 3] ^= 0x10
    damaged.write_bytes(bytes(raw))
    assert main(["ckpt", "verify", path, str(damaged)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("OK") and "step 8" in out[0]
    assert out[1].startswith("FAIL") and "params/2.weight" in out[1] and str(damaged) in out[1]
    assert main(["ckpt", "inspect", str(damaged)]) == 1
    assert "CHECKSUM MISMATCH" in capsys.readouterr().out
    assert main(["ckpt", "verify", str(tmp_path / "absent.h5")]) == 1
    assert inspect_checkpoint(path, verify=False)["tensors"][0]["verified"] is None


def test_manager_keeps_the_last_k_and_finds_the_latest(tmp_path):
    model, strategy = trained(DDPOptimizer)
    manager = CheckpointManager(tmp_path / "run", keep=2)
    assert manager.load_latest(model, strategy) is None
    stale = tmp_path / "run" / "ckpt-0000000099.h5.tmp-dead"
    for step in (4, 8, 12):
        strategy.step_count = step
        path = manager.save(model, strategy)
        if step == 4:
            stale.write_bytes(b"half")            # an interrupted save of some earlier job
    assert [s for s, _ in manager.checkpoints()] == [8, 12]
    assert not stale.exists()
    assert latest_checkpoint(tmp_path / "run") == path
    (tmp_path / "run" / "ckpt-0000000020.h5.tmp-abcd").write_bytes(b"x")   # never listed
    assert latest_checkpoint(tmp_path / "run") == path
    (tmp_path / "run" / "ckpt-0000000030.h5").write_bytes(b"damaged")
    assert latest_checkpoint(tmp_path / "run", verify=True) == path
    with pytest.raises(CheckpointError, match="ckpt-0000000030.h5"):   # never a silent fallback
        manager.load_latest(MLP(SIZES, activation="tanh"),
                            DDPOptimizer(Adam(lr=1e-2), ShardingConfiguration(MPI.COMM_SELF)))
    with pytest.raises(ValueError):
        CheckpointManager(tmp_path, keep=0)
