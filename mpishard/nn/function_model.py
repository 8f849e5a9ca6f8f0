"""A :class:`~mpishard.protocols.Model` around a user's ``f(params, x, y) -> (loss, grad)``."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..backend import array_namespace
from ..flat import ParamLayout

__all__ = [
    "FunctionModel",
]


class FunctionModel:
    """A model for codes that compute their own gradient (an adjoint solver, JAX).

    ``f(params, x, y)`` returns the mean loss over the rows of ``x`` and the
    gradient with respect to ``params``, a flat array of ``params``' shape and
    dtype. ``predict(params, x)``, if given, serves :meth:`forward`.

    The model owns a copy of ``params`` (1-D, float32 or float64, NumPy or
    CuPy) and a gradient vector of the same kind. ``layout`` names the tensors
    in the flat vector (for checkpoints and tensor-aware strategies); by default
    it is one tensor named ``"params"``.

    This is a plain :class:`~mpishard.protocols.Model`, not a
    :class:`~mpishard.protocols.BucketedModel`: ``f`` hands back its whole
    gradient at once, so there is no backward progress to report and no way to
    write the gradient elsewhere. Strategies reduce it after
    :meth:`forward_backward` returns, without overlap.

    Raises:
        TypeError: ``params`` is not a float32 or float64 array.
        ValueError: ``params`` is not 1-D, or ``layout`` has another size.
    """

    def __init__(self, f: Callable[[Any, Any, Any], tuple[Any, Any]], params: Any,
                 layout: ParamLayout | None = None,
                 predict: Callable[[Any, Any], Any] | None = None) -> None:
        xp = array_namespace(params)
        if params.dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
            raise TypeError(f"expecting params of dtype float32 or float64, got {params.dtype}")
        if params.ndim != 1:
            raise ValueError(f"expecting a 1-D params vector, got shape {params.shape}")
        if layout is None:
            layout = ParamLayout([("params", params.shape)])
        if layout.size != params.size:
            raise ValueError(f"layout has {layout.size} elements, params has {params.size}")
        self.f = f
        self.predict_fn = predict
        self.layout = layout
        self.params = params.copy()
        self.grads = xp.zeros_like(self.params)
        self.xp = xp

    def forward(self, x: Any) -> Any:
        """``predict(params, x)``.

        Raises:
            NotImplementedError: the model was made without ``predict``.
        """
        if self.predict_fn is None:
            raise NotImplementedError("this FunctionModel has no prediction: "
                                      "pass predict=fn(params, x) to FunctionModel")
        return self.predict_fn(self.params, x)

    def forward_backward(self, x: Any, y: Any, *, accumulate: bool = False) -> float:
        """Call ``f`` and store its gradient in ``grads`` (added with ``accumulate=True``).

        Raises:
            ValueError: the gradient from ``f`` has the wrong shape.
            TypeError: the gradient from ``f`` has the wrong dtype.
        """
        loss, grad = self.f(self.params, x, y)
        if tuple(grad.shape) != self.params.shape:
            raise ValueError(f"f returned a gradient of shape {tuple(grad.shape)}, "
                             f"expecting {self.params.shape}")
        if np.dtype(grad.dtype) != self.params.dtype:
            raise TypeError(f"f returned a gradient of dtype {grad.dtype}, "
                            f"expecting {self.params.dtype}")
        if accumulate:
            self.grads += self.xp.asarray(grad)
        else:
            self.grads[...] = self.xp.asarray(grad)
        return float(loss)

    # -- the model API: thin methods over mpishard.checkpoint.model_api ---------

    def predict(self, x: Any) -> Any:
        """The model's prediction for ``x`` (:meth:`forward`)."""
        return self.forward(x)

    def train(self, x: Any, y: Any, optimizer: Any = None) -> float:
        """One optimizer step on ``(x, y)`` in this process; returns the loss
        (``SGD(lr=0.01)`` on the first call without an optimizer)."""
        from ..checkpoint.model_api import train_step

        return train_step(self, x, y, optimizer)

    def get_model_metadata(self) -> dict[str, Any]:
        """Tensor shapes, parameter count, dtype, training history, metrics."""
        from ..checkpoint.model_api import model_metadata

        return model_metadata(self)

    def serialize(self) -> bytes:
        """The model file (parameters, layout, history) as bytes: HDF5, never pickle.

        The function ``f`` is not stored: it is Python code, which a model file
        does not hold. :meth:`deserialize` into a model built with ``f``.
        """
        from ..checkpoint.model_api import serialize_model

        return serialize_model(self)

    def deserialize(self, data: bytes) -> FunctionModel:
        """Load parameters and history from :meth:`serialize` bytes into this model."""
        from ..checkpoint.model_api import deserialize_model

        return deserialize_model(self, data)

    def save_model(self, path: Any) -> str:
        """Write the model file at ``path`` (atomically; ``f`` is not stored)."""
        from ..checkpoint.model_api import save_model

        return save_model(self, path)

    def load_model(self, path: Any) -> FunctionModel:
        """Load the parameters of a model file or checkpoint into this model.

        Raises:
            FileNotFoundError: no file at ``path``.
            CheckpointError: not a valid model file, or another layout.
        """
        from ..checkpoint.model_api import load_model_into

        return load_model_into(self, path)

    @classmethod
    def from_file(cls, path: Any, f: Callable[[Any, Any, Any], tuple[Any, Any]],
                  predict: Callable[[Any, Any], Any] | None = None) -> FunctionModel:
        """A new model with the file's layout and parameters around the function ``f``
        (which the file cannot hold)."""
        from ..checkpoint.model_api import load_model

        return load_model(path, f=f, predict=predict)

    def with_parameters(self, vector: Any) -> FunctionModel:
        """A copy of this model whose parameters are ``vector``."""
        from ..checkpoint.model_api import with_parameters

        return with_parameters(self, vector)

    def clone(self) -> FunctionModel:
        """An independent copy (the same ``f``; own parameters, gradients and history)."""
        from ..checkpoint.model_api import clone_model

        return clone_model(self)

    def __repr__(self) -> str:
        return (f"FunctionModel({getattr(self.f, '__name__', self.f)!r}, "
                f"params={self.params.size}, dtype={self.params.dtype.name})")
