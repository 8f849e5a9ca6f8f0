"""Tests of mpishard.nn: gradients against central finite differences, and the model protocol.

Gradient checks run in float64 and compare the analytic gradient with central
differences of step 1e-6 at rtol 1e-6, atol 1e-8 (truncation error ~1e-12,
rounding ~1e-10 for losses of order 1).
"""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest

from mpishard.backend import array_namespace, to_numpy
from mpishard.flat import Range
from mpishard.nn import (
    GELU,
    MLP,
    Dropout,
    FunctionModel,
    LayerNorm,
    Linear,
    MSELoss,
    ReLU,
    Sequential,
    SoftmaxCrossEntropy,
    Tanh,
)
from mpishard.protocols import BucketedModel, Model

EPS = 1e-6
RTOL = 1e-6
ATOL = 1e-8


def batch(rows: int, features: int, classes: int = 3, seed: int = 0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(rows, features)), rng.integers(0, classes, size=rows)


def loss_at(model, x, y, ctx=None) -> float:
    if ctx is not None:
        model.set_batch_context(*ctx)
    return model.forward_backward(x, y)


def numeric_grad(model, x, y, ctx=None) -> np.ndarray:
    """Central differences of the loss in every parameter (a NumPy array)."""
    p = model.params
    g = np.empty(p.shape, dtype=np.float64)
    for k in range(p.size):
        old = float(p[k])
        p[k] = old + EPS
        up = loss_at(model, x, y, ctx)
        p[k] = old - EPS
        down = loss_at(model, x, y, ctx)
        p[k] = old
        g[k] = (up - down) / (2 * EPS)
    return g


def check_gradients(model, x, y, ctx=None) -> None:
    loss_at(model, x, y, ctx)
    analytic = to_numpy(model.grads).copy()
    np.testing.assert_allclose(analytic, numeric_grad(model, x, y, ctx), rtol=RTOL, atol=ATOL)


def randomize(model, seed: int = 1) -> None:
    """Move every parameter off its initial value (LayerNorm starts at 1 and 0)."""
    noise = 0.3 * np.random.default_rng(seed).normal(size=model.params.size)
    model.params[...] += array_namespace(model.params).asarray(noise)


# -- gradients of each layer and loss ---------------------------------------------


@pytest.mark.parametrize("bias", [True, False])
def test_linear_gradients_mse(bias, xp):
    # Two Linear layers: the second one's input gradient is exercised too.
    model = Sequential([Linear(4, 5, bias=bias), Linear(5, 2, bias=bias)], MSELoss(), xp=xp)
    x, _ = batch(6, 4)
    t = np.random.default_rng(3).normal(size=(6, 2))
    check_gradients(model, xp.asarray(x), xp.asarray(t))


@pytest.mark.parametrize("activation", [ReLU, GELU, Tanh])
def test_activation_gradients_cross_entropy(activation):
    model = Sequential([Linear(4, 5), activation(), Linear(5, 3)], SoftmaxCrossEntropy())
    x, y = batch(7, 4)
    check_gradients(model, x, y)


def test_layer_norm_gradients():
    model = Sequential([Linear(4, 6), LayerNorm(6), Tanh(), Linear(6, 3)], SoftmaxCrossEntropy())
    randomize(model)
    x, y = batch(5, 4)
    check_gradients(model, x, y)


def test_dropout_gradients_with_fixed_context():
    model = Sequential([Linear(4, 6), Dropout(0.4, seed=7), Linear(6, 3)], SoftmaxCrossEntropy())
    x, y = batch(5, 4)
    check_gradients(model, x, y, ctx=(2, 3, 10))


