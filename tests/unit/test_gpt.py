"""Tests of the GPT model, its pieces and pipeline stages, without MPI.

Gradients are checked against central finite differences in float64 (step 1e-6,
rtol 1e-6, atol 1e-8, as tests/unit/test_nn.py); the forward against a plain NumPy
reimplementation written from the definition (loops over heads, no buffers).
Stage-split models are compared with the whole model at rtol 1e-13 (the same
operations in the same order).
"""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest

from mpishard.flat import Range, unit_ranges
from mpishard.nn import (
    GPT,
    MLP,
    CausalSelfAttention,
    Embedding,
    LayerStack,
    LMHead,
    ParallelMLP,
    SoftmaxCrossEntropy,
    TensorShard,
    TransformerBlock,
    VocabParallelCrossEntropy,
    owned_ranges,
    tensor_shards,
)
from mpishard.nn.shards import split_range
from mpishard.protocols import BucketedModel

EPS = 1e-6
RTOL = 1e-6
ATOL = 1e-8
V, T, D, H, L = 11, 5, 8, 2, 2          # the small GPT of every gradient check


def tokens(batch: int, length: int = T, vocab: int = V, seed: int = 0):
    rng = np.random.default_rng(seed)
    shape = (batch, length)
    return rng.integers(0, vocab, size=shape), rng.integers(0, vocab, size=shape)


def randomize(model, scale: float = 0.3, seed: int = 1) -> None:
    """Move every parameter off its initial value (LayerNorms at 1 and 0, biases at 0)."""
    model.params[...] += scale * np.random.default_rng(seed).normal(size=model.params.size)


def numeric_grad(model, x, y) -> np.ndarray:
    p = model.params
    g = np.empty_like(p)
    for k in range(p.size):
        old = p[k]
        p[k] = old + EPS
        up = model.forward_backward(x, y)
        p[k] = old - EPS
        down = model.forward_backward(x, y)
        p[k] = old
        g[k] = (up - down) / (2 * EPS)
    return g


def check_gradients(model, x, y) -> None:
    model.forward_backward(x, y)
    analytic = model.grads.copy()
    numeric = numeric_grad(model, x, y)
    for spec in model.layout:   # per tensor: a failure names it
        r = spec.range.slice()
        np.testing.assert_allclose(analytic[r], numeric[r], rtol=RTOL, atol=ATOL,
                                   err_msg=spec.name)


# -- a reference GPT from the definition ---------------------------------------------


def _ln(z, w, b, eps=1e-5):
    return (z - z.mean(-1, keepdims=True)) / np.sqrt(z.var(-1, keepdims=True) + eps) * w + b


def _gelu(z):
    return 0.5 * z * (1 + np.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z**3)))


def reference_logits(model: GPT, x: np.ndarray) -> np.ndarray:
    P = {s.name: model.layout.view(model.params, s.name) for s in model.layout}
    n, heads, hd = model.n_layers, model.n_heads, model.d_model // model.n_heads
    b, t = x.shape
    h = P["0.wte"][x] + P["0.wpe"][:t]
    causal = np.tril(np.ones((t, t), dtype=bool))
    for i in range(1, n + 1):
        a = _ln(h, P[f"{i}.ln1.weight"], P[f"{i}.ln1.bias"])
        q, k, v = (a @ P[f"{i}.attn.w{c}"] + P[f"{i}.attn.b{c}"] for c in "qkv")
        att = np.zeros_like(h)
        for j in range(heads):
            s = slice(j * hd, (j + 1) * hd)
            scores = q[:, :, s] @ k[:, :, s].transpose(0, 2, 1) / math.sqrt(hd)
            scores = np.where(causal, scores, -np.inf)
            w = np.exp(scores - scores.max(-1, keepdims=True))
            att[:, :, s] = (w / w.sum(-1, keepdims=True)) @ v[:, :, s]
        h = h + att @ P[f"{i}.attn.wo"] + P[f"{i}.attn.bo"]
        m = _ln(h, P[f"{i}.ln2.weight"], P[f"{i}.ln2.bias"])
        m = _gelu(m @ P[f"{i}.mlp.fc1.weight"] + P[f"{i}.mlp.fc1.bias"])
        h = h + m @ P[f"{i}.mlp.fc2.weight"] + P[f"{i}.mlp.fc2.bias"]
    last = n + 1
    return _ln(h, P[f"{last}.ln_f.weight"], P[f"{last}.ln_f.bias"]) @ P[f"{last}.head.weight"]


