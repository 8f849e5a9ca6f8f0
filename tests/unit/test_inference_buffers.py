"""Inference keeps two sets of buffers of each kind of layer, not one per layer.

``LayerStack.forward`` (no backward) shares the buffers of alike layers (each
transformer block of a GPT, each hidden ``Linear`` of an MLP), two sets used in
turn; the output is bit for bit the training forward's (every layer its own
buffers, ``forward_stage``).
"""

from __future__ import annotations

import numpy as np
import pytest

from mpishard.nn import GPT, MLP


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_gpt_inference_is_the_training_forward_on_two_sets_of_block_buffers(dtype):
    model = GPT(64, 8, 32, 4, 5, dtype=dtype, seed=3)
    x = np.random.default_rng(0).integers(0, 64, (6, 8))
    logits = model.forward(x)
    again = model.forward(x)
    assert np.array_equal(logits, model.forward_stage(x, 0))
    assert np.array_equal(logits, again)
    layers = model._workspaces[(False, 0)].layers
    blocks = [id(buf) for layer, buf in zip(model.layers, layers)
              if type(layer).__name__ == "TransformerBlock"]
    assert len(blocks) == 5 and len(set(blocks)) == 2
    # Used in turn: a block never writes the set its input is in.
    assert all(a != b for a, b in zip(blocks, blocks[1:]))
    trained = model._workspaces[(True, 0)].layers
    assert len({id(buf) for buf in trained}) == len(trained)


def test_mlp_inference_is_the_training_forward():
    model = MLP([5, 16, 16, 16, 16, 3], activation="tanh", dtype=np.float64, seed=1)
    x = np.random.default_rng(1).standard_normal((9, 5))
    out = model.forward(x)
    assert np.array_equal(out, model.forward_stage(x, 0))
    layers = model._workspaces[(False, 0)].layers
    assert len({id(buf) for buf in layers}) < len(layers)