@pytest.mark.parametrize("activation", ["relu", "gelu", "tanh"])
@pytest.mark.parametrize("loss", ["cross_entropy", "mse"])
def test_mlp_gradients(activation, loss, xp):
    model = MLP([3, 5, 4, 2], activation=activation, loss=loss, layer_norm=True, dropout=0.25,
                xp=xp)
    randomize(model)
    x, y = batch(6, 3, classes=2)
    if loss == "mse":
        y = np.random.default_rng(5).normal(size=(6, 2))
    check_gradients(model, xp.asarray(x), xp.asarray(y), ctx=(1, 0, 6))


def test_accumulate_adds_and_default_overwrites():
    model = MLP([4, 6, 3], layer_norm=True)
    randomize(model)
    xa, ya = batch(5, 4, seed=1)
    xb, yb = batch(3, 4, seed=2)
    model.forward_backward(xa, ya)
    ga = model.grads.copy()
    model.forward_backward(xb, yb)
    gb = model.grads.copy()
    # Overwrite: the second call did not add to the first.
    model.grads[...] = 123.0
    model.forward_backward(xb, yb)
    np.testing.assert_array_equal(model.grads, gb)
    # Accumulate: the sum of the two, exactly as the finite differences of the sum.
    model.forward_backward(xa, ya)
    model.forward_backward(xb, yb, accumulate=True)
    np.testing.assert_allclose(model.grads, ga + gb, rtol=1e-13, atol=1e-15)
    numeric = numeric_grad(model, xa, ya) + numeric_grad(model, xb, yb)
    model.forward_backward(xa, ya)
    model.forward_backward(xb, yb, accumulate=True)
    np.testing.assert_allclose(model.grads, numeric, rtol=RTOL, atol=ATOL)


# -- values against closed forms ---------------------------------------------------


def test_loss_values_against_closed_form():
    x, y = batch(8, 4)
    model = MLP([4, 6, 3])
    logits = model.forward(x)
    shifted = logits - logits.max(axis=1, keepdims=True)
    lse = np.log(np.exp(shifted).sum(axis=1))
    reference = np.mean(lse - shifted[np.arange(8), y])
    assert model.forward_backward(x, y) == pytest.approx(reference, rel=1e-13)

    reg = MLP([4, 6, 2], loss="mse")
    t = np.random.default_rng(1).normal(size=(8, 2))
    out = reg.forward(x)
    assert reg.forward_backward(x, t) == pytest.approx(np.mean((out - t) ** 2), rel=1e-13)


def test_cross_entropy_is_stable_for_large_logits():
    model = Sequential([Linear(2, 3)], SoftmaxCrossEntropy())
    model.params[...] = 0
    model.layers[0].params["bias"][...] = [1000.0, 0.0, -1000.0]
    x, _ = batch(2, 2)
    # log-softmax of (1000, 0, -1000) is (0, -1000, -2000) to rounding.
    assert model.forward_backward(x, np.array([1, 2])) == pytest.approx(1500.0, rel=1e-12)
    assert np.all(np.isfinite(model.grads))


def test_activation_and_layer_norm_values():
    x = np.random.default_rng(0).normal(size=(5, 4)) * 2
    gelu = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    for layer, reference in [(ReLU(), np.maximum(x, 0)), (Tanh(), np.tanh(x)), (GELU(), gelu)]:
        np.testing.assert_allclose(Sequential([layer], MSELoss()).forward(x), reference,
                                   rtol=1e-14, atol=1e-15)
    model = Sequential([LayerNorm(4, eps=1e-3)], MSELoss())
    randomize(model)
    w, b = model.layers[0].params["weight"], model.layers[0].params["bias"]
    ln = (x - x.mean(1, keepdims=True)) / np.sqrt(x.var(1, keepdims=True) + 1e-3) * w + b
    np.testing.assert_allclose(model.forward(x), ln, rtol=1e-13, atol=1e-14)


def test_float32_model_matches_float64():
    x, y = batch(16, 8)
    m64, m32 = MLP([8, 16, 3], seed=4), MLP([8, 16, 3], seed=4, dtype=np.float32)
    np.testing.assert_array_equal(m32.params, m64.params.astype(np.float32))
    l64, l32 = m64.forward_backward(x, y), m32.forward_backward(x, y)
    assert m32.grads.dtype == np.float32
    assert l32 == pytest.approx(l64, rel=1e-5)
    np.testing.assert_allclose(m32.grads, m64.grads, rtol=1e-4, atol=1e-5)


