"""A [`Model`][mpishard.protocols.Model] around a user's ``f(params, x, y) -> (loss, grad)``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..backend import array_namespace
from ..flat import ParamLayout
from .model_methods import ModelMethods

__all__ = [
    "FunctionModel",
]


class FunctionModel(ModelMethods):
    """A model for codes that compute their own gradient (an adjoint solver, JAX).

    ``f(params, x, y)`` returns the mean loss over the rows of ``x`` and the
    gradient with respect to ``params``, a flat array of ``params``' shape and
    dtype. ``predict(params, x)``, if given, serves [`forward`][mpishard.nn.FunctionModel.forward].

    The model owns a copy of ``params`` (1-D, float32 or float64, NumPy or
    CuPy) and a gradient vector of the same kind. ``layout`` names the tensors
    in the flat vector (for checkpoints and tensor-aware strategies); by default
    it is one tensor named ``"params"``.

    This is a plain [`Model`][mpishard.protocols.Model], not a
    [`BucketedModel`][mpishard.protocols.BucketedModel]: ``f`` hands back its whole
    gradient at once, so there is no backward progress to report and no way to
    write the gradient elsewhere. Strategies reduce it after
    [`forward_backward`][mpishard.nn.FunctionModel.forward_backward] returns, without overlap.

    A model file of a FunctionModel holds its parameters and layout but not
    ``f`` (Python code, which a file does not hold): [`config`][mpishard.nn.Described.config] is
    None, and [`mpishard.models.load_model`][mpishard.models.load_model] needs ``f=`` to rebuild it.

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

    def forward_backward(self, x: Any, y: Any, *, accumulate: bool = False,
                         loss_scale: float = 1.0) -> float:
        """Call ``f`` and store its gradient in ``grads`` (added with ``accumulate=True``).

        The gradient stored is ``loss_scale`` times ``f``'s, scaled while it is
        copied (a data-parallel strategy passes the rank's row count).

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
        g = self.xp.asarray(grad)
        if not accumulate:
            self.xp.multiply(g, loss_scale, out=self.grads)
        elif loss_scale == 1.0:
            self.grads += g
        else:
            # grads += loss_scale * g, through a buffer made once (no temporary per call).
            if self._scaled is None:
                self._scaled = self.xp.empty_like(self.grads)
            self.xp.multiply(g, loss_scale, out=self._scaled)
            self.grads += self._scaled
        return float(loss)

    _scaled: Any = None    # accumulate with a loss_scale: the scaled gradient

    def __repr__(self) -> str:
        return (f"FunctionModel({getattr(self.f, '__name__', self.f)!r}, "
                f"params={self.params.size}, dtype={self.params.dtype.name})")
