"""Reproducible mode: the same bits at any data-parallel size, strategy and pipeline layout.

Every MPI test computes its reference in the same test: the same training run
by one process on ``MPI.COMM_SELF`` (a 1-rank ``ShardingConfiguration``), and
compares the SHA-256 of the flat parameters and of the list of losses after 30
steps. Run at 1, 2, 4 and 8 ranks; ``test_three_ranks`` starts its own
``mpirun -n 3``. The binned sum itself is tested without MPI against
``math.fsum``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import sys

import numpy as np
import pytest
from mpi4py import MPI

from mpishard import ShardingConfiguration
from mpishard.nn import GPT, MLP, ParallelMLP
from mpishard.optim import AdamW
from mpishard.parallel.repro import unit_rows_for
from mpishard.reprosum import (
    CHUNK,
    NORM_WORD_BITS,
    NORM_WORDS,
    WORD_BITS,
    BinnedAccumulator,
    ScalarSum,
    bin_of,
    fixed_bin_sum,
    words_for,
    words_to_float,
)
from mpishard.strategies import (
    DDPOptimizer,
    HybridShardedModel,
    HybridShardedOptimizer,
    ZeRO2Optimizer,
)

WORLD = MPI.COMM_WORLD.size
BATCH = 48          # 24 units of 2 rows by default: dp = 1, 2, 3, 4, 6, 8, 12, 24
EPOCHS = 6          # 5 steps an epoch: 30 steps
VOCAB, SEQ = 11, 5


# --- training runs shared by the MPI tests and the 3-rank job -----------------------
def mlp_data(n=240):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((n, 6))
    return x, np.argmax(x[:, :4] + 0.1 * rng.standard_normal((n, 4)), axis=1)


def token_data(n=240):
    rng = np.random.default_rng(2)
    x = rng.integers(0, VOCAB, (n, SEQ))
    return x, np.roll(x, -1, axis=1)


def digest(params, losses) -> tuple[str, str]:
    """SHA-256 of the flat parameters and of the losses (float64)."""
    return (hashlib.sha256(np.ascontiguousarray(params).tobytes()).hexdigest(),
            hashlib.sha256(np.asarray(losses, dtype=np.float64).tobytes()).hexdigest())


def make_strategy(kind, config, **options):
    opt = AdamW(lr=1e-2, weight_decay=0.01)
    if kind == "ddp":
        return DDPOptimizer(opt, config, **options)
    method = kind.split("-", 1)[1]
    return ZeRO2Optimizer(opt, config, reduce_method=method, **options)


def units_of(model):
    """Rows per unit: the MLP the default (24 units of 2 rows), the GPT 4 units of
    12 (fewer, larger units keep the test short)."""
    return 12 if model == "gpt" else None


def train(comm, kind="ddp", model="mlp", dtype=np.float32, accumulation=1, clip=None,
          reproducible=True, epochs=EPOCHS, unit_rows="auto", sizes=None, xp=np):
    """Train 30 steps (the model on ``xp``'s device); returns (parameter digest,
    loss digest, params, losses)."""
    unit_rows = (units_of(model) if sizes is None else None) if unit_rows == "auto" \
        else unit_rows
    config = ShardingConfiguration(comm, reproducible=reproducible, unit_rows=unit_rows,
                                   reproducible_sizes=sizes)
    if model == "mlp":
        net, data = MLP([6, 16, 16, 4], activation="tanh", dtype=dtype, seed=5, xp=xp), \
            mlp_data()
    else:
        net, data = GPT(VOCAB, SEQ, 8, 2, 2, dtype=dtype, seed=11, xp=xp), token_data()
    strategy = make_strategy(kind, config, accumulation_steps=accumulation,
                             max_grad_norm=clip)
    result = strategy.optimize(net, (data[0], data[1]), epochs=epochs, batch_size=BATCH)
    strategy.verify_in_sync()
    params = np.array(net.params) if xp is np else xp.asnumpy(net.params)
    config.free()
    return (*digest(params, result.losses), params, np.array(result.losses))


# (strategy, model, dtype, accumulation_steps, max_grad_norm)
CASES = [
    ("ddp", "mlp", np.float32, 1, None),
    ("ddp", "mlp", np.float64, 2, 0.5),
    ("zero2-reduce_scatter", "mlp", np.float32, 2, 0.5),
    ("zero2-allreduce", "mlp", np.float64, 1, 0.5),
    ("zero2-reduce_scatter", "mlp", np.float64, 1, None),
    ("ddp", "gpt", np.float32, 1, 0.5),
    ("zero2-reduce_scatter", "gpt", np.float64, 2, None),
]


def case_id(case):
    kind, model, dtype, acc, clip = case
    return f"{kind}-{model}-{np.dtype(dtype).name}-acc{acc}-clip{clip}"


# --- the binned sum, without MPI -----------------------------------------------------
def wide_vectors(dtype, count, n, seed):
    """Vectors with exponents over a wide range, both signs, zeros and subnormals."""
    rng = np.random.default_rng(seed)
    span = 100 if dtype == np.float32 else 600
    xs = []
    for _ in range(count):
        x = rng.standard_normal(n) * np.exp2(rng.integers(-span // 2, span // 2, n))
        x[rng.random(n) < 0.05] = 0.0
        x = x.astype(dtype)
        if dtype == np.float64:
            x[:3] = [5e-324, -2.5e-320, 1e-310]     # subnormals
            # A chunk of subnormals and one of huge values: bins beyond a float64 factor.
            x[CHUNK:2 * CHUNK] = rng.integers(-9, 9, CHUNK) * 5e-324
            if n >= 3 * CHUNK:
                x[2 * CHUNK:2 * CHUNK + 9] = rng.standard_normal(9) * 1e305
        xs.append(x)
    xs.append(np.zeros(n, dtype=dtype))            # an all-zero deposit
    return xs


def binned(xs, order, groups, dtype, n):
    """Sum ``xs`` in ``order``, cut into ``groups`` (ranks), reduced like the library does."""
    accs = []
    for group in groups:
        acc = BinnedAccumulator(n, dtype, extras=1)
        for i in group:
            assert acc.deposit(xs[order[i]], [float(xs[order[i]][-1]) * 7])
        accs.append(acc)
    bins = np.max([a.bins for a in accs], axis=0)          # Allreduce(MAX)
    for acc in accs:
        acc.realign(bins)
    total = BinnedAccumulator(n, dtype, extras=1)
    total.bins[...] = bins
    total.words[...] = sum(a.words for a in accs)          # Allreduce(SUM): exact integers
    out = np.empty(n, dtype=dtype)
    total.to_float(out)
    return out, total.extra_value(0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_binned_sum_ignores_order_and_grouping(dtype):
    n, count = 3 * CHUNK + 17, 13
    xs = wide_vectors(dtype, count, n, seed=1)
    ref, ref_extra = binned(xs, list(range(len(xs))), [range(len(xs))], dtype, n)
    rng = np.random.default_rng(7)
    for _ in range(6):
        order = rng.permutation(len(xs))
        cuts = sorted(rng.choice(np.arange(1, len(xs)), size=3, replace=False))
        groups = [range(a, b) for a, b in zip([0, *cuts], [*cuts, len(xs)])]
        out, extra = binned(xs, order, groups, dtype, n)
        assert out.tobytes() == ref.tobytes()
        assert extra == ref_extra
    # A non-trivial test: plain float summation does depend on the order here.
    plain = [np.sum(np.array(xs)[rng.permutation(len(xs))], axis=0, dtype=dtype)
             for _ in range(4)]
    assert any(p.tobytes() != plain[0].tobytes() for p in plain[1:])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_binned_sum_error_bound_against_exact_sum(dtype):
    n, count = 2 * CHUNK, 40
    xs = wide_vectors(dtype, count, n, seed=2)
    out, _ = binned(xs, list(range(len(xs))), [range(len(xs))], dtype, n)
    wide = np.array(xs, dtype=np.float64)
    exact = np.array([math.fsum(wide[:, j]) for j in range(n)])
    # The bound of mpishard.reprosum: output rounding, the float64 conversion, and
    # per deposit less than 2 M 2**(-(K-1)W), M the chunk's largest magnitude.
    k = words_for(dtype)
    chunk_max = np.repeat(np.abs(wide).max(axis=0).reshape(-1, CHUNK).max(axis=1), CHUNK)
    ulp = np.spacing(np.abs(exact).astype(dtype)).astype(np.float64)
    bound = (ulp + 2.0 ** -51 * np.abs(wide).sum(axis=0)
             + len(xs) * 2 * chunk_max * 2.0 ** (-(k - 1) * WORD_BITS))
    error = np.abs(out.astype(np.float64) - exact)
    assert np.all(error <= bound), np.max(error / bound)
    # Where a chunk's values are of one scale (gradients), it is the output's rounding.
    same = [rng_x for rng_x in (np.random.default_rng(4).standard_normal((count, n)))]
    same = [x.astype(dtype) for x in same]
    out, _ = binned(same, list(range(count)), [range(count)], dtype, n)
    exact = np.array([math.fsum(float(x[j]) for x in same) for j in range(n)])
    assert np.all(np.abs(out - exact) <= np.spacing(np.abs(exact).astype(dtype)))


def test_tensor_bits_do_not_depend_on_offset_or_block(monkeypatch):
    """Chunks restart at every segment (tensor): a tensor sums to the same bits
    inside the whole vector and alone (a pipeline stage's vector), whatever the
    working block of the deposit."""
    import mpishard.reprosum as reprosum

    rng = np.random.default_rng(6)
    lengths = [300, 1000, 77]
    xs = [(rng.standard_normal(sum(lengths)) * np.exp2(rng.integers(-30, 30, sum(lengths))))
          .astype(np.float32) for _ in range(9)]
    results = []
    for block in (CHUNK, 3 * CHUNK, 1 << 20):
        monkeypatch.setattr(reprosum, "BLOCK_ELEMENTS", block)
        whole = BinnedAccumulator(sum(lengths), np.float32, segments=lengths)
        alone = BinnedAccumulator(lengths[1], np.float32)
        for x in xs:
            whole.deposit(x)
            alone.deposit(x[300:1300])
        a, b = np.empty(sum(lengths), np.float32), np.empty(lengths[1], np.float32)
        whole.to_float(a)
        alone.to_float(b)
        assert a[300:1300].tobytes() == b.tobytes()
        part = np.empty(500, np.float32)
        whole.to_float(part, 250, 750)      # a range across segments (a ZeRO-2 shard)
        assert part.tobytes() == a[250:750].tobytes()
        results.append(a.tobytes())
    assert results[0] == results[1] == results[2]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fast_deposit_paths_give_the_general_bits(dtype, monkeypatch):
    """The host deposit's fast paths (bit maximum, one scale per block of one bin)
    against the general ones: the same words and bins."""
    import mpishard.reprosum as reprosum

    rng = np.random.default_rng(8)
    n = 5 * CHUNK + 17
    # First a tiny one: its bins' scale 2**152 is beyond float32 (float64 arithmetic).
    xs = [(rng.standard_normal(n) * 1e-36).astype(dtype)] + wide_vectors(dtype, 4, n, seed=9)
    xs[0][:2 * CHUNK] = 0.0      # a block of zeros: skipped
    xs += [rng.standard_normal(n).astype(dtype) * 3, np.full(n, -0.0, dtype=dtype),
           (rng.standard_normal(n) * 1e-300).astype(dtype)]
    got = []
    for fast in (True, False):
        monkeypatch.setattr(reprosum, "_FAST", fast)
        monkeypatch.setattr(reprosum, "BLOCK_ELEMENTS", 2 * CHUNK)
        acc = BinnedAccumulator(n, dtype, segments=[2 * CHUNK, n - 2 * CHUNK])
        snapshots = []
        for x in xs:
            assert acc.deposit(x)
            snapshots.append(acc.words.tobytes())   # a later rise may drop words
        bad = xs[1].copy()
        bad[CHUNK + 3] = np.nan
        assert not acc.deposit(bad)          # refused on either path
        got.append((snapshots, acc.bins.tobytes()))
    assert got[0] == got[1]


def test_binned_sum_edges():
    acc = BinnedAccumulator(5, np.float32)
    assert not acc.deposit(np.array([1, 2, np.nan, 4, 5], dtype=np.float32))
    assert acc.deposits == 0 and (acc.words == 0).all()
    out = np.ones(5, dtype=np.float32)
    acc.to_float(out)
    assert (out == 0).all()                                 # nothing deposited: zeros
    acc.capacity = 2
    acc.deposit(np.ones(5, dtype=np.float32))
    acc.deposit(np.ones(5, dtype=np.float32))
    with pytest.raises(ValueError, match="at most 2 deposits"):
        acc.deposit(np.ones(5, dtype=np.float32))
    assert bin_of(0.0) < bin_of(2.0 ** -1074) < bin_of(1.0) < bin_of(2.0 ** 1000)
    assert bin_of(2.0 ** WORD_BITS - 1) == 0 and bin_of(2.0 ** WORD_BITS) == 1
    with pytest.raises(ValueError, match="extra values"):
        acc.deposit(np.ones(5, dtype=np.float32), [1.0])


def test_scalar_sum_is_a_one_element_accumulator():
    """ScalarSum (the loss's sum, in Python floats) gives the words, bins and value
    of a BinnedAccumulator of one float64 element, realigned alike."""
    rng = np.random.default_rng(12)
    values = list(rng.standard_normal(40) * np.exp2(rng.integers(-300, 300, 40)))
    values[5:8] = [0.0, -0.0, 5e-324]
    for order in (values, values[::-1]):
        acc, one = BinnedAccumulator(1, np.float64), ScalarSum()
        for v in order:
            assert acc.deposit(np.array([v])) and one.deposit(float(v))
            assert (one.bin, one.words) == (int(acc.bins[0]), acc.words[:, 0, 0].tolist())
        top = one.bin + 2
        acc.realign(np.array([top]))
        one.realign(top)
        assert one.words == acc.words[:, 0, 0].tolist()
        out = np.empty(1)
        acc.to_float(out)
        assert one.value() == out[0]
    assert not one.deposit(math.nan) and not one.deposit(-math.inf)


def test_fixed_bin_sum_of_squares_any_partition():
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(5000) * np.exp2(rng.integers(-20, 20, 5000))).astype(np.float32)
    top = bin_of(float(np.max(np.abs(x).astype(np.float64) ** 2)), NORM_WORD_BITS)
    scratch, slices = np.empty(300), np.empty(300)

    def total(pieces):
        words = [0.0] * NORM_WORDS
        for p in pieces:
            for k, w in enumerate(fixed_bin_sum(p, top, scratch, slices, square=True)):
                words[k] += w
        return words_to_float(words, top, NORM_WORD_BITS)

    whole = total([x])
    for parts in (2, 3, 7):
        cuts = np.linspace(0, x.size, parts + 1).astype(int)
        assert total([x[a:b] for a, b in zip(cuts[:-1], cuts[1:])]) == whole
    exact = math.fsum(float(v) ** 2 for v in x)
    largest = float(np.max(np.abs(x).astype(np.float64) ** 2))
    # Per element less than 2 * largest * 2**(-(K-1)W), and the float conversion.
    assert abs(whole - exact) <= x.size * 2 * largest * 2.0 ** (-2 * NORM_WORD_BITS) \
        + 4 * 2.0 ** -52 * exact


# --- the same bits at every data-parallel size ---------------------------------------
def units_fit(world: int, accumulation: int, model: str = "mlp") -> bool:
    rows = units_of(model)
    units = BATCH // rows if rows else 24
    return units % (world * accumulation) == 0


@pytest.mark.mpi
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_same_bits_as_one_process(case):
    kind, model, dtype, acc, clip = case
    if not units_fit(WORLD, acc, model):
        pytest.skip(f"the units do not split over {WORLD} ranks x {acc} micro-batches")
    serial = train(MPI.COMM_SELF, "ddp", model, dtype, acc, clip)
    mine = train(MPI.COMM_WORLD, kind, model, dtype, acc, clip)
    assert len(mine[3]) == 30
    assert mine[:2] == serial[:2], (np.max(np.abs(mine[2] - serial[2])),
                                    np.max(np.abs(mine[3] - serial[3])))


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.parametrize("case", [("ddp", "mlp", np.float32, 1, None),
                                  ("zero2-reduce_scatter", "gpt", np.float64, 1, 0.5),
                                  ("zero2-allreduce", "mlp", np.float64, 2, 0.5)], ids=case_id)
def test_same_bits_on_the_device(case):
    """CuPy arrays (the deposit's CUDA kernels with MPISHARD_GPU_KERNELS=1, the
    twin without): the same bits at any size, as one process on the device."""
    from conftest import _cupy_or_skip

    cp = _cupy_or_skip()
    kind, model, dtype, acc, clip = case
    if not units_fit(WORLD, acc, model):
        pytest.skip(f"the units do not split over {WORLD} ranks x {acc} micro-batches")
    serial = train(MPI.COMM_SELF, "ddp", model, dtype, acc, clip, xp=cp)
    mine = train(MPI.COMM_WORLD, kind, model, dtype, acc, clip, xp=cp)
    assert mine[:2] == serial[:2]


@pytest.mark.mpi
def test_reproducible_is_the_same_training_as_default():
    """Within float tolerance of the default mode (it is the same mean gradient)."""
    for dtype, rtol in ((np.float64, 1e-9), (np.float32, 2e-3)):
        repro = train(MPI.COMM_WORLD, "ddp", "mlp", dtype, 1, 0.5)
        default = train(MPI.COMM_WORLD, "ddp", "mlp", dtype, 1, 0.5, reproducible=False)
        np.testing.assert_allclose(repro[3], default[3], rtol=rtol)
        np.testing.assert_allclose(repro[2], default[2], rtol=rtol, atol=rtol)
        if dtype == np.float64 and WORLD > 1:
            assert repro[0] != default[0]    # and yet not the same arithmetic


@pytest.mark.mpi(min_size=2)
def test_units_cut_by_a_rank_is_an_error_on_every_rank():
    config = ShardingConfiguration(MPI.COMM_WORLD, reproducible=True, unit_rows=BATCH // 2 + 1)
    strategy = make_strategy("ddp", config)
    with pytest.raises(ValueError, match=f"units of unit_rows={BATCH // 2 + 1} rows"):
        strategy.optimize(MLP([6, 4], seed=1), mlp_data(), epochs=1, batch_size=BATCH)
    config = ShardingConfiguration(MPI.COMM_WORLD, reproducible=True, unit_rows=BATCH // 3)
    strategy = make_strategy("ddp", config)
    if 3 % WORLD:
        with pytest.raises(ValueError, match="cut a unit of 16 rows"):
            strategy.optimize(MLP([6, 4], seed=1), mlp_data(), epochs=1, batch_size=BATCH)
    with pytest.raises(ValueError, match="unit_rows must be a positive integer"):
        ShardingConfiguration(MPI.COMM_WORLD, reproducible=True, unit_rows=0)


# --- reproducible_sizes: the units the sizes a user needs allow ----------------------
def test_reproducible_sizes_set_the_units():
    assert unit_rows_for(48, None) == 2                     # gcd(48, 24) = 24 units
    assert unit_rows_for(48, None, (1, 2, 4)) == 12         # 4 units
    assert unit_rows_for(48, None, (2, 3)) == 8             # lcm 6: 6 units
    assert unit_rows_for(40, None, (1, 3)) == 40            # gcd(40, 3) = 1 unit
    assert unit_rows_for(48, 6, None) == 6
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


@pytest.mark.mpi
@pytest.mark.parametrize("kind, dtype, acc", [("ddp", np.float32, 1),
                                              ("zero2-reduce_scatter", np.float64, 1),
                                              ("zero2-allreduce", np.float32, 2)])
def test_reproducible_sizes_same_bits_as_one_process(kind, dtype, acc):
    """Sizes (1, 2, 4): 4 units of 12 rows (8 with accumulation 2), each rank
    computing as few as the size allows."""
    sizes = (1, 2, 4) if acc == 1 else (2, 4, 8)
    if 4 % WORLD:
        pytest.skip(f"reproducible_sizes {sizes} does not include {WORLD} ranks")
    serial = train(MPI.COMM_SELF, "ddp", "mlp", dtype, acc, 0.5, sizes=sizes)
    mine = train(MPI.COMM_WORLD, kind, "mlp", dtype, acc, 0.5, sizes=sizes)
    assert mine[:2] == serial[:2]


# --- pipelines: pp = 1, 2, 4, GPipe and 1F1B, micro-batches 1, 2, 4 ---------------------
PIPE_UNIT = 6       # 8 units of 6 rows: a pipeline micro-batch is one unit


def pipeline_factory(kind, dtype):
    if kind == "gpt":
        return functools.partial(GPT, VOCAB, SEQ, 8, 2, 2, dtype=dtype, seed=11)
    return functools.partial(ParallelMLP, [6, 8, 8, 8, 4], activation="tanh", dtype=dtype,
                             seed=5)


def train_pipeline(comm, pp, kind, dtype, schedule, data_parallel, clip=0.5, micro=1):
    config = ShardingConfiguration(comm, pipeline_parallel_size=pp, reproducible=True,
                                   unit_rows=PIPE_UNIT)
    model = HybridShardedModel(pipeline_factory(kind, dtype), config, micro_batches=micro,
                               schedule=schedule)
    strategy = HybridShardedOptimizer(AdamW(lr=1e-2, weight_decay=0.01), config,
                                      data_parallel=data_parallel, model=model,
                                      max_grad_norm=clip)
    data = token_data() if kind == "gpt" else mlp_data()
    result = strategy.optimize(model, data, epochs=EPOCHS, batch_size=BATCH)
    # Each stage's tensors by logical name, gathered to compare with one process.
    with strategy.gathered_parameters() as params:
        tensors = {name: np.array(model.layout.view(params, name))
                   for name in model.layout.names}
    every = config.groups.pp.allgather(tensors)
    config.free()
    merged = {}
    for part in every:
        merged.update(part)
    return merged, np.array(result.losses)


def flat_digest(tensors, losses):
    """SHA-256 of the tensors in the whole model's order, and of the losses."""
    names = sorted(tensors, key=_layer_order)
    return digest(np.concatenate([tensors[n].reshape(-1) for n in names]), losses)


def _layer_order(name):
    head, _, rest = name.partition(".")
    return (int(head), rest) if head.isdigit() else (-1, name)


PIPE_LAYOUTS = [(pp, WORLD // pp) for pp in (1, 2, 4)
                if WORLD % pp == 0 and (BATCH // PIPE_UNIT) % (WORLD // pp) == 0]
_PIPE_REFERENCE: dict = {}


def pipeline_reference(kind, dtype):
    """One process, no pipeline, one micro-batch (made once per model and dtype)."""
    key = (kind, np.dtype(dtype).name)
    if key not in _PIPE_REFERENCE:
        _PIPE_REFERENCE[key] = flat_digest(*train_pipeline(MPI.COMM_SELF, 1, kind, dtype,
                                                           "1f1b", "ddp"))
    return _PIPE_REFERENCE[key]


@pytest.mark.mpi
@pytest.mark.parametrize("micro", [1, 2, 4])
@pytest.mark.parametrize("layout", PIPE_LAYOUTS, ids=lambda t: f"pp{t[0]}-dp{t[1]}")
@pytest.mark.parametrize("schedule, data_parallel, kind, dtype", [
    ("1f1b", "ddp", "gpt", np.float32),
    ("gpipe", "zero2", "gpt", np.float64),
    ("gpipe", "ddp", "mlp", np.float64),
])
def test_pipeline_same_bits_as_one_process(layout, micro, schedule, data_parallel, kind,
                                           dtype):
    """Any pipeline size, schedule and micro-batch count (a pass of up to ``micro``
    units; fewer where a rank holds fewer) gives the one-process bits."""
    pp, _ = layout
    reference = pipeline_reference(kind, dtype)
    mine = train_pipeline(MPI.COMM_WORLD, pp, kind, dtype, schedule, data_parallel,
                          micro=micro)
    assert len(mine[1]) == 30
    assert flat_digest(*mine) == reference


def train_pipeline_unequal(comm, pp, data_parallel, micro, empty=False):
    """5 steps of ``backward`` on rows of the global batch given by hand, the
    data-parallel ranks holding unequal units (8 units: 5 and 3 at 2 ranks; 3, 2,
    2, 1 at 4; ``empty``: the last rank none, its share to the first); the
    tensors by name (gathered) and the losses."""
    config = ShardingConfiguration(comm, pipeline_parallel_size=pp, reproducible=True,
                                   unit_rows=PIPE_UNIT)
    model = HybridShardedModel(pipeline_factory("gpt", np.float64), config,
                               micro_batches=micro, schedule="1f1b")
    strategy = HybridShardedOptimizer(AdamW(lr=1e-2, weight_decay=0.01), config,
                                      data_parallel=data_parallel, model=model,
                                      max_grad_norm=0.5)
    dp, units = config.groups.dp, BATCH // PIPE_UNIT
    counts = [units // dp.size] * dp.size
    if dp.size > 1:
        moved = counts[-1] if empty else 1
        counts[0] += moved
        counts[-1] -= moved
    lo = sum(counts[:dp.rank]) * PIPE_UNIT
    hi = lo + counts[dp.rank] * PIPE_UNIT
    x, y = token_data()
    losses = []
    for step in range(5):
        xs, ys = x[step * BATCH:(step + 1) * BATCH], y[step * BATCH:(step + 1) * BATCH]
        strategy.backward(xs[lo:hi], ys[lo:hi], batch_start=lo, global_rows=BATCH)
        losses.append(strategy.step())
    with strategy.gathered_parameters() as params:
        tensors = {name: np.array(model.layout.view(params, name))
                   for name in model.layout.names}
    merged = {}
    for part in config.groups.pp.allgather(tensors):
        merged.update(part)
    config.free()
    return merged, np.array(losses)


@pytest.mark.mpi
@pytest.mark.parametrize("micro, empty", [(2, False), (4, False), (4, True)])
@pytest.mark.parametrize("data_parallel", ["zero3", "zero2"])
@pytest.mark.parametrize("layout", PIPE_LAYOUTS, ids=lambda t: f"pp{t[0]}-dp{t[1]}")
def test_pipeline_unequal_units_same_bits(layout, data_parallel, micro, empty):
    """Ranks holding unequal units, a rank none (rows given to backward by hand):
    ZeRO-3 gathers the stage's parameters over the data group inside the passes,
    so every rank runs the passes of the most units any holds (stand-ins of zeros
    for its missing ones); the bits are one process's."""
    pp, _ = layout
    reference = flat_digest(*train_pipeline_unequal(MPI.COMM_SELF, 1, "ddp", 1))
    mine = train_pipeline_unequal(MPI.COMM_WORLD, pp, data_parallel, micro, empty)
    assert flat_digest(*mine) == reference


# --- a checkpoint written at one size and resumed at another ---------------------------
@pytest.mark.mpi(min_size=2)
def test_restart_at_another_size_gives_the_same_bits(mpi_tmp_path):
    from mpishard.checkpoint import CheckpointManager, load_checkpoint

    world = MPI.COMM_WORLD
    whole = train(MPI.COMM_SELF, "ddp", "mlp", np.float32, 1, 0.5)
    # Stop at a seeded random step, on all ranks with ZeRO-2 ...
    stop = int(np.random.default_rng(WORLD).integers(3, 27))
    folder = os.path.join(str(mpi_tmp_path), "repro")
    config = ShardingConfiguration(world, reproducible=True)
    net = MLP([6, 16, 16, 4], activation="tanh", dtype=np.float32, seed=5)
    strategy = make_strategy("zero2-reduce_scatter", config, max_grad_norm=0.5)
    first = strategy.optimize(net, mlp_data(), epochs=EPOCHS, batch_size=BATCH,
                              checkpoints=CheckpointManager(folder, keep=2), max_steps=stop)
    assert first.last_step == stop
    config.free()
    # ... and resume in one process (DDP), then once more at full size from its end.
    losses = list(first.losses)
    if world.rank == 0:
        config = ShardingConfiguration(MPI.COMM_SELF, reproducible=True)
        net = MLP([6, 16, 16, 4], activation="tanh", dtype=np.float32, seed=99)
        strategy = make_strategy("ddp", config, max_grad_norm=0.5)
        load_checkpoint(first.checkpoint, net, strategy)
        second = strategy.optimize(net, mlp_data(), epochs=EPOCHS, batch_size=BATCH,
                                   checkpoints=CheckpointManager(folder, keep=2),
                                   max_steps=stop + 2)
        config.free()
        info = (second.checkpoint, list(second.losses))
    else:
        info = None
    path, more = world.bcast(info, root=0)
    losses += more
    config = ShardingConfiguration(world, reproducible=True)
    net = MLP([6, 16, 16, 4], activation="tanh", dtype=np.float32, seed=99)
    strategy = make_strategy("ddp", config, max_grad_norm=0.5)
    load_checkpoint(path, net, strategy)
    rest = strategy.optimize(net, mlp_data(), epochs=EPOCHS, batch_size=BATCH)
    losses += rest.losses
    config.free()
    assert digest(net.params, losses) == whole[:2]


# --- three ranks, in a job of its own -------------------------------------------------
THREE_RANKS = """
import json, sys
sys.path.insert(0, {tests!r})
import numpy as np
from mpi4py import MPI
import test_reproducible as t
out = [list(t.train(MPI.COMM_WORLD, *case[:5], unit_rows=case[5])[:2]) for case in t.CASES3]
if MPI.COMM_WORLD.rank == 0:
    print("HASHES " + json.dumps(out))
"""

# (strategy, model, dtype, accumulation_steps, max_grad_norm, unit_rows): the
# MLP's 24 units and the GPT's 3 units of 16 rows over 3 ranks.
CASES3 = [
    ("zero2-reduce_scatter", "mlp", np.float32, 2, 0.5, None),
    ("ddp", "gpt", np.float64, 1, 0.5, 16),
]


def test_three_ranks():
    from conftest import mpirun

    job = mpirun(3, THREE_RANKS.format(tests=os.path.dirname(os.path.abspath(__file__))),
                 timeout=300)
    assert job.returncode == 0, job.output
    line = next(x for x in job.output.splitlines() if x.startswith("HASHES "))
    got = json.loads(line[len("HASHES "):])
    for case, hashes in zip(CASES3, got):
        kind, model, dtype, acc, clip, rows = case
        serial = train(MPI.COMM_SELF, "ddp", model, dtype, acc, clip, unit_rows=rows)
        assert tuple(hashes) == serial[:2], case


# --- mpishard train --reproducible (and its TOML key) ------------------------------------
@pytest.mark.launch
def test_train_command_reproducible_flag_and_toml_key(tmp_path):
    """``mpishard train --reproducible`` on 1 rank (DDP), from a TOML file on 2
    ranks (ZeRO-2), and as a 2-stage pipeline of 4 micro-batches writes the same
    final parameters, bit for bit."""
    import subprocess

    import h5py
    from conftest import mpi_env, mpirun_command

    from mpishard.commands.config import plan_runs

    common = ["train", "--example", "burgers", "--samples", "128", "--epochs", "1",
              "--batch-size", "48", "--hidden", "16,16"]
    toml = tmp_path / "run.toml"
    toml.write_text('reproducible = true\nstrategy = "zero2"\n')
    assert plan_runs({"config": str(toml), "example": "burgers"}, 2)[0].reproducible
    assert not plan_runs({"example": "burgers"}, 2)[0].reproducible
    sized = tmp_path / "sized.toml"
    sized.write_text('reproducible = true\nreproducible_sizes = [1, 2, 4]\n')
    assert plan_runs({"config": str(sized), "example": "burgers"}, 2)[0].reproducible_sizes \
        == [1, 2, 4]
    # (ranks, arguments): one process; ZeRO-2 from the TOML file; a 2-stage pipeline
    # whose 4 micro-batches are 4 of the 24 units of 2 rows (issue 21: a unit cut
    # into micro-batches changed the bits, and 4 were refused).
    runs = {"one": (1, [*common, "--reproducible"]),
            "two": (2, [*common, "--config", str(toml)]),
            "pipe": (2, [*common, "--reproducible", "--strategy", "hybrid", "--pp", "2",
                         "--micro-batches", "4"])}
    final = {}
    for name, (n, args) in runs.items():
        job = subprocess.run(mpirun_command(n, "-m", "mpishard", *args, "--out",
                                            str(tmp_path / name)),
                             capture_output=True, text=True, timeout=240, env=mpi_env())
        assert job.returncode == 0, job.stdout + job.stderr
        assert "reproducible" in job.stdout
        folder = tmp_path / name / "burgers" / "checkpoints"
        (path,) = sorted(folder.glob("*.h5"))[-1:]
        with h5py.File(path, "r") as f:
            final[name] = {k: f["params"][k][()] for k in f["params"]}
    for other in ("two", "pipe"):
        assert sorted(final["one"]) == sorted(final[other])
        for key in final["one"]:
            assert final["one"][key].tobytes() == final[other][key].tobytes(), (other, key)


if __name__ == "__main__":      # pragma: no cover
    sys.exit(pytest.main([__file__]))


@pytest.mark.mpi
@pytest.mark.parametrize("kind, dtype", [("ddp", np.float32), ("zero2-reduce_scatter", np.float64)])
def test_short_last_batch_same_bits_as_one_process(kind, dtype):
    """drop_last=False: the short last batch (37 rows: one default unit, cut by any
    split over 2 or more ranks) runs in units of one row, the same bits at any size."""
    def run(comm):
        config = ShardingConfiguration(comm, reproducible=True)
        net = MLP([6, 16, 4], activation="tanh", dtype=dtype, seed=5)
        strategy = make_strategy(kind, config, max_grad_norm=0.5)
        result = strategy.optimize(net, mlp_data(2 * BATCH + 37), epochs=2, batch_size=BATCH,
                                   drop_last=False)
        assert result.steps == 6 and result.samples == 2 * (2 * BATCH + 37)
        out = digest(np.array(net.params), result.losses)
        config.free()
        return out
    assert run(MPI.COMM_WORLD) == run(MPI.COMM_SELF)
