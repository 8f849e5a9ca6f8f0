"""What a checkpoint recorded of the architecture, compared without MPI: the
differences named, what counts as the same architecture, and model files that refuse
another one unless asked (the loads into strategies:
``tests/mpi/test_checkpoint_honesty.py``).
"""

from __future__ import annotations

import numpy as np
import pytest

from mpishard import CheckpointError
from mpishard.checkpoint.compare import architecture_differences
from mpishard.models import load_model_into, save_model
from mpishard.nn import GPT, MLP, ParallelMLP, Sequential
from mpishard.nn.activations import GELU, ReLU
from mpishard.nn.layers import Linear
from mpishard.nn.losses import MSELoss, SoftmaxCrossEntropy
from mpishard.nn.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelCrossEntropy,
)


def _gpt(**kw):
    args = dict(vocab_size=16, seq_len=4, d_model=8, n_heads=2, n_layers=1)
    args.update(kw)
    return GPT(**args)


def test_differences_name_what_differs():
    gelu = MLP([4, 8, 2], activation="gelu", loss="mse").architecture()
    relu = MLP([4, 8, 2], activation="relu", loss="mse").architecture()
    assert architecture_differences(gelu, relu) == [
        "activation: 'gelu' in the file, 'relu' in the model"]
    heads = architecture_differences(_gpt(n_heads=2).architecture(),
                                     _gpt(n_heads=4).architecture())
    assert heads == ["n_heads: 2 in the file, 4 in the model"]
    two = architecture_differences(
        MLP([4, 8, 2], activation="gelu", loss="mse", layer_norm=True).architecture(),
        MLP([4, 8, 2], activation="relu", loss="mse").architecture())
    assert two == ["activation: 'gelu' in the file, 'relu' in the model",
                   "layer_norm: True in the file, False in the model"]
    seq = [Sequential([Linear(4, 8), act(), Linear(8, 2)], MSELoss()).architecture()
           for act in (GELU, ReLU)]
    assert architecture_differences(*seq) == [
        "layers[1].class: 'GELU' in the file, 'ReLU' in the model"]


def test_seed_dtype_and_the_parallel_twin_are_the_same_architecture():
    a = MLP([4, 8, 8, 2], activation="gelu", loss="mse", seed=1).architecture()
    b = MLP([4, 8, 8, 2], activation="gelu", loss="mse", seed=2,
            dtype=np.float32).architecture()
    c = ParallelMLP([4, 8, 8, 2], activation="gelu", loss="mse").architecture()
    assert architecture_differences(a, b) == [] and architecture_differences(a, c) == []
    split = Sequential([ColumnParallelLinear(4, 8), GELU(), RowParallelLinear(8, 2)],
                       VocabParallelCrossEntropy(2)).architecture()
    whole = Sequential([Linear(4, 8), GELU(), Linear(8, 2)], SoftmaxCrossEntropy())
    assert architecture_differences(split, whole.architecture()) == []
    narrow = Sequential([ColumnParallelLinear(4, 8, bias=False), GELU(),
                         RowParallelLinear(8, 2)], VocabParallelCrossEntropy(2)).architecture()
    assert architecture_differences(narrow, whole.architecture()) == [
        "layers[0].args.bias: False in the file, True in the model"]
    assert architecture_differences(a, None) == [] and architecture_differences(None, a) == []
    # Another record version: nothing to compare against (old files still load).
    assert architecture_differences({**a, "version": 1}, a) == []


def test_model_files_refuse_another_architecture_unless_asked(tmp_path):
    path = str(tmp_path / "m.h5")
    saved = MLP([4, 8, 2], activation="gelu", loss="mse", seed=1)
    save_model(saved, path)
    other = MLP([4, 8, 2], activation="relu", loss="mse", seed=2)
    before = other.params.copy()
    with pytest.raises(CheckpointError, match=r"activation: 'gelu' in the file, 'relu' in the "
                                              r"model.*strict_architecture=False"):
        load_model_into(other, path)
    np.testing.assert_array_equal(other.params, before)        # nothing changed
    load_model_into(other, path, strict_architecture=False)
    np.testing.assert_array_equal(other.params, saved.params)
    load_model_into(MLP([4, 8, 2], activation="gelu", loss="mse", seed=7), path)   # seed aside
