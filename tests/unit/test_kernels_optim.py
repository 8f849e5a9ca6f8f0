"""The fused optimizer kernels of mpishard.kernels.optim against their NumPy twins.

The fused kernels (Numba on NumPy arrays, CuPy kernels on CuPy arrays) do the
twins' operations in the twins' order and precision, so they must give the
same bits: every comparison here is exact. The strategies with either
implementation: tests/mpi/test_kernels_strategies.py.
"""

from __future__ import annotations

import math
import types

import numpy as np
import pytest

from mpishard.backend import to_numpy
from mpishard.kernels import (
    FUSED_MIN_ELEMENTS,
    ScratchBuffers,
    adam_update,
    adam_update_numpy,
    kernel_mode,
    select,
    sgd_update,
    sgd_update_numpy,
)
from mpishard.kernels import optim as kernels_optim

# Odd lengths; the last spans several chunks of the twins' default chunk size.
LENGTHS = [0, 1, 7, 1001, 3 * (1 << 16) + 5]
DTYPES = [np.float32, np.float64]
STEPS = 4
SCALES = [0.37, 1.0, 2.5, 1.0]       # clipping/averaging coefficients, 1.0 included
LRS = [1e-3, 3e-3, 2e-3, 1e-3]

# Adam's coefficients as mpishard.optim.Adam derives them (step_size, eps_hat from
# the bias corrections), and the decay/L2 of Adam, Adam with L2 and AdamW.
ADAM_CASES = {
    "adam": {"l2": 0.0, "wd": 0.0},
    "adam-l2": {"l2": 0.1, "wd": 0.0},
    "adamw": {"l2": 0.0, "wd": 0.3},
}
SGD_CASES = {
    "plain": {"momentum": 0.0, "nesterov": False, "weight_decay": 0.0},
    "decay": {"momentum": 0.0, "nesterov": False, "weight_decay": 0.01},
    "momentum": {"momentum": 0.9, "nesterov": False, "weight_decay": 0.0},
    "momentum-decay": {"momentum": 0.8, "nesterov": False, "weight_decay": 0.02},
    "nesterov-decay": {"momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
}


@pytest.fixture
def fused(monkeypatch, xp):
    """``MPISHARD_KERNELS=fused`` for the test; ``xp`` is the arrays' library."""
    if xp is np and not select.numba_available():
        pytest.skip("Numba does not import here: no fused CPU kernel to test")
    monkeypatch.setenv("MPISHARD_KERNELS", "fused")
    kernel_mode.cache_clear()
    yield xp
    monkeypatch.undo()
    kernel_mode.cache_clear()


def vectors(n, dtype, count, seed=0):
    """``count`` vectors of magnitudes from 1e-3 to 1e3 (some exact zeros)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        x = rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 3, n)
        x[rng.random(n) < 0.01] = 0.0
        out.append(x.astype(dtype))
    return out


def chunk_for(n):
    """The twins' chunk: several chunks and a ragged last one at every length > 64."""
    return 64 if n < 5000 else 1 << 16


def adam_kwargs(case, step, chunk=64):
    b1, b2, eps = 0.9, 0.999, 1e-8
    lr, c = LRS[step - 1], ADAM_CASES[case]
    sqrt_bc2 = math.sqrt(1.0 - b2 ** step)
    return {"beta1": b1, "beta2": b2, "step_size": lr * sqrt_bc2 / (1.0 - b1 ** step),
            "eps_hat": eps * sqrt_bc2, "decay": 1.0 - lr * c["wd"], "l2": c["l2"],
            "grad_scale": SCALES[step - 1], "chunk": chunk}


def sgd_kwargs(case, step, chunk=64):
    return {"lr": LRS[step - 1] * 10, **SGD_CASES[case], "grad_scale": SCALES[step - 1],
            "first_step": step == 1, "chunk": chunk}


def assert_same_bits(actual, expected, what):
    a, e = to_numpy(actual), to_numpy(expected)
    assert a.dtype == e.dtype and a.shape == e.shape, what
    # Equal bits (NaN payloads and the sign of zero included), not only equal values.
    assert a.tobytes() == e.tobytes(), (
        f"{what}: {int(np.sum(a.view(np.uint8) != e.view(np.uint8)))} bytes differ")


# ----------------------------------------------------------------- fused == twin

@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("case", sorted(ADAM_CASES))
def test_adam_fused_equals_twin_bitwise(case, n, dtype, fused):
    xp = fused
    p0, g0, m0 = vectors(n, dtype, 3)
    grads = [xp.asarray(g) for g in vectors(n, dtype, STEPS, seed=1)]
    twin = [xp.array(a) for a in (p0, m0, np.abs(m0))]     # copies
    fast = [a.copy() for a in twin]
    scratch = ScratchBuffers(2)
    for step in range(1, STEPS + 1):
        kw = adam_kwargs(case, step, chunk_for(n))
        adam_update_numpy(*twin[:1], grads[step - 1], *twin[1:], scratch=scratch, **kw)
        adam_update(*fast[:1], grads[step - 1], *fast[1:], scratch=scratch, **kw)
    for name, a, b in zip(("params", "exp_avg", "exp_avg_sq"), fast, twin):
        assert_same_bits(a, b, name)
    if n:
        assert not np.array_equal(to_numpy(fast[0]), p0)


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("case", sorted(SGD_CASES))
def test_sgd_fused_equals_twin_bitwise(case, n, dtype, fused):
    xp = fused
    p0, b0 = vectors(n, dtype, 2)
    grads = [xp.asarray(g) for g in vectors(n, dtype, STEPS, seed=1)]
    with_buffer = SGD_CASES[case]["momentum"] > 0
    twin = [xp.array(p0), xp.array(b0) if with_buffer else None]
    fast = [twin[0].copy(), twin[1].copy() if with_buffer else None]
    scratch = ScratchBuffers(2)
    for step in range(1, STEPS + 1):
        kw = sgd_kwargs(case, step, chunk_for(n))
        sgd_update_numpy(twin[0], grads[step - 1], twin[1], scratch=scratch, **kw)
        sgd_update(fast[0], grads[step - 1], fast[1], scratch=scratch, **kw)
    assert_same_bits(fast[0], twin[0], "params")
    if n:
        assert not np.array_equal(to_numpy(fast[0]), p0)
    if with_buffer:
        assert_same_bits(fast[1], twin[1], "momentum_buffer")


def test_fused_handles_strided_and_read_only_arrays(fused):
    # A ZeRO shard is a contiguous slice; a strided view and read-only gradients
    # must still give the twin's bits (Numba compiles those layouts separately).
    xp = fused
    p0, m0, g0 = (xp.asarray(a) for a in vectors(2001, np.float32, 3))
    if xp is np:
        g0.flags.writeable = False
    twin = [p0[::2].copy(), m0[::2].copy(), xp.abs(m0[::2])]
    fast = [xp.empty_like(p0), xp.empty_like(p0), xp.empty_like(p0)]
    for f, t in zip(fast, twin):
        f[::2] = t
    views = [f[::2] for f in fast]
    kw = adam_kwargs("adam-l2", 2)
    adam_update_numpy(twin[0], g0[::2], *twin[1:], scratch=ScratchBuffers(2), **kw)
    adam_update(views[0], g0[::2], *views[1:], scratch=ScratchBuffers(2), **kw)
    for a, b in zip(views, twin):
        assert_same_bits(a, b, "strided")


# ----------------------------------------------------------------- which one runs

class _Recorder:
    """Stands in for the Numba module: counts the fused calls, computes nothing."""

    def __init__(self):
        self.calls = 0

    def adam(self, p, g, m, v, *args):
        self.calls += 1


@pytest.fixture
def recorder(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(kernels_optim, "_numba", lambda: rec)
    return rec


def run_adam(n):
    p, g, m, v = (np.ones(n, np.float32) for _ in range(4))
    adam_update(p, g, m, v, scratch=ScratchBuffers(2), **adam_kwargs("adam", 1))
    return p


def test_auto_fuses_long_vectors_only(monkeypatch, recorder):
    monkeypatch.setattr(select, "numba_available", lambda: True)
    monkeypatch.delenv("MPISHARD_KERNELS", raising=False)
    kernel_mode.cache_clear()
    try:
        run_adam(FUSED_MIN_ELEMENTS - 1)
        assert recorder.calls == 0
        run_adam(FUSED_MIN_ELEMENTS)
        assert recorder.calls == 1
    finally:
        kernel_mode.cache_clear()


def test_reference_mode_never_fuses(monkeypatch, recorder):
    monkeypatch.setenv("MPISHARD_KERNELS", "reference")
    kernel_mode.cache_clear()
    try:
        p = run_adam(FUSED_MIN_ELEMENTS + 3)
    finally:
        kernel_mode.cache_clear()
    assert recorder.calls == 0
    assert not np.array_equal(p, np.ones_like(p))     # the twin updated it


def test_without_numba_auto_falls_back_and_fused_refuses(monkeypatch, recorder):
    # As in the ULFM environment (.venv-ft), which has no Numba.
    monkeypatch.setattr(select, "numba_available", lambda: False)
    monkeypatch.setenv("MPISHARD_KERNELS", "auto")
    kernel_mode.cache_clear()
    try:
        p = run_adam(FUSED_MIN_ELEMENTS + 3)
        assert recorder.calls == 0 and not np.array_equal(p, np.ones_like(p))
        monkeypatch.setenv("MPISHARD_KERNELS", "fused")
        kernel_mode.cache_clear()
        with pytest.raises(RuntimeError, match="MPISHARD_KERNELS=fused, but Numba"):
            run_adam(10)
    finally:
        kernel_mode.cache_clear()


def test_bad_mode_names_the_choices(monkeypatch):
    monkeypatch.setenv("MPISHARD_KERNELS", "fast")
    kernel_mode.cache_clear()
    try:
        with pytest.raises(ValueError, match="auto, reference, fused, got 'fast'"):
            kernel_mode()
    finally:
        monkeypatch.undo()
        kernel_mode.cache_clear()


def test_gpu_kernels_are_on_unless_turned_off(monkeypatch):
    """CuPy arrays run the CUDA kernels by default (they passed the gpu tests on an
    H100); MPISHARD_GPU_KERNELS=0 or MPISHARD_KERNELS=reference turns them off."""
    device = types.ModuleType("cupy")               # any namespace that is not NumPy
    monkeypatch.delenv("MPISHARD_GPU_KERNELS", raising=False)
    monkeypatch.setenv("MPISHARD_KERNELS", "auto")
    kernel_mode.cache_clear()
    try:
        assert select.fused_on(device)
        monkeypatch.setenv("MPISHARD_GPU_KERNELS", "0")
        assert not select.fused_on(device)
        monkeypatch.setenv("MPISHARD_GPU_KERNELS", "1")
        assert select.fused_on(device)
        monkeypatch.setenv("MPISHARD_KERNELS", "reference")
        kernel_mode.cache_clear()
        assert not select.fused_on(device)
    finally:
        monkeypatch.undo()
        kernel_mode.cache_clear()