def reference_loss(logits: np.ndarray, y: np.ndarray) -> float:
    z = logits.reshape(-1, logits.shape[-1])
    z = z - z.max(1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(1, keepdims=True))
    return float(-logp[np.arange(len(z)), y.reshape(-1)].mean())


def test_forward_and_loss_match_the_definition():
    model = GPT(V, T, D, H, 3, seed=5)
    randomize(model, 0.2)
    x, y = tokens(4)
    ref = reference_logits(model, x)
    np.testing.assert_allclose(model.forward(x), ref, rtol=1e-12, atol=1e-13)
    assert model.forward_backward(x, y) == pytest.approx(reference_loss(ref, y), rel=1e-12)
    # A shorter sequence uses the first positions.
    np.testing.assert_allclose(model.forward(x[:, :3]), reference_logits(model, x[:, :3]),
                               rtol=1e-12, atol=1e-13)


# -- gradients ---------------------------------------------------------------------


@pytest.mark.parametrize("length", [T, 3])
def test_gpt_gradients(length):
    model = GPT(V, T, D, H, L, seed=3)
    randomize(model)
    x, y = tokens(3, length)
    check_gradients(model, x, y)


def piece_model(middle, loss=None):
    """Embedding, ``middle`` layers, head: each piece is checked inside a language model."""
    layers = [Embedding(V, T, D), *middle, LMHead(D, V)]
    return LayerStack(layers, loss or SoftmaxCrossEntropy())


@pytest.mark.parametrize("piece", ["embedding+head", "attention", "block", "two blocks",
                                   "vocab-parallel loss"])
def test_piece_gradients(piece):
    middle = {"embedding+head": [], "attention": [CausalSelfAttention(D, H)],
              "block": [TransformerBlock(D, H)],
              "two blocks": [TransformerBlock(D, 4), TransformerBlock(D, 1)],
              "vocab-parallel loss": []}[piece]
    loss = VocabParallelCrossEntropy(V) if piece == "vocab-parallel loss" else None
    model = piece_model(middle, loss)
    randomize(model, seed=7)
    x, y = tokens(2, 4, seed=2)
    check_gradients(model, x, y)


def test_vocab_parallel_loss_equals_softmax_cross_entropy_serially():
    a, b = piece_model([TransformerBlock(D, H)]), piece_model([TransformerBlock(D, H)],
                                                              VocabParallelCrossEntropy(V))
    randomize(a)
    randomize(b)
    x, y = tokens(3)
    assert b.forward_backward(x, y) == pytest.approx(a.forward_backward(x, y), rel=1e-14)
    np.testing.assert_allclose(b.grads, a.grads, rtol=1e-12, atol=1e-16)


def test_accumulate_adds_and_bound_gradients_match():
    model = GPT(V, T, D, H, L)
    randomize(model)
    xa, ya = tokens(3, seed=1)
    xb, yb = tokens(2, 4, seed=2)     # another batch shape: another workspace
    model.forward_backward(xa, ya)
    ga = model.grads.copy()
    model.forward_backward(xb, yb)
    gb = model.grads.copy()
    model.forward_backward(xa, ya)
    model.forward_backward(xb, yb, accumulate=True)
    np.testing.assert_allclose(model.grads, ga + gb, rtol=1e-13, atol=1e-16)
    # bind_gradients: separate arrays per tensor get the same gradients.
    store = {s.name: np.full(s.shape, np.nan) for s in model.layout}
    flat, accumulated = model.grads, model.grads.copy()
    model.bind_gradients(lambda name: store[name])
    assert model.grads is None
    model.forward_backward(xa, ya)
    for spec in model.layout:
        np.testing.assert_array_equal(store[spec.name], ga[spec.range.slice()].reshape(spec.shape))
    np.testing.assert_array_equal(flat, accumulated)   # the old vector was not written


# -- properties of the model --------------------------------------------------------


def test_attention_is_causal_and_stable():
    model = GPT(V, T, D, H, L)
    randomize(model)
    x, _ = tokens(2)
    base = model.forward(x)
    changed = x.copy()
    changed[:, 3] = (changed[:, 3] + 1) % V
    out = model.forward(changed)
    np.testing.assert_array_equal(out[:, :3], base[:, :3])   # the past does not see the future
    assert not np.allclose(out[:, 3:], base[:, 3:])
    # Huge attention scores: the shifted softmax stays finite.
    for name in ("1.attn.wq", "1.attn.wk"):
        model.layout.view(model.params, name)[...] *= 300.0
    assert np.isfinite(model.forward_backward(x, x))
    assert np.all(np.isfinite(model.grads))