# -- the flat vector, layout and initialisation ------------------------------------


def test_layout_names_and_views_share_memory():
    model = MLP([6, 5, 4, 3])
    assert model.layout.names == ("0.weight", "0.bias", "2.weight", "2.bias",
                                  "4.weight", "4.bias")
    assert model.layout.size == 6 * 5 + 5 + 5 * 4 + 4 + 4 * 3 + 3 == model.params.size
    assert model.layout["0.weight"].shape == (6, 5)
    assert isinstance(model, BucketedModel)
    for i in (0, 2, 4):
        layer = model.layers[i]
        for local in ("weight", "bias"):
            view = layer.params[local]
            assert np.shares_memory(view, model.params)
            np.testing.assert_array_equal(view, model.layout.view(model.params, f"{i}.{local}"))
    # Writing the flat vector is writing the layers: zero weights give bias-only logits.
    model.params[...] = 0
    model.layout.view(model.params, "4.bias")[...] = [1.0, 2.0, 3.0]
    x, y = batch(2, 6)
    np.testing.assert_array_equal(model.forward(x), [[1.0, 2.0, 3.0]] * 2)
    # And gradients land in the flat gradient vector, through views of it.
    model.forward_backward(x, y)
    g = model.layout.view(model.grads, "4.bias")
    p = np.exp([1.0, 2.0, 3.0]) / np.exp([1.0, 2.0, 3.0]).sum()
    np.testing.assert_allclose(g, p - np.eye(3)[y].mean(0), rtol=1e-14)


def test_initialisation_is_seeded_and_pytorch_like():
    a, b, c = MLP([256, 128, 3], seed=0), MLP([256, 128, 3], seed=0), MLP([256, 128, 3], seed=1)
    np.testing.assert_array_equal(a.params, b.params)
    assert not np.array_equal(a.params, c.params)
    w = a.layout.view(a.params, "0.weight")
    bound = 1 / math.sqrt(256)
    assert np.abs(w).max() <= bound
    # Uniform on [-bound, bound]: standard deviation bound / sqrt(3), to 2 %.
    assert w.std() == pytest.approx(bound / math.sqrt(3), rel=0.02)
    ln = Sequential([LayerNorm(3)], MSELoss())
    np.testing.assert_array_equal(ln.params, [1, 1, 1, 0, 0, 0])


def test_wrong_dtype_raises_type_error():
    for dtype in (np.float16, np.int32, np.complex128):
        with pytest.raises(TypeError, match=np.dtype(dtype).name):
            Sequential([Linear(2, 2)], MSELoss(), dtype=dtype)
        with pytest.raises(TypeError, match="float32 or float64"):
            MLP([2, 2], dtype=dtype)
    with pytest.raises(TypeError, match="int64"):
        FunctionModel(lambda p, x, y: (0.0, p), np.zeros(3, dtype=np.int64))


def test_bad_inputs_raise():
    model = MLP([4, 3])
    x, y = batch(5, 4)
    with pytest.raises(TypeError, match="integer class labels"):
        model.forward_backward(x, y.astype(float))
    with pytest.raises(ValueError, match=r"\(5,\)"):
        model.forward_backward(x, y[:4])
    with pytest.raises(ValueError, match="expects 4 input features, got 3"):
        model.forward_backward(x[:, :3], y)
    with pytest.raises(TypeError, match="floating-point targets"):
        MLP([4, 1], loss="mse").forward_backward(x, y)
    with pytest.raises(ValueError, match="activation"):
        MLP([4, 3], activation="sigmoid")
    model.set_batch_context(0, 3, 6)
    with pytest.raises(ValueError, match="do not fit"):
        model.forward_backward(x, y)


