"""A :class:`~mpishard.nn.Sequential`'s architecture as JSON, and back.

A model file records its layers' types and constructor arguments so that a
single process can rebuild the model from the file alone (``load_model(path)``)
for inference or analysis. Only the library's layer and loss types are known;
a model with a user-defined layer is still saved and loaded *into* a model
built by the user, but cannot be rebuilt from the file. A
:class:`~mpishard.nn.FunctionModel` wraps a Python function, which a file
cannot hold (and would not, as pickle): its file records ``null``.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..errors import CheckpointError
from ..nn import (
    GELU,
    Dropout,
    LayerNorm,
    Linear,
    MSELoss,
    ReLU,
    Sequential,
    SoftmaxCrossEntropy,
    Tanh,
)

__all__ = ["build_architecture", "describe_architecture"]

_VERSION = 1

# type name -> (class, constructor arguments read from an instance)
_LAYERS: dict[str, tuple[type, Callable[[Any], dict[str, Any]]]] = {
    "Linear": (Linear, lambda m: {"in_features": m.in_features, "out_features": m.out_features,
                                  "bias": m.bias}),
    "LayerNorm": (LayerNorm, lambda m: {"features": m.features, "eps": m.eps}),
    "ReLU": (ReLU, lambda m: {}),
    "GELU": (GELU, lambda m: {}),
    "Tanh": (Tanh, lambda m: {}),
    "Dropout": (Dropout, lambda m: {"p": m.p, "seed": m.seed}),
}
_LOSSES: dict[str, type] = {"SoftmaxCrossEntropy": SoftmaxCrossEntropy, "MSELoss": MSELoss}


def describe_architecture(model: Any) -> dict[str, Any] | None:
    """JSON-ready description of a :class:`Sequential` of known layers, else None."""
    if not isinstance(model, Sequential):
        return None
    layers = []
    for layer in model.layers:
        entry = _LAYERS.get(type(layer).__name__)
        if entry is None or type(layer) is not entry[0]:
            return None
        layers.append({"type": type(layer).__name__, "args": entry[1](layer)})
    loss = type(model.criterion).__name__
    if _LOSSES.get(loss) is not type(model.criterion):
        return None
    return {"version": _VERSION, "class": type(model).__name__, "layers": layers,
            "loss": loss, "dtype": model.dtype.name, "seed": model.seed}


def build_architecture(arch: dict[str, Any] | None, name: str, xp: Any = np) -> Sequential:
    """A new :class:`Sequential` from :func:`describe_architecture`'s output.

    Raises:
        CheckpointError: no architecture, or one this library cannot build
            (naming ``name``, the file).
    """
    if arch is None:
        raise CheckpointError(f"{name}: records no architecture (written from a FunctionModel "
                              f"or a model with user-defined layers): build the model and call "
                              f"its load_model(path), or pass f= for a FunctionModel")
    try:
        if arch.get("version") != _VERSION:
            raise ValueError(f"architecture version {arch.get('version')!r}")
        layers = []
        for entry in arch["layers"]:
            cls = _LAYERS[entry["type"]][0]
            layers.append(cls(**entry["args"]))
        loss = _LOSSES[arch["loss"]]()
        return Sequential(layers, loss, dtype=np.dtype(arch["dtype"]), xp=xp, seed=arch["seed"])
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"{name}: its architecture cannot be built: "
                              f"{type(exc).__name__}: {exc}") from None