def test_initialisation_is_seeded_and_gpt2_like():
    a, b, c = GPT(64, 16, 32, 4, 3), GPT(64, 16, 32, 4, 3), GPT(64, 16, 32, 4, 3, seed=1)
    np.testing.assert_array_equal(a.params, b.params)
    assert not np.array_equal(a.params, c.params)
    view = lambda name: a.layout.view(a.params, name)  # noqa: E731
    assert view("0.wte").std() == pytest.approx(0.02, rel=0.05)
    assert view("2.attn.wq").std() == pytest.approx(0.02, rel=0.1)
    assert view("2.attn.wo").std() == pytest.approx(0.02 / math.sqrt(6), rel=0.1)
    assert view("2.mlp.fc2.weight").std() == pytest.approx(0.02 / math.sqrt(6), rel=0.1)
    np.testing.assert_array_equal(view("1.attn.bq"), 0)
    np.testing.assert_array_equal(view("3.ln2.weight"), 1)
    np.testing.assert_array_equal(view("4.ln_f.bias"), 0)
    # Layers draw independent streams: layer 2 does not depend on layer 1's sizes.
    assert not np.array_equal(view("1.attn.wq"), view("2.attn.wq"))


def test_layout_units_are_top_level_layers():
    model = GPT(V, T, D, H, L)
    assert isinstance(model, BucketedModel)
    units = unit_ranges(model.layout)
    assert len(units) == L + 2 == model.num_layers == GPT.num_layers_of(L)
    assert model.layout["0.wte"].shape == (V, D) and model.layout["0.wpe"].shape == (T, D)
    assert model.layout["1.attn.wq"].shape == (D, D)
    assert model.layout["2.mlp.fc1.weight"].shape == (D, 4 * D)
    assert model.layout["3.head.weight"].shape == (D, V)
    assert units[-1] == Range(model.layout["3.ln_f.weight"].offset, model.layout.size)
    block = 2 * 2 * D + 4 * (D * D + D) + (D * 4 * D + 4 * D) + (4 * D * D + D)
    expected = V * D + T * D + L * block + 2 * D + D * V
    assert model.layout.size == expected


def test_float32_matches_float64():
    m64, m32 = GPT(V, T, D, H, L), GPT(V, T, D, H, L, dtype=np.float32)
    np.testing.assert_array_equal(m32.params, m64.params.astype(np.float32))
    x, y = tokens(4)
    assert m32.forward_backward(x, y) == pytest.approx(m64.forward_backward(x, y), rel=1e-5)
    assert m32.grads.dtype == np.float32
    np.testing.assert_allclose(m32.grads, m64.grads, rtol=1e-3, atol=1e-5)


def test_empty_batch_gives_zero_loss_and_gradient():
    model = GPT(V, T, D, H, L)
    model.grads[...] = np.nan
    x = np.zeros((0, T), dtype=np.int64)
    assert model.forward_backward(x, x) == 0.0
    np.testing.assert_array_equal(model.grads, 0.0)


def test_bad_inputs_raise():
    model = GPT(V, T, D, H, L)
    x, y = tokens(2)
    with pytest.raises(TypeError, match="integer indices"):
        model.forward_backward(x.astype(float), y)
    with pytest.raises(ValueError, match=r"token ids in \[0, 11\)"):
        model.forward_backward(x + V, y)
    with pytest.raises(ValueError, match="at most 5 tokens, got 6"):
        model.forward_backward(np.zeros((2, 6), dtype=int), np.zeros((2, 6), dtype=int))
    with pytest.raises(ValueError, match=r"leading shape"):
        model.forward_backward(x, y[:, :4])
    with pytest.raises(ValueError, match="d_model=8 is not divisible by n_heads=3"):
        GPT(V, T, D, 3, L)
    with pytest.raises(TypeError, match="float32 or float64"):
        GPT(V, T, D, H, L, dtype=np.float16)


def steady_state_peak(model, x, y) -> int:
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


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_step_loop_allocates_nothing_after_first_call(dtype):
    model = GPT(100, 32, 64, 4, 2, dtype=dtype)
    x, y = tokens(8, 32, vocab=100)
    peak = steady_state_peak(model, x, y)
    # One attention-probability buffer is 8*4*32*32 floats (256 KiB in float64),
    # a logits buffer 8*32*100 (200 KiB). What remains is Python objects and
    # NumPy's iteration buffers, as for the MLP in tests/unit/test_nn.py.
    assert peak < 96 * 1024, peak


# -- pipeline stages ----------------------------------------------------------------------


def gpt_stages(cuts, **kw):
    bounds = [0, *cuts, L + 2]
    return [GPT(V, T, D, H, L, stage_layers=(a, b), **kw) for a, b in zip(bounds, bounds[1:])]