def test_input_of_another_dtype_is_cast():
    x, y = batch(5, 4)
    model = MLP([4, 6, 3])
    loss32 = model.forward_backward(x.astype(np.float32), y)
    g32 = model.grads.copy()
    loss64 = model.forward_backward(x.astype(np.float32).astype(np.float64), y)
    assert loss32 == loss64
    np.testing.assert_array_equal(g32, model.grads)


# -- the BucketedModel protocol ------------------------------------------------------


class Recorder:
    """Hooks that record calls and check the gradient at each one."""

    def __init__(self, model):
        self.model = model
        self.calls = []

    def before(self, r):
        # Nothing in r is written yet (the gradient was filled with NaN).
        assert np.all(np.isnan(self.model.grads[r.start:r.stop]))
        self.calls.append(("before", r))

    def after(self, r):
        # Every gradient at offsets >= r.start is final.
        assert np.all(np.isfinite(self.model.grads[r.start:]))
        self.calls.append(("after", r))


def test_hooks_called_in_backward_order_with_layer_ranges():
    model = MLP([4, 6, 5, 3], layer_norm=True)
    reference = MLP([4, 6, 5, 3], layer_norm=True)
    x, y = batch(5, 4)
    reference.forward_backward(x, y)
    hooks = Recorder(model)
    model.set_backward_hooks(hooks)
    model.grads[...] = np.nan
    model.forward_backward(x, y)
    lay = model.layout

    def span(i):
        return Range(lay[f"{i}.weight"].offset, lay[f"{i}.bias"].range.stop)

    # Layers: 0 Linear, 1 LayerNorm, 2 ReLU, 3 Linear, 4 LayerNorm, 5 ReLU, 6 Linear.
    expected = []
    for i in (6, 4, 3, 1, 0):
        expected += [("before", span(i)), ("after", span(i))]
    assert hooks.calls == expected
    assert expected[0][1].stop == lay.size and expected[-2][1] == Range(0, 4 * 6 + 6)
    np.testing.assert_array_equal(model.grads, reference.grads)
    # Removing the hooks: no more calls.
    model.set_backward_hooks(None)
    model.forward_backward(x, y)
    assert len(hooks.calls) == len(expected)


def test_bind_gradients_redirects_writes():
    x, y = batch(6, 4)
    plain, bound = MLP([4, 6, 3], dropout=0.3), MLP([4, 6, 3], dropout=0.3)
    plain.forward_backward(x, y)
    # Separate arrays per tensor, as a strategy with bucket buffers would give.
    store = {s.name: np.full(s.shape, np.nan) for s in bound.layout}
    bound.bind_gradients(lambda name: store[name])
    assert bound.grads is None
    bound.forward_backward(x, y)
    for name, g in store.items():
        np.testing.assert_array_equal(g, plain.layout.view(plain.grads, name))
    # Accumulation adds to the bound views.
    plain.forward_backward(x, y, accumulate=True)
    bound.forward_backward(x, y, accumulate=True)
    for name, g in store.items():
        np.testing.assert_array_equal(g, plain.layout.view(plain.grads, name))
    with pytest.raises(ValueError, match="expecting shape"):
        bound.bind_gradients(lambda name: np.zeros(2))
    with pytest.raises(TypeError, match="float32"):
        bound.bind_gradients(lambda name: np.zeros(bound.layout[name].shape, np.float32))


def test_first_layer_computes_no_input_gradient(monkeypatch):
    model = MLP([4, 6, 3])
    calls = []

    def refuse(dy, buf):
        raise AssertionError("dx of the model input was computed")

    monkeypatch.setattr(model.layers[0], "backward_input", refuse)
    original = model.layers[2].backward_input
    monkeypatch.setattr(model.layers[2], "backward_input",
                        lambda dy, buf: calls.append(1) or original(dy, buf))
    x, y = batch(5, 4)
    model.forward_backward(x, y)
    assert calls == [1]
    assert "dx" not in model._workspaces[(True, 0)].layers[0]
    reference = MLP([4, 6, 3])
    reference.forward_backward(x, y)
    np.testing.assert_array_equal(model.grads, reference.grads)


