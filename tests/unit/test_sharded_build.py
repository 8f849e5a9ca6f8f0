"""Models built in ZeRO-3 shards (``shard=ParameterShard(rank, ranks)``), in one process.

Every rank's shard, built alone, holds exactly the bits of its range of the whole
model built with the same arguments, at any number of ranks (shards that cut
tensors and layers anywhere, empty shards included); the construction's peak is
the shard and about one layer, not the vector; the model refuses to run before a
ZeRO-3 strategy attaches it.
"""

from __future__ import annotations

import gc
import tracemalloc

import numpy as np
import pytest

from mpishard.flat import ParameterShard
from mpishard.nn import GPT, MLP, LayerStack, Linear, MSELoss, ParallelMLP, ReLU, Sequential


class Regressor(LayerStack):
    """A user's LayerStack model that passes ``shard=`` on."""

    def __init__(self, width, seed=0, shard=None):
        layers = [Linear(3, width), ReLU(), Linear(width, width), ReLU(), Linear(width, 1)]
        super().__init__(layers, MSELoss(), seed=seed, shard=shard)


MODELS = {
    "mlp": lambda **k: MLP([5, 7, 7, 3], activation="tanh", seed=7, **k),
    "mlp-layernorm-f32": lambda **k: MLP([4, 6, 2], layer_norm=True, dtype=np.float32,
                                         seed=2, **k),
    "gpt": lambda **k: GPT(11, 5, 8, 2, 2, seed=11, **k),
    "parallel-mlp": lambda **k: ParallelMLP([5, 8, 3], seed=5, **k),
    "sequential": lambda **k: Sequential([Linear(3, 4), ReLU(), Linear(4, 2)], MSELoss(),
                                         seed=9, **k),
    "user-layerstack": lambda **k: Regressor(6, seed=3, **k),
}


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 7, 200])
def test_shards_are_the_whole_models_bits(name, ranks):
    whole = MODELS[name]()
    pieces = []
    for rank in range(ranks):
        model = MODELS[name](shard=ParameterShard(rank, ranks))
        assert model.params is None and model.grads is None
        r, values = model.built_shard()
        assert r == ParameterShard(rank, ranks).range(whole.layout.size)
        assert values.dtype == whole.params.dtype and values.size == len(r)
        pieces.append(values)
    joined = np.concatenate(pieces)
    assert joined.tobytes() == whole.params.tobytes()


def test_a_model_built_in_shards_runs_only_once_attached():
    model = MODELS["mlp"](shard=ParameterShard(1, 2))
    with pytest.raises(RuntimeError, match=r"built in shards .* attach it to a ZeRO-3"):
        model.forward(np.zeros((2, 5)))
    with pytest.raises(RuntimeError, match="built in shards"):
        model.forward_backward(np.zeros((2, 5)), np.zeros(2, dtype=np.int64))


def test_binding_parameters_ends_the_built_state():
    """What a ZeRO-3 attach does: the layers read the strategy's views from then on."""
    model = MODELS["mlp"](shard=ParameterShard(0, 1))
    _, values = model.built_shard()
    model.bind_parameters(lambda name: model.layout.view(values, name), values)
    assert model.built_shard() is None and model.params is values
    whole = MODELS["mlp"]()
    x = np.random.default_rng(0).standard_normal((4, 5))
    np.testing.assert_array_equal(model.forward(x), whole.forward(x))


@pytest.mark.parametrize("rank, ranks", [(0, 0), (2, 2), (-1, 3)])
def test_parameter_shard_checks_its_numbers(rank, ranks):
    with pytest.raises(ValueError, match=f"rank={rank}, ranks={ranks}"):
        ParameterShard(rank, ranks)


def test_the_construction_peak_is_the_shard_and_a_layer():
    """16 blocks of 12,480 float64 parameters (97.5 KiB): the shard of 1/8 and a
    block's scratch and draws, far below the whole vector (1.5 MiB)."""
    args = (16, 4, 32, 4, 16)

    def peak(**kwargs):
        gc.collect()
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            model = GPT(*args, seed=1, **kwargs)
            return tracemalloc.get_traced_memory()[1] - base, model
        finally:
            tracemalloc.stop()

    whole_peak, whole = peak()
    shard_peak, model = peak(shard=ParameterShard(3, 8))
    vector = whole.params.nbytes
    block = (12 * 32 * 32 + 13 * 32) * 8
    assert whole_peak >= 2 * vector          # parameters and gradient
    assert shard_peak <= vector / 8 + 4 * block + 64 * 1024, (shard_peak, vector, block)