def assert_same_tensors(stages, whole, attr="params", rtol=0.0, atol=0.0):
    for stage in stages:
        for spec in stage.layout:
            np.testing.assert_allclose(getattr(stage, attr)[spec.range.slice()],
                                       getattr(whole, attr)[whole.layout.range(spec.name)
                                                            .slice()],
                                       rtol=rtol, atol=atol, err_msg=spec.name)
    assert sum(s.layout.size for s in stages) == whole.layout.size


@pytest.mark.parametrize("k", range(1, L + 2))
def test_two_stages_chained_by_hand_equal_the_whole_model(k):
    whole = GPT(V, T, D, H, L, seed=4)
    first, last = gpt_stages([k], seed=4)
    assert first.layout.names[0] == "0.wte" and last.layout.names[-1] == f"{L + 1}.head.weight"
    assert_same_tensors([first, last], whole)          # initialised as in the whole model
    x, y = tokens(3)
    loss = whole.forward_backward(x, y)
    act = first.forward_stage(x)
    assert act.shape == first.stage_output_shape(x.shape) == last.stage_input_shape(x.shape)
    last.forward_stage(act)
    assert last.loss(y) == pytest.approx(loss, rel=1e-14)
    grad_in = last.backward_stage()
    assert grad_in.shape == (3, T, D)
    assert first.backward_stage(grad_in) is None
    assert_same_tensors([first, last], whole, "grads", rtol=1e-13)


def test_micro_batches_in_flight_over_three_stages():
    whole = GPT(V, T, D, H, L, seed=2)
    stages = gpt_stages([1, 3], seed=2)
    assert [s.stage_layers for s in stages] == [(0, 1), (1, 3), (3, 4)]
    data = [tokens(2, seed=s) for s in range(3)]
    losses = [whole.forward_backward(x, y, accumulate=m > 0) for m, (x, y) in enumerate(data)]
    # GPipe order: every forward, then the backwards (last micro-batch first).
    for m, (x, y) in enumerate(data):
        h = x
        for stage in stages:
            h = stage.forward_stage(h, micro=m)
        assert stages[-1].loss(y, micro=m) == pytest.approx(losses[m], rel=1e-14)
    for m in reversed(range(3)):
        g = None
        for stage in reversed(stages):
            g = stage.backward_stage(g, micro=m, accumulate=m < 2)
    assert_same_tensors(stages, whole, "grads", rtol=1e-12, atol=1e-16)
    # The slots keep their buffers: a second step allocates no new workspace.
    before = {id(ws) for s in stages for ws in s._workspaces.values()}
    for m, (x, _) in enumerate(data):
        h = x
        for stage in stages:
            h = stage.forward_stage(h, micro=m)
    assert {id(ws) for s in stages for ws in s._workspaces.values()} == before


def test_stage_api_errors():
    first, last = gpt_stages([2])
    x, y = tokens(2)
    with pytest.raises(RuntimeError, match="needs the whole model"):
        first.forward_backward(x, y)
    with pytest.raises(RuntimeError, match="last stage"):
        first.loss(y)
    with pytest.raises(RuntimeError, match="no forward_stage"):
        last.backward_stage(np.zeros((2, T, D)), micro=1)
    act = first.forward_stage(x)
    last.forward_stage(act)
    with pytest.raises(RuntimeError, match="call loss"):
        last.backward_stage()
    with pytest.raises(ValueError, match="output's shape"):
        first.backward_stage(np.zeros((2, T, V)))
    with pytest.raises(ValueError, match=r"0 <= start < stop <= 4"):
        GPT(V, T, D, H, L, stage_layers=(2, 2))
    # The first stage's output buffer is its own: the next stage copies its input.
    snapshot = act.copy()
    last.loss(y)
    last.backward_stage()
    np.testing.assert_array_equal(act, snapshot)


