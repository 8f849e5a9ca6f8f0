"""Layers, losses and models describe themselves as JSON (``config()``) and the
registry of :mod:`mpishard.nn` rebuilds them: the round trips, checked against the
original object (same record, same tensors, same parameters and outputs).

Run with plain pytest (``-m "not mpi"``): one process, no communicator.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from mpishard.nn import (
    GELU,
    GPT,
    MLP,
    CausalSelfAttention,
    ColumnParallelLinear,
    Dropout,
    Embedding,
    FunctionModel,
    Layer,
    LayerNorm,
    Linear,
    LMHead,
    MSELoss,
    ParallelMLP,
    ReLU,
    RowParallelLinear,
    Sequential,
    SoftmaxCrossEntropy,
    Tanh,
    TransformerBlock,
    VocabParallelCrossEntropy,
    layer_from_config,
    loss_from_config,
    model_from_config,
)

LAYERS = [
    Linear(5, 7), Linear(3, 2, bias=False), LayerNorm(6, eps=1e-3), ReLU(), GELU(), Tanh(),
    Dropout(0.25, seed=9), Embedding(13, 8, 4, init_std=0.05),
    LMHead(4, 13, init_std=0.03, eps=1e-6), CausalSelfAttention(8, 2, init_std=0.01, out_std=0.004),
    TransformerBlock(8, 4, init_std=0.02, out_std=0.005, eps=1e-4),
    ColumnParallelLinear(4, 6, bias=False, reduce_input_grad=False, init_std=0.1),
    RowParallelLinear(6, 4, init_std=None),
]


def through_json(record):
    """What a file gives back: the record as JSON text, parsed."""
    return json.loads(json.dumps(record))


@pytest.mark.parametrize("layer", LAYERS, ids=lambda layer: type(layer).__name__)
def test_each_layer_round_trips_through_json(layer):
    record = layer.config()
    rebuilt = layer_from_config(through_json(record))
    assert type(rebuilt) is type(layer)
    assert rebuilt.config() == record
    assert rebuilt.param_shapes() == layer.param_shapes()
    assert repr(rebuilt) == repr(layer)
    # Same initial values from the same stream: an argument of the initialisation
    # (init_std, out_std) left out of the record would show here.
    values = []
    for each in (layer, rebuilt):
        params = {name: np.empty(shape) for name, shape in each.param_shapes()}
        each.build(0, np, np.float64, params)
        each.init_params(np.random.default_rng(5))
        values.append(params)
    for name in values[0]:
        np.testing.assert_array_equal(values[1][name], values[0][name])


@pytest.mark.parametrize("loss", [MSELoss(), SoftmaxCrossEntropy(), VocabParallelCrossEntropy(11)],
                         ids=lambda loss: type(loss).__name__)
def test_each_loss_round_trips_through_json(loss):
    rebuilt = loss_from_config(through_json(loss.config()))
    assert type(rebuilt) is type(loss) and rebuilt.config() == loss.config()


def assert_same_model(a, b, x):
    assert type(a) is type(b)
    assert a.config() == b.config()
    assert list(a.layout.names) == list(b.layout.names)
    np.testing.assert_array_equal(a.params, b.params)     # same seed: the same draw
    np.testing.assert_array_equal(a.forward(x), b.forward(x))


def test_sequential_of_layers_is_rebuilt_with_its_parameters():
    x = np.random.default_rng(0).standard_normal((6, 5))
    model = Sequential([Linear(5, 8), LayerNorm(8), GELU(), Dropout(0.1, seed=2), Linear(8, 3)],
                       SoftmaxCrossEntropy(), dtype=np.float32, seed=7)
    record = model.config()
    assert [layer["class"] for layer in record["args"]["layers"]] == [
        "Linear", "LayerNorm", "GELU", "Dropout", "Linear"]
    assert record["args"]["dtype"] == "float32" and record["args"]["seed"] == 7
    assert_same_model(model, model_from_config(through_json(record)), x.astype(np.float32))
    assert model.architecture() == {"version": 2, **record}


def test_mlp_gpt_and_parallel_mlp_are_rebuilt_by_their_arguments():
    rng = np.random.default_rng(1)
    mlp = MLP([5, 16, 16, 3], activation="tanh", loss="mse", seed=4, layer_norm=True,
              dropout=0.2)
    assert mlp.config() == {"class": "MLP", "args": {
        "sizes": [5, 16, 16, 3], "activation": "tanh", "loss": "mse", "layer_norm": True,
        "dropout": 0.2, "dtype": "float64", "seed": 4}}
    x = rng.standard_normal((4, 5))
    assert_same_model(mlp, model_from_config(through_json(mlp.config())), x)
    pmlp = ParallelMLP([5, 8, 6, 3], activation="gelu", seed=2, dropout=0.1)
    assert_same_model(pmlp, model_from_config(through_json(pmlp.config())), x)
    # Without tensor parallelism a ParallelMLP is that MLP: the record says which.
    twin = MLP([5, 8, 6, 3], activation="gelu", seed=2, dropout=0.1)
    np.testing.assert_array_equal(pmlp.params, twin.params)
    gpt = GPT(vocab_size=13, seq_len=6, d_model=8, n_heads=2, n_layers=2, seed=3)
    tokens = rng.integers(0, 13, size=(2, 6))
    assert_same_model(gpt, model_from_config(through_json(gpt.config())), tokens)
    assert gpt.architecture()["version"] == 2


def test_what_cannot_describe_itself_says_none():
    class Scale(Layer):                   # a user's layer with an argument, no config()
        def __init__(self, factor):
            self.factor = factor

    class Identity(Layer):                # a user's layer without arguments
        def forward(self, x, buf, ctx):
            return x

    assert Scale(2.0).config() is None
    assert Identity().config() == {"class": "Identity", "args": {}}
    model = Sequential([Linear(3, 3), Scale(2.0)], MSELoss())
    assert model.config() is None and model.architecture() is None
    fm = FunctionModel(lambda p, x, y: (0.0, p * 0), np.zeros(4))
    assert fm.config() is None and fm.architecture() is None
    with pytest.raises(ValueError, match="unknown layer class 'Identity'"):
        layer_from_config(Identity().config())     # the registry holds library classes only


def test_bad_records_are_named():
    with pytest.raises(ValueError, match="unknown model class 'Nope'"):
        model_from_config({"class": "Nope", "args": {}})
    with pytest.raises(ValueError, match="expecting a layer record"):
        layer_from_config({"type": "Linear", "args": {}})
    with pytest.raises(TypeError, match="unexpected keyword argument 'width'"):
        layer_from_config({"class": "Linear", "args": {"width": 3}})
