"""A multilayer perceptron: [`Sequential`][mpishard.nn.Sequential] built from a list of widths."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..flat import ParameterShard
from .activations import GELU, ReLU, Tanh
from .base import Layer
from .dropout import Dropout
from .layers import LayerNorm, Linear
from .losses import Loss, MSELoss, SoftmaxCrossEntropy
from .sequential import Sequential

__all__ = [
    "MLP",
]

_ACTIVATIONS: dict[str, type[Layer]] = {"gelu": GELU, "relu": ReLU, "tanh": Tanh}
_LOSSES: dict[str, type[Loss]] = {"cross_entropy": SoftmaxCrossEntropy, "mse": MSELoss}


class MLP(Sequential):
    """``Linear`` layers of widths ``sizes`` with an activation between them.

    Each hidden block is ``Linear -> [LayerNorm] -> activation -> [Dropout]``;
    the last ``Linear`` has none of these, so the model outputs logits (or the
    regression output for ``loss="mse"``). ``MLP([784, 1024, 1024, 10])`` has
    layers ``0, 2, 4`` linear with tensors ``"0.weight"``, ``"0.bias"``,
    ``"2.weight"``, ...

    The dropout masks are seeded from ``seed`` too (see [`Dropout`][mpishard.nn.Dropout]).
    ``shard``: build only that ZeRO-3 shard of the parameters (see
    [`LayerStack`][mpishard.nn.LayerStack]).

    Raises:
        ValueError: fewer than two sizes, or an unknown activation or loss.
        TypeError: ``dtype`` is not float32 or float64.
    """

    def __init__(self, sizes: Sequence[int], activation: str = "relu",
                 loss: str = "cross_entropy", dtype: Any = np.float64, xp: Any = np,
                 seed: int = 0, layer_norm: bool = False, dropout: float = 0.0, *,
                 shard: ParameterShard | None = None) -> None:
        sizes = [int(s) for s in sizes]
        if len(sizes) < 2:
            raise ValueError(f"expecting at least 2 sizes (input and output), got {sizes}")
        if activation not in _ACTIVATIONS:
            raise ValueError(f"expecting activation 'relu', 'gelu' or 'tanh', got {activation!r}")
        if loss not in _LOSSES:
            raise ValueError(f"expecting loss 'cross_entropy' or 'mse', got {loss!r}")
        layers: list[Layer] = []
        for fan_in, fan_out in zip(sizes[:-2], sizes[1:-1]):
            layers.append(Linear(fan_in, fan_out))
            if layer_norm:
                layers.append(LayerNorm(fan_out))
            layers.append(_ACTIVATIONS[activation]())
            if dropout:
                layers.append(Dropout(dropout, seed=seed))
        layers.append(Linear(sizes[-2], sizes[-1]))
        self.sizes = sizes
        self._options = {"activation": activation, "loss": loss,
                         "layer_norm": bool(layer_norm), "dropout": float(dropout)}
        super().__init__(layers, _LOSSES[loss](), dtype=dtype, xp=xp, seed=seed, shard=shard)

    def config(self) -> dict[str, Any]:
        """``{"class": "MLP", "args": ...}``: the constructor's arguments but ``xp``."""
        return {"class": "MLP", "args": {"sizes": list(self.sizes), **self._options,
                                         "dtype": self.dtype.name, "seed": self.seed}}