@pytest.mark.parametrize("k", [1, 2, 4, 6])
def test_mlp_stages_equal_the_mlp(k):
    sizes = [5, 8, 6, 7, 3]
    whole = MLP(sizes, activation="gelu", layer_norm=True, dropout=0.3, seed=3)
    n = len(whole.layers)
    first = ParallelMLP(sizes, activation="gelu", layer_norm=True, dropout=0.3, seed=3,
                        stage_layers=(0, k))
    last = ParallelMLP(sizes, activation="gelu", layer_norm=True, dropout=0.3, seed=3,
                       stage_layers=(k, n))
    assert_same_tensors([first, last], whole)
    rng = np.random.default_rng(0)
    xs, ys = rng.normal(size=(6, 5)), rng.integers(0, 3, size=6)
    # Two micro-batches of a global batch of 6, with their batch contexts.
    for m, rows in enumerate((slice(0, 4), slice(4, 6))):
        whole.set_batch_context(7, rows.start, 6)
        ref = whole.forward_backward(xs[rows], ys[rows], accumulate=m > 0)
        for stage in (first, last):
            stage.set_batch_context(7, rows.start, 6)
        h = first.forward_stage(xs[rows], micro=m)
        last.forward_stage(h, micro=m)
        assert last.loss(ys[rows], micro=m) == pytest.approx(ref, rel=1e-14)
    for m in (0, 1):
        first.backward_stage(last.backward_stage(None, m, accumulate=m > 0), m,
                             accumulate=m > 0)
    assert_same_tensors([first, last], whole, "grads", rtol=1e-13)


def test_parallel_mlp_without_groups_is_the_mlp():
    for kw in (dict(), dict(activation="tanh", loss="mse", layer_norm=True, dropout=0.2)):
        a, b = MLP([4, 6, 6, 2], seed=9, **kw), ParallelMLP([4, 6, 6, 2], seed=9, **kw)
        np.testing.assert_array_equal(a.params, b.params)
        assert a.layout == b.layout
        rng = np.random.default_rng(1)
        x = rng.normal(size=(5, 4))
        y = rng.normal(size=(5, 2)) if kw else rng.integers(0, 2, size=5)
        assert a.forward_backward(x, y) == b.forward_backward(x, y)
        np.testing.assert_array_equal(a.grads, b.grads)
        np.testing.assert_array_equal(a.forward(x), b.forward(x))


# -- hooks --------------------------------------------------------------------------------


class Recorder:
    """Hooks that record calls and check the gradient at each one."""

    def __init__(self, model):
        self.model = model
        self.calls = []

    def before(self, r):
        assert np.all(np.isnan(self.model.grads[r.start:r.stop]))
        self.calls.append(("before", r))

    def after(self, r):
        assert np.all(np.isfinite(self.model.grads[r.start:]))
        self.calls.append(("after", r))


@pytest.mark.parametrize("stage_layers", [None, (1, 3)])
def test_hooks_called_in_backward_order_with_layer_ranges(stage_layers):
    model = GPT(V, T, D, H, L, stage_layers=stage_layers)
    hooks = Recorder(model)
    model.set_backward_hooks(hooks)
    model.grads[...] = np.nan
    x, y = tokens(2)
    if stage_layers is None:
        model.forward_backward(x, y)
    else:
        model.forward_stage(np.random.default_rng(0).normal(size=(2, T, D)))
        model.backward_stage(np.ones((2, T, D)))
    expected = []
    for unit in reversed(unit_ranges(model.layout)):
        expected += [("before", unit), ("after", unit)]
    assert hooks.calls == expected
    assert len(expected) == 2 * (model.stage_layers[1] - model.stage_layers[0])
    assert expected[0][1].stop == model.layout.size and expected[-1][1].start == 0


# -- shard metadata -------------------------------------------------------------------------


def test_split_range_and_tensor_shard():
    assert [split_range(11, 2, r) for r in range(2)] == [Range(0, 6), Range(6, 11)]
    assert [split_range(8, 4, r) for r in range(4)] == [Range(2 * r, 2 * r + 2) for r in range(4)]
    assert sum(len(split_range(5, 3, r)) for r in range(3)) == 5
    with pytest.raises(ValueError, match="rank=2, parts=2"):
        split_range(4, 2, 2)
    s = TensorShard.split("w", (4, 6), 1, 3, 1)
    assert s.index == (slice(0, 4), slice(2, 4)) and s.shape == (4, 2) and not s.replicated
    full = np.arange(24).reshape(4, 6)
    np.testing.assert_array_equal(full[s.index], full[:, 2:4])
    assert TensorShard.split("w", (4, 6), 0, 1, 0) == TensorShard.full("w", (4, 6))


def test_serial_models_shards_are_full_and_replicated():
    for model in (GPT(V, T, D, H, L), MLP([3, 4, 2]), GPT(V, T, D, H, L, stage_layers=(2, 4))):
        shards = tensor_shards(model)
        assert list(shards) == list(model.layout.names)
        for name, shard in shards.items():
            shape = model.layout[name].shape
            assert shard.logical_name == name and shard.logical_shape == shape
            assert shard.replicated and shard.index == tuple(slice(0, n) for n in shape)
        assert owned_ranges(model.layout, shards, 0) == [Range(0, model.layout.size)]
        assert owned_ranges(model.layout, shards, 1) == []
