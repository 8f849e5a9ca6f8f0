"""Layers in order over one flat vector: a [`BucketedModel`][mpishard.protocols.BucketedModel]."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..backend import array_namespace
from ..flat import ParameterShard
from .base import Layer
from .losses import Loss
from .model_methods import ModelMethods, layer_metadata
from .stack import LayerStack

__all__ = [
    "Sequential",
]


class Sequential(ModelMethods, LayerStack):
    """Layers applied in order, then a loss; parameters in one flat vector.

    The whole model of [`LayerStack`][mpishard.nn.LayerStack] (no
    pipeline stage, no tensor parallelism), plus the single-process model API
    ([`ModelMethods`][mpishard.nn.ModelMethods]; files: [`mpishard.models`][mpishard.models]). The
    layout names tensors ``"<index>.<name>"`` by the layer's position in
    ``layers`` (``"0.weight"``, ``"0.bias"``, ``"2.weight"``), in forward order.
    ``params`` and ``grads`` are two flat vectors of ``layout.size`` elements;
    every layer reads its parameters as views of ``params`` and writes its
    gradients into views of ``grads`` (or of what
    [`bind_gradients`][mpishard.nn.LayerStack.bind_gradients] gave). The loss object is
    ``criterion``.

    Parameters are initialised deterministically: layer ``i`` draws from
    ``numpy.random.default_rng([seed, i])`` on the host, so the same ``seed``
    gives the same model on every rank and backend; ``shard`` builds only that
    ZeRO-3 shard of it (see [`LayerStack`][mpishard.nn.LayerStack]).

    Activations and scratch are allocated on the first call with a batch shape
    and reused until the shape changes (training and inference keep separate
    sets). With CuPy, pass device arrays: a host array is copied to the device
    on every call.

    Raises:
        TypeError: ``dtype`` is not float32 or float64.
        ValueError: ``layers`` is empty.
    """

    def __init__(self, layers: Sequence[Layer], loss: Loss, dtype: Any = np.float64,
                 xp: Any = np, seed: int = 0, *, shard: ParameterShard | None = None) -> None:
        super().__init__(layers, loss, dtype, xp, seed, shard=shard)

    def config(self) -> dict[str, Any] | None:
        """``{"class": "Sequential", "args": {"layers", "loss", "dtype", "seed"}}``, the
        layers and the loss by their own [`config`][mpishard.nn.Layer.config]; None if
        one of them cannot describe itself. ``xp`` is not recorded: the loader chooses."""
        layers = [layer.config() for layer in self.all_layers]
        loss = self.criterion.config()
        if loss is None or any(c is None for c in layers):
            return None
        return {"class": "Sequential", "args": {"layers": layers, "loss": loss,
                                                "dtype": self.dtype.name, "seed": self.seed}}

    def get_model_metadata(self) -> dict[str, Any]:
        """As [`ModelMethods.get_model_metadata`][mpishard.nn.ModelMethods.get_model_metadata], plus
        ``"layers"``: each layer's type, tensor shapes and parameter count."""
        return {**super().get_model_metadata(), "layers": layer_metadata(self.layers)}

    def clone(self) -> Sequential:
        """An independent copy: same class, layers, parameters and history (and a
        subclass's own attributes, e.g. ``MLP.sizes``)."""
        xp = array_namespace(self.params)
        memo = {id(np): np, id(xp): xp}   # modules cannot be deep-copied
        layers = copy.deepcopy(self.layers, memo)
        loss = copy.deepcopy(self.criterion, memo)
        new = type(self).__new__(type(self))
        Sequential.__init__(new, layers, loss, dtype=self.dtype, xp=self.xp, seed=self.seed)
        for key, value in self.__dict__.items():   # a subclass's own (MLP.sizes), the history
            if key not in new.__dict__:
                new.__dict__[key] = copy.deepcopy(value, memo)
        new.params[...] = self.params
        return new

    def __repr__(self) -> str:
        inner = ", ".join(repr(layer) for layer in self.layers)
        return (f"{type(self).__name__}([{inner}], loss={self.criterion!r}, "
                f"dtype={self.dtype.name}, params={self.layout.size})")
