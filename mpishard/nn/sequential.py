"""A stack of layers over one flat parameter vector: the library's :class:`~mpishard.protocols.BucketedModel`."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .base import Layer
from .losses import Loss
from .model_file import ModelFileMethods
from .sharding import ShardedSequential

__all__ = [
    "Sequential",
]


class Sequential(ModelFileMethods, ShardedSequential):
    """Layers applied in order, then a loss; parameters in one flat vector.

    The whole model of :class:`~mpishard.nn.sharding.ShardedSequential` (no
    pipeline stage, no tensor parallelism), plus the model-file methods. The
    layout names tensors ``"<index>.<name>"`` by the layer's position in
    ``layers`` (``"0.weight"``, ``"0.bias"``, ``"2.weight"``), in forward order.
    ``params`` and ``grads`` are two flat vectors of ``layout.size`` elements;
    every layer reads its parameters as views of ``params`` and writes its
    gradients into views of ``grads`` (or of what :meth:`bind_gradients` gave).
    The loss object is ``criterion``.

    Parameters are initialised deterministically: layer ``i`` draws from
    ``numpy.random.default_rng([seed, i])`` on the host, so the same ``seed``
    gives the same model on every rank and backend.

    Activations and scratch are allocated on the first call with a batch shape
    and reused until the shape changes (training and inference keep separate
    sets). With CuPy, pass device arrays: a host array is copied to the device
    on every call.

    Raises:
        TypeError: ``dtype`` is not float32 or float64.
        ValueError: ``layers`` is empty.
    """

    def __init__(self, layers: Sequence[Layer], loss: Loss, dtype: Any = np.float64,
                 xp: Any = np, seed: int = 0) -> None:
        super().__init__(layers, loss, dtype, xp, seed)

    def predict(self, x: Any) -> Any:
        """The output for ``x``, as :meth:`forward` (dropout off)."""
        from ..checkpoint.model_api import predict

        return predict(self, x)

    @classmethod
    def from_file(cls, path: Any, xp: Any = np) -> Sequential:
        """A new model rebuilt from the architecture a model file records."""
        from ..checkpoint.model_api import load_model

        return load_model(path, xp=xp)

    @classmethod
    def from_bytes(cls, data: bytes, xp: Any = np) -> Sequential:
        """A new model rebuilt from :meth:`serialize` bytes."""
        from ..checkpoint.model_api import model_from_bytes

        return model_from_bytes(data, xp=xp)

    def __repr__(self) -> str:
        inner = ", ".join(repr(layer) for layer in self.layers)
        return (f"{type(self).__name__}([{inner}], loss={self.criterion!r}, "
                f"dtype={self.dtype.name}, params={self.layout.size})")