def test_empty_batch_gives_zero_loss_and_gradient_and_calls_hooks():
    model = MLP([4, 6, 3], dropout=0.5)
    hooks = Recorder(model)
    model.set_backward_hooks(hooks)
    model.grads[...] = np.nan
    x, y = batch(0, 4)
    assert model.forward_backward(x, y) == 0.0
    np.testing.assert_array_equal(model.grads, 0.0)
    assert [c[0] for c in hooks.calls] == ["before", "after"] * 2


# -- dropout ---------------------------------------------------------------------------


def test_dropout_mask_is_the_documented_stream():
    p, seed, step, g, features = 0.3, 11, 4, 9, 6
    model = Sequential([Dropout(p, seed=seed)], MSELoss())
    x = np.random.default_rng(0).normal(size=(g, features))
    u = np.random.default_rng([seed, 0, step]).random((g, features), dtype=np.float32)
    expected = x * (u >= p) / (1 - p)
    model.set_batch_context(step, 2, g)
    loss = model.forward_backward(x[2:7], np.zeros((5, features)))
    assert loss == pytest.approx(np.mean(expected[2:7] ** 2), rel=1e-13)
    # Without a context the step counts calls: call 0 is step 0, call 1 is step 1.
    fresh = Sequential([Dropout(p, seed=seed)], MSELoss())
    for s in range(2):
        u = np.random.default_rng([seed, 0, s]).random((g, features), dtype=np.float32)
        ref = np.mean((x * (u >= p) / (1 - p)) ** 2)
        assert fresh.forward_backward(x, np.zeros_like(x)) == pytest.approx(ref, rel=1e-13)
    # Inference is the identity.
    np.testing.assert_array_equal(model.forward(x), x)


@pytest.mark.parametrize("split", [4, 3])
def test_dropout_split_invariance(split):
    global_size, step = 8, 5
    x, y = batch(global_size, 4)
    whole = MLP([4, 6, 6, 3], dropout=0.5, seed=2)
    whole.set_batch_context(step, 0, global_size)
    loss = whole.forward_backward(x, y)
    g_whole = whole.grads.copy()

    halves = MLP([4, 6, 6, 3], dropout=0.5, seed=2)
    losses, grads = [], []
    for lo, hi in ((0, split), (split, global_size)):
        halves.set_batch_context(step, lo, global_size)
        losses.append(halves.forward_backward(x[lo:hi], y[lo:hi]) * (hi - lo) / global_size)
        grads.append(halves.grads * (hi - lo) / global_size)
    assert sum(losses) == pytest.approx(loss, rel=1e-13)
    np.testing.assert_allclose(grads[0] + grads[1], g_whole, rtol=1e-12, atol=1e-15)
    # A different step draws another mask (so the check above is not vacuous).
    whole.set_batch_context(step + 1, 0, global_size)
    assert whole.forward_backward(x, y) != pytest.approx(loss, rel=1e-6)


def test_dropout_micro_batches_accumulate_to_whole():
    x, y = batch(8, 4)
    whole = MLP([4, 6, 3], dropout=0.5, seed=3)
    whole.set_batch_context(7, 0, 8)
    whole.forward_backward(x, y)
    micro = MLP([4, 6, 3], dropout=0.5, seed=3)
    micro.set_batch_context(7, 0, 8)
    micro.forward_backward(x[:4], y[:4])
    micro.set_batch_context(7, 4, 8)
    micro.forward_backward(x[4:], y[4:], accumulate=True)
    np.testing.assert_allclose(micro.grads / 2, whole.grads, rtol=1e-12, atol=1e-15)


# -- buffers ----------------------------------------------------------------------------


