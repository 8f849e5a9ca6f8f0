"""Gradients handed over piece by piece, what a workspace holds, shards left uninitialised.

* ``bind_gradient_pieces``: the backward writes each layer in pieces (whole
  tensor groups, row blocks of the Linear weights) into the views it is given,
  each between the hooks, in descending offsets; the gradient is the one the
  whole-vector backward writes (bit for bit where no weight is cut in row
  blocks of another size, to rounding otherwise), accumulation included.
* ``activation_bytes`` counts what the training workspace holds (against
  ``tracemalloc``), nested buffers included, views once.
* ``uninitialised_shards``: a model built in shards inside it draws nothing.
"""

from __future__ import annotations

import gc
import tracemalloc

import numpy as np
import pytest

from mpishard.flat import ParameterShard, Range, buckets_of
from mpishard.nn import GPT, MLP, Linear
from mpishard.nn.stack import uninitialised_shards

MODELS = {
    "mlp": lambda: MLP([16, 64, 64, 5], seed=2),
    "mlp-layernorm": lambda: MLP([6, 40, 3], layer_norm=True, seed=4),
    "gpt": lambda: GPT(64, 8, 32, 4, 2, seed=1),
}


def batch(model):
    rng = np.random.default_rng(0)
    if isinstance(model, GPT):
        x = rng.integers(0, 64, (3, 8))
        return x, np.roll(x, 1, axis=1)
    x = rng.standard_normal((7, model.layout["0.weight"].shape[0]))
    return x, np.arange(7) % 3


class Recorder:
    """Backward hooks that check each piece is written between its own calls."""

    def __init__(self, flat):
        self.flat, self.calls, self.open = flat, [], None

    def before(self, r):
        assert self.open is None, f"before({r}) inside {self.open}"
        self.open = r
        self.snapshot = self.flat.copy()
        self.calls.append(r)

    def after(self, r):
        assert self.open == r
        same = (self.flat == self.snapshot) | (np.isnan(self.flat) & np.isnan(self.snapshot))
        changed = np.flatnonzero(~same)
        assert all(r.start <= i < r.stop for i in changed), f"{r} wrote outside itself"
        self.open = None


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("max_elements", [1, 97, 300, 10**6])
def test_pieces_write_the_same_gradient_in_descending_order(name, max_elements):
    whole, pieced = MODELS[name](), MODELS[name]()
    x, y = batch(whole)
    pieces = pieced.gradient_pieces(max_elements)
    # The pieces tile the vector; a piece over the size is one row or one group.
    assert pieces[0].start == 0 and pieces[-1].stop == pieced.layout.size
    assert all(a.stop == b.start for a, b in zip(pieces, pieces[1:]))
    flat = np.full(pieced.layout.size, np.nan)
    pieced.bind_gradient_pieces(lambda r: flat[r.start:r.stop], max_elements)
    assert pieced.grads is None
    hooks = Recorder(flat)
    pieced.set_backward_hooks(hooks)
    for accumulate in (False, True):
        whole.forward_backward(x, y, accumulate=accumulate)
        hooks.calls.clear()
        pieced.forward_backward(x, y, accumulate=accumulate)
        # Every piece once, highest first: each after() leaves everything above final.
        assert hooks.calls == pieces[::-1]
        if max_elements == 10**6:      # no weight cut: the same products
            np.testing.assert_array_equal(flat, whole.grads)
        else:   # a BLAS product of a row block may round otherwise than the whole one
            np.testing.assert_allclose(flat, whole.grads, rtol=1e-11, atol=1e-16)


def test_pieces_respect_the_size_and_the_groups():
    model = GPT(64, 8, 32, 4, 1, seed=1)
    pieces = model.gradient_pieces(100)
    names = {s.name: s for s in model.layout}
    attn = Range(names["1.attn.wq"].offset, names["1.attn.bo"].range.stop)
    assert attn in pieces                   # the attention is written whole
    fc1 = names["1.mlp.fc1.weight"]
    rows = [p for p in pieces if fc1.offset <= p.start < fc1.range.stop]
    assert rows and all(len(p) == fc1.shape[1] for p in rows)    # one row: 128 > 100
    # Buckets of whole pieces: none over the size unless one piece is.
    for bucket in buckets_of(pieces, 150):
        inside = [p for p in pieces if bucket.start <= p.start < bucket.stop]
        assert len(bucket) <= 150 or len(inside) == 1
        assert inside[0].start == bucket.start and inside[-1].stop == bucket.stop


def test_bind_gradients_undoes_the_pieces():
    model, ref = MODELS["mlp"](), MODELS["mlp"]()
    x, y = batch(model)
    flat = np.zeros(model.layout.size)
    model.bind_gradient_pieces(lambda r: flat[r.start:r.stop], 50)
    grads = np.zeros(model.layout.size)
    model.bind_gradients(lambda n: model.layout.view(grads, n))
    model.forward_backward(x, y)
    ref.forward_backward(x, y)
    assert not flat.any()
    np.testing.assert_array_equal(grads, ref.grads)


@pytest.mark.parametrize("name", ["gpt", "mlp"])
def test_activation_bytes_counts_what_the_workspace_holds(name):
    if name == "gpt":
        model = GPT(128, 32, 64, 4, 2, dtype=np.float32)
        x = np.random.default_rng(0).integers(0, 128, (4, 32))
        y = np.roll(x, 1, axis=1)
    else:
        model = MLP([256, 128, 10], dtype=np.float32)
        x = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)
        y = np.arange(64) % 10
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        model.forward_backward(x, y)       # the workspace is made on first use
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    counted = model.activation_bytes()
    # Python objects (dicts, views) besides the arrays: a few KiB.
    assert counted <= held <= counted + 64 * 1024, (counted, held)


def test_uninitialised_shards_draw_nothing(monkeypatch):
    drawn = []
    original = Linear.init_params
    monkeypatch.setattr(Linear, "init_params",
                        lambda self, rng: (drawn.append(self.index), original(self, rng)))
    with uninitialised_shards():
        model = MLP([16, 64, 64, 5], seed=2, shard=ParameterShard(1, 3))
    assert drawn == []
    r, values = model.built_shard()
    assert r == ParameterShard(1, 3).range(model.layout.size) and not values.any()
    again = MLP([16, 64, 64, 5], seed=2, shard=ParameterShard(1, 3))   # outside: drawn
    assert drawn and again.built_shard()[1].any()
