"""Tests of mpishard.optim against float64 reference formulas and closed forms."""

from __future__ import annotations

import json
import math
import tracemalloc

import numpy as np
import pytest

from mpishard.backend import to_numpy
from mpishard.optim import (
    SGD,
    Adam,
    AdamW,
    ConstantSchedule,
    CosineSchedule,
    WarmupSchedule,
    clip_coefficient,
    get_optimizer,
    optimizer_from_hyperparameters,
    schedule_from_dict,
    sum_of_squares,
)
from mpishard.protocols import Optimizer

N = 1000          # not a multiple of CHUNK: the last chunk is ragged
CHUNK = 64
STEPS = 20

CONFIGS = {
    "sgd": lambda: SGD(lr=0.1, chunk_size=CHUNK),
    "sgd-wd": lambda: SGD(lr=0.1, weight_decay=0.01, chunk_size=CHUNK),
    "sgd-momentum": lambda: SGD(lr=0.1, momentum=0.9, chunk_size=CHUNK),
    "sgd-momentum-wd": lambda: SGD(lr=0.1, momentum=0.8, weight_decay=0.02, chunk_size=CHUNK),
    "sgd-nesterov": lambda: SGD(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01,
                                chunk_size=CHUNK),
    "adam": lambda: Adam(lr=1e-2, chunk_size=CHUNK),
    "adam-l2": lambda: Adam(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1,
                            chunk_size=CHUNK),
    "adamw": lambda: AdamW(lr=1e-2, chunk_size=CHUNK),
    "adamw-strong": lambda: AdamW(lr=1e-2, betas=(0.5, 0.9), weight_decay=0.3,
                                  chunk_size=CHUNK),
}


# ----------------------------------------------------------------- references

def reference_run(opt, p0, grads, lrs, scales):
    """The formulas written plainly, in float64, one step at a time."""
    p = p0.astype(np.float64)
    hp = opt.hyperparameters()
    name = hp["name"]
    buf = m = v = None
    for t, (g_raw, lr, s) in enumerate(zip(grads, lrs, scales), start=1):
        g = g_raw.astype(np.float64) * s
        if name == "SGD":
            g = g + hp["weight_decay"] * p
            if hp["momentum"] > 0:
                buf = g.copy() if t == 1 else hp["momentum"] * buf + g
                d = g + hp["momentum"] * buf if hp["nesterov"] else buf
            else:
                d = g
            p = p - lr * d
            continue
        b1, b2 = hp["betas"]
        if name == "AdamW":
            p = p * (1 - lr * hp["weight_decay"])
        else:
            g = g + hp["weight_decay"] * p
        m = (1 - b1) * g if m is None else b1 * m + (1 - b1) * g
        v = (1 - b2) * g * g if v is None else b2 * v + (1 - b2) * g * g
        denom = np.sqrt(v) / math.sqrt(1 - b2 ** t) + hp["eps"]
        p = p - (lr / (1 - b1 ** t)) * m / denom
    state = {} if name == "SGD" and buf is None else (
        {"momentum_buffer": buf} if name == "SGD" else {"exp_avg": m, "exp_avg_sq": v})
    return p, state


def problem(dtype=np.float64, n=N, steps=STEPS, seed=0):
    rng = np.random.default_rng(seed)
    p0 = rng.standard_normal(n).astype(dtype)
    grads = [rng.standard_normal(n).astype(dtype) for _ in range(steps)]
    lrs = [0.5 + 0.5 * math.cos(t) ** 2 for t in range(1, steps + 1)]   # schedule-like
    scales = [1.0 if t % 3 == 0 else 0.3 + 0.05 * t for t in range(1, steps + 1)]
    return p0, grads, lrs, scales


def run(opt, p0, grads, lrs, scales, pieces=None, xp=np):
    """Run ``opt`` over the steps on ``xp`` arrays; ``pieces``: split points, each piece
    its own state. The parameters and states come back as NumPy arrays."""
    p = xp.asarray(p0).copy()
    grads = [xp.asarray(g) for g in grads]   # NumPy: the same arrays, no copy
    bounds = [0, *(pieces or []), len(p)]
    ranges = list(zip(bounds[:-1], bounds[1:]))
    states = [opt.init_state(b - a, p.dtype, xp) for a, b in ranges]
    for t, (g, lr, s) in enumerate(zip(grads, lrs, scales), start=1):
        for (a, b), st in zip(ranges, states):
            opt.update(p[a:b], g[a:b], st, t, opt.lr * lr, grad_scale=s)
    return to_numpy(p), [{name: to_numpy(a) for name, a in st.items()} for st in states]


# ----------------------------------------------------------------- update rules