def steady_state_peak(model, x, y) -> int:
    """Peak bytes traced during three steps, after a first call made the buffers."""
    model.forward_backward(x, y)
    model.forward_backward(x, y, accumulate=True)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        for _ in range(3):
            model.forward_backward(x, y)
            model.forward_backward(x, y, accumulate=True)
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("rows", [128, 512])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_step_loop_allocates_nothing_after_first_call(rows, dtype, activation):
    model = MLP([64, 256, 256, 10], activation=activation, layer_norm=True, dropout=0.1,
                dtype=dtype)
    x, y = batch(rows, 64, classes=10)
    x = x.astype(dtype)
    peak = steady_state_peak(model, x, y)
    # One activation buffer is rows * 256 * itemsize bytes (128 KiB at 128 rows
    # in float32, 1 MiB at 512 in float64). What remains does not grow with the
    # batch: Python objects, and NumPy's own iteration buffer for broadcasting
    # ufuncs (np.getbufsize() = 8192 elements, 64 KiB in float64), which no out=
    # argument avoids. Measured: about 35 KiB (float32), 67 KiB (float64).
    assert peak < 96 * 1024, peak
    buffers = [dict(b) for b in model._workspaces[(True, 0)].layers]
    model.forward_backward(x, y)
    after = model._workspaces[(True, 0)].layers
    assert all(after[i][k] is v for i, b in enumerate(buffers) for k, v in b.items())
    # A new batch shape re-makes them.
    model.forward_backward(x[:64], y[:64])
    assert model._workspaces[(True, 0)].layers[0]["y"].shape == (64, 256)


def test_forward_returns_a_copy():
    model = MLP([4, 6, 3])
    x1, _ = batch(5, 4, seed=1)
    x2, _ = batch(5, 4, seed=2)
    a = model.forward(x1)
    model.forward(x2)
    np.testing.assert_array_equal(a, model.forward(x1))
    assert not np.array_equal(a, model.forward(x2))


# -- FunctionModel ---------------------------------------------------------------------


def quadratic(params, x, y):
    """Least squares ``mean_i (x_i . p - y_i)^2 / 2`` and its gradient."""
    r = x @ params - y
    return 0.5 * np.mean(r**2), x.T @ r / len(x)


def test_function_model_quadratic():
    rng = np.random.default_rng(0)
    x, y, p0 = rng.normal(size=(10, 4)), rng.normal(size=10), rng.normal(size=4)
    model = FunctionModel(quadratic, p0, predict=lambda p, x: x @ p)
    assert isinstance(model, Model) and not isinstance(model, BucketedModel)
    assert model.layout.names == ("params",) and model.layout.size == 4
    p0[...] = 0  # the model holds a copy
    assert np.all(model.params != 0)
    loss = model.forward_backward(x, y)
    r = x @ model.params - y
    assert loss == pytest.approx(0.5 * np.mean(r**2), rel=1e-14)
    check_gradients(model, x, y)
    g = x.T @ r / 10
    model.forward_backward(x, y)
    model.forward_backward(x, y, accumulate=True)
    np.testing.assert_allclose(model.grads, 2 * g, rtol=1e-14)
    np.testing.assert_allclose(model.forward(x), x @ model.params, rtol=1e-14)


def test_function_model_errors():
    p = np.ones(3)
    with pytest.raises(ValueError, match=r"shape \(2,\), expecting \(3,\)"):
        FunctionModel(lambda p, x, y: (0.0, np.zeros(2)), p).forward_backward(None, None)
    with pytest.raises(TypeError, match="dtype float32, expecting float64"):
        FunctionModel(lambda p, x, y: (0.0, p.astype(np.float32)), p).forward_backward(None, None)
    with pytest.raises(NotImplementedError, match="predict"):
        FunctionModel(quadratic, p).forward(np.ones((1, 3)))
    with pytest.raises(ValueError, match="1-D"):
        FunctionModel(quadratic, np.ones((2, 2)))
