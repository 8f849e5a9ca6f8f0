"""Layers, losses and models rebuilt from the JSON their ``config()`` returns.

A record is ``{"class": name, "args": constructor arguments}``, plain JSON: a
file stores it and this registry maps the name back to a class of the library
(never to code from the file). ``model_from_config(m.config())`` is a model of
the same architecture, initialised from the same seed, so equal to ``m`` before
training. Tensor-parallel layers and models are recorded as their logical,
whole selves (a communicator is not data): one process rebuilds them unsplit.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .activations import GELU, ReLU, Tanh
from .attention import CausalSelfAttention
from .base import Layer
from .dropout import Dropout
from .embedding import Embedding, LMHead
from .gpt import GPT, TransformerBlock
from .layers import LayerNorm, Linear
from .losses import Loss, MSELoss, SoftmaxCrossEntropy
from .mlp import MLP
from .sequential import Sequential
from .stack import LayerStack
from .tensor_parallel import (
    ColumnParallelLinear,
    ParallelMLP,
    RowParallelLinear,
    VocabParallelCrossEntropy,
)

__all__ = [
    "layer_from_config",
    "loss_from_config",
    "model_from_config",
]


def _by_name(*classes: type) -> dict[str, type]:
    return {cls.__name__: cls for cls in classes}


_LAYERS = _by_name(CausalSelfAttention, ColumnParallelLinear, Dropout, Embedding, GELU,
                   LMHead, LayerNorm, Linear, ReLU, RowParallelLinear, Tanh, TransformerBlock)
_LOSSES = _by_name(MSELoss, SoftmaxCrossEntropy, VocabParallelCrossEntropy)
_MODELS = _by_name(GPT, MLP, ParallelMLP, Sequential)


def _class_and_args(config: Any, known: dict[str, type], what: str) -> tuple[type, dict]:
    if not isinstance(config, dict) or set(config) != {"class", "args"}:
        raise ValueError(f"expecting a {what} record {{'class': ..., 'args': {{...}}}}, "
                         f"got {config!r}")
    name, args = config["class"], config["args"]
    if name not in known:
        raise ValueError(f"unknown {what} class {name!r}: expecting one of {sorted(known)}")
    if not isinstance(args, dict):
        raise ValueError(f"expecting the arguments of {name} as a dict, got {args!r}")
    return known[name], dict(args)


def layer_from_config(config: dict[str, Any]) -> Layer:
    """A new, unbuilt layer from [`Layer.config`][mpishard.nn.Layer.config]'s record.

    Raises:
        ValueError: not a record, or a class this library does not have.
        TypeError: arguments the class does not take.
    """
    cls, args = _class_and_args(config, _LAYERS, "layer")
    return cls(**args)


def loss_from_config(config: dict[str, Any]) -> Loss:
    """A new loss from [`Loss.config`][mpishard.nn.Loss.config]'s record (raises as
    [`layer_from_config`][mpishard.nn.layer_from_config])."""
    cls, args = _class_and_args(config, _LOSSES, "loss")
    return cls(**args)


def model_from_config(config: dict[str, Any], xp: Any = np) -> LayerStack:
    """A new model, on the array backend ``xp``, from a model's ``config()`` record.

    A [`Sequential`][mpishard.nn.Sequential]'s layers and loss are records too, built by
    [`layer_from_config`][mpishard.nn.layer_from_config] and
    [`loss_from_config`][mpishard.nn.loss_from_config].

    Raises:
        ValueError: not a record, or a class this library does not have.
        TypeError: arguments the class does not take.
    """
    cls, args = _class_and_args(config, _MODELS, "model")
    if cls is Sequential:
        layers = args.get("layers")
        if not isinstance(layers, list):
            raise ValueError(f"expecting the layers of a Sequential as a list, got {layers!r}")
        args["layers"] = [layer_from_config(c) for c in layers]
        args["loss"] = loss_from_config(args.get("loss"))
    return cls(**args, xp=xp)