@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_matches_reference_formula(config, xp):
    opt = CONFIGS[config]()
    assert isinstance(opt, Optimizer)
    p0, grads, lrs, scales = problem()
    p, (state,) = run(opt, p0, grads, lrs, scales, xp=xp)
    ref_p, ref_state = reference_run(opt, p0, grads, [opt.lr * lr for lr in lrs], scales)
    np.testing.assert_allclose(p, ref_p, rtol=1e-12, atol=1e-14)
    assert set(state) == set(ref_state)
    for name in state:
        np.testing.assert_allclose(state[name], ref_state[name], rtol=1e-12, atol=1e-14)
    assert not np.array_equal(p, p0)


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_float32_close_to_float64_reference(config):
    opt = CONFIGS[config]()
    p0, grads, lrs, scales = problem(np.float32, steps=5)
    p, _ = run(opt, p0, grads, lrs, scales)
    assert p.dtype == np.float32
    ref_p, _ = reference_run(opt, p0, grads, [opt.lr * lr for lr in lrs], scales)
    np.testing.assert_allclose(p, ref_p, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_split_ranges_equal_whole_vector_exactly(config, dtype, xp):
    # What ZeRO relies on: the shard's update is the whole vector's update there.
    p0, grads, lrs, scales = problem(dtype, n=1001, steps=8)
    whole, whole_state = run(CONFIGS[config](), p0, grads, lrs, scales, xp=xp)
    split, split_states = run(CONFIGS[config](), p0, grads, lrs, scales, pieces=[377], xp=xp)
    three, _ = run(CONFIGS[config](), p0, grads, lrs, scales, pieces=[1, 640], xp=xp)
    np.testing.assert_array_equal(split, whole)
    np.testing.assert_array_equal(three, whole)
    for name in whole_state[0]:
        joined = np.concatenate([st[name] for st in split_states])
        np.testing.assert_array_equal(joined, whole_state[0][name])


@pytest.mark.parametrize("config", ["sgd-nesterov", "adam-l2", "adamw"])
def test_chunk_size_never_changes_results(config):
    p0, grads, lrs, scales = problem(np.float32, steps=4)
    results = []
    for chunk in (1, 7, 64, 1 << 16):
        opt = CONFIGS[config]()
        opt.chunk_size = chunk
        results.append(run(opt, p0, grads, lrs, scales)[0])
    for r in results[1:]:
        np.testing.assert_array_equal(r, results[0])


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_grad_scale_equals_premultiplied_grads(config):
    p0, grads, lrs, _ = problem(steps=6)
    ones = [1.0] * len(grads)
    for s, rtol in ((0.25, 0.0), (0.3, 1e-14)):   # a power of two scales exactly
        scaled, _ = run(CONFIGS[config](), p0, grads, lrs, [s] * len(grads))
        pre, _ = run(CONFIGS[config](), p0, [g * s for g in grads], lrs, ones)
        if rtol == 0.0:
            np.testing.assert_array_equal(scaled, pre)
        else:
            np.testing.assert_allclose(scaled, pre, rtol=rtol, atol=1e-15)


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_grads_are_never_written(config, xp):
    p0, grads, lrs, scales = problem(steps=3)
    grads = [xp.asarray(g) for g in grads]
    originals = [g.copy() for g in grads]
    if xp is np:
        for g in grads:
            g.flags.writeable = False      # any write would raise
    run(CONFIGS[config](), p0, grads, lrs, scales, xp=xp)
    for g, g0 in zip(grads, originals):
        np.testing.assert_array_equal(to_numpy(g), to_numpy(g0))


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_no_allocation_after_first_update(config):
    n = 300_000                        # several default-size chunks
    opt = CONFIGS[config]()
    opt.chunk_size = 1 << 16
    rng = np.random.default_rng(1)
    p = rng.standard_normal(n)
    g = rng.standard_normal(n)
    state = opt.init_state(n, p.dtype, np)
    opt.update(p, g, state, 1, 0.01, grad_scale=0.5)
    scratch = opt._scratch.get(np, p.dtype, 1)
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        opt.update(p, g, state, 2, 0.01, grad_scale=0.5)
        opt.update(p[10:], g[10:], {k: a[10:] for k, a in state.items()}, 3, 0.01)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak - before < 16_000, f"{peak - before} bytes allocated by update"
    again = opt._scratch.get(np, p.dtype, 1)
    assert all(a is b for a, b in zip(scratch, again))
    assert scratch[0].shape == (1 << 16,)


def test_momentum_buffer_is_the_gradient_on_step_one():
    # PyTorch's first step: buf = g, whatever the buffer held (e.g. a restart).
    opt = SGD(lr=0.5, momentum=0.9, chunk_size=CHUNK)
    p, g = np.ones(N), np.full(N, 2.0)
    state = {"momentum_buffer": np.full(N, 123.0)}
    opt.update(p, g, state, 1, 0.5)
    np.testing.assert_array_equal(state["momentum_buffer"], g)
    np.testing.assert_array_equal(p, np.zeros(N))
    opt.update(p, g, state, 2, 0.5)
    np.testing.assert_array_equal(state["momentum_buffer"], np.full(N, 3.8))
    np.testing.assert_array_equal(p, np.full(N, -1.9))


def test_scratch_grows_only():
    opt = Adam(chunk_size=100)
    for n, expected in ((10, 10), (50, 50), (20, 50), (1000, 100)):
        p, g = np.zeros(n), np.ones(n)
        opt.update(p, g, opt.init_state(n, p.dtype, np), 1, 0.1)
        assert opt._scratch.get(np, np.float64, 1)[0].shape == (expected,)


def test_init_state():
    assert SGD(lr=0.1).init_state(5, np.float32, np) == {}
    st = SGD(lr=0.1, momentum=0.9).init_state(5, np.float32, np)
    assert list(st) == ["momentum_buffer"]
    for cls in (Adam, AdamW):
        st = cls().init_state(7, np.float32, np)
        assert sorted(st) == ["exp_avg", "exp_avg_sq"]
        for a in st.values():
            assert a.shape == (7,) and a.dtype == np.float32 and not a.any()


def test_update_checks_its_arguments():
    opt = Adam()
    p = np.zeros(4)
    st = opt.init_state(4, p.dtype, np)
    with pytest.raises(ValueError, match="grads of shape"):
        opt.update(p, np.zeros(3), st, 1, 0.1)
    with pytest.raises(ValueError, match="dtype"):
        opt.update(p, np.zeros(4, np.float32), st, 1, 0.1)
    with pytest.raises(ValueError, match="exp_avg_sq"):
        opt.update(p, np.zeros(4), {"exp_avg": st["exp_avg"]}, 1, 0.1)
    with pytest.raises(ValueError, match="step >= 1, got 0"):
        opt.update(p, np.zeros(4), st, 0, 0.1)
    with pytest.raises(ValueError, match="1-D"):
        opt.update(p.reshape(2, 2), np.zeros((2, 2)), st, 1, 0.1)


def test_empty_range_is_a_no_op():
    for make in CONFIGS.values():
        opt = make()
        p = np.zeros(0)
        opt.update(p, np.zeros(0), opt.init_state(0, p.dtype, np), 1, 0.1)


# ----------------------------------------------------------------- hyperparameters

@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_hyperparameters_round_trip_through_json(config):
    opt = CONFIGS[config]()
    hp = opt.hyperparameters()
    assert hp["name"] == type(opt).__name__
    assert "chunk_size" not in hp
    back = optimizer_from_hyperparameters(json.loads(json.dumps(hp)))
    assert type(back) is type(opt) and back == opt
    assert back.hyperparameters() == hp


def test_registry():
    assert get_optimizer("sgd", lr=0.1, momentum=0.9) == SGD(lr=0.1, momentum=0.9)
    assert get_optimizer("Adam", lr=0.01) == Adam(lr=0.01)
    assert get_optimizer("adamw") == AdamW()
    assert AdamW().weight_decay == 1e-2 and Adam().weight_decay == 0.0
    with pytest.raises(ValueError, match="'lamb'"):
        get_optimizer("lamb")
    with pytest.raises(ValueError, match="unknown"):
        optimizer_from_hyperparameters({"name": "Adam", "lr": 0.1, "momentum": 0.9})
    with pytest.raises(ValueError, match="name"):
        optimizer_from_hyperparameters({"lr": 0.1})


@pytest.mark.parametrize("make, match", [
    (lambda: SGD(lr=-0.1), "lr >= 0.0, got -0.1"),
    (lambda: SGD(lr=float("nan")), "lr"),
    (lambda: SGD(lr=0.1, momentum=-0.5), "momentum >= 0.0, got -0.5"),
    (lambda: SGD(lr=0.1, nesterov=True), "momentum > 0 with nesterov"),
    (lambda: SGD(lr=0.1, weight_decay=-1), "weight_decay"),
    (lambda: Adam(lr=-1e-3), "lr >= 0.0, got -0.001"),
    (lambda: Adam(betas=(1.0, 0.999)), r"betas\[0\] in \[0.0, 1.0\), got 1.0"),
    (lambda: Adam(betas=(0.9, -0.1)), r"betas\[1\] in \[0.0, 1.0\), got -0.1"),
    (lambda: Adam(betas=(0.9,)), "betas as 2 numbers"),
    (lambda: Adam(eps=-1e-8), "eps"),
    (lambda: AdamW(weight_decay=-0.01), "weight_decay >= 0.0, got -0.01"),
    (lambda: Adam(lr="fast"), "expecting a number for lr, got 'fast'"),
    (lambda: Adam(chunk_size=0), "chunk_size >= 1"),
])
def test_bad_hyperparameters_raise(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# ----------------------------------------------------------------- schedules

def test_constant_schedule():
    s = ConstantSchedule()
    assert [s(t) for t in (1, 2, 1000)] == [1.0, 1.0, 1.0]


def test_warmup_schedule():
    s = WarmupSchedule(4)
    assert [s(t) for t in range(1, 7)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert WarmupSchedule(0)(1) == 1.0


def test_cosine_schedule_closed_form():
    s = CosineSchedule(total_steps=110, warmup_steps=10, min_ratio=0.1)
    for t in range(1, 11):
        assert s(t) == pytest.approx(t / 10, rel=1e-15)
    for t in range(11, 111):
        expected = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (t - 10) / 100))
        assert s(t) == pytest.approx(expected, rel=1e-14)
    assert s(60) == pytest.approx(0.55, rel=1e-14)        # half way: the mean
    assert s(110) == pytest.approx(0.1, rel=1e-14)
    assert s(500) == pytest.approx(0.1, rel=1e-14)        # stays at the floor
    plain = CosineSchedule(100)
    assert plain(100) == pytest.approx(0.0, abs=1e-15) and plain(1) < 1.0
    assert all(plain(t) > plain(t + 1) for t in range(1, 100))


def test_schedules_round_trip_and_check():
    for s in (ConstantSchedule(), WarmupSchedule(7), CosineSchedule(50, 5, 0.2)):
        back = schedule_from_dict(json.loads(json.dumps(s.to_dict())))
        assert back == s and [back(t) for t in range(1, 60)] == [s(t) for t in range(1, 60)]
    for bad in ({"name": "Linear"}, {"warmup_steps": 3},
                {"name": "WarmupSchedule", "steps": 3}):
        with pytest.raises(ValueError):
            schedule_from_dict(bad)
    for make in (lambda: WarmupSchedule(-1), lambda: CosineSchedule(0),
                 lambda: CosineSchedule(10, 10), lambda: CosineSchedule(10, min_ratio=1.5),
                 lambda: WarmupSchedule(2.5)):
        with pytest.raises(ValueError):
            make()
    with pytest.raises(ValueError, match="step >= 1, got 0"):
        CosineSchedule(10)(0)


# ----------------------------------------------------------------- clipping

def test_clip_coefficient():
    assert clip_coefficient(0.5, 1.0) == 1.0
    assert clip_coefficient(10.0, 1.0) == 1.0 / (10.0 + 1e-6)
    assert clip_coefficient(0.0, 1.0) == 1.0
    assert clip_coefficient(math.inf, 1.0) == 0.0
    assert math.isnan(clip_coefficient(math.nan, 1.0))
    with pytest.raises(ValueError, match="max_norm > 0"):
        clip_coefficient(1.0, 0.0)


def test_sum_of_squares_in_float64(xp):
    rng = np.random.default_rng(2)
    host32 = (rng.standard_normal(100_003) * 1e3).astype(np.float32)
    expected = float(np.sum(host32.astype(np.float64) ** 2))
    x32 = xp.asarray(host32)
    assert sum_of_squares(x32) == pytest.approx(expected, rel=1e-12)
    scratch = xp.empty(1000)
    assert sum_of_squares(x32, scratch) == pytest.approx(expected, rel=1e-12)
    matrix = x32[:-3].reshape(100, 1000)
    assert sum_of_squares(matrix) == pytest.approx(
        float(np.sum(host32[:-3].astype(np.float64) ** 2)), rel=1e-12)
    host64 = rng.standard_normal(70_001)
    assert sum_of_squares(xp.asarray(host64)) == pytest.approx(float(np.sum(host64 ** 2)),
                                                               rel=1e-12)
    assert sum_of_squares(xp.zeros(0, np.float32)) == 0.0
    # float32 accumulation would lose this: 2**24 ones plus one more.
    ones = xp.ones((1 << 24) + 1, np.float32)
    assert sum_of_squares(ones) == float((1 << 24) + 1)
    with pytest.raises(ValueError, match="float64 scratch"):
        sum_of_squares(x32, xp.empty(10, np.float32))


def test_sum_of_squares_allocates_nothing_with_scratch():
    x = np.ones(500_000, np.float32)
    scratch = np.empty(1 << 14)
    sum_of_squares(x, scratch)
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        assert sum_of_squares(x, scratch) == 500_000.0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak - before < 16_000
