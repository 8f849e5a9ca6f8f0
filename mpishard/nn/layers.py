"""Layers with parameters: [`Linear`][mpishard.nn.Linear] and
[`LayerNorm`][mpishard.nn.LayerNorm]."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..kernels.nn import layer_norm_backward, layer_norm_forward
from .base import BatchContext, Layer, finish_gradient, store_gradient
from .handover import HandOver

__all__ = [
    "LayerNorm",
    "Linear",
]


class Linear(Layer):
    """Affine map ``y = x @ W + b`` with ``W`` of shape ``(in_features, out_features)``.

    The weight is stored input-major (the transpose of PyTorch's) so that the
    forward is one ``matmul`` of row-major arrays with no transpose, and the
    weight gradient ``x.T @ dy`` is written straight into its gradient view.

    Initialisation is PyTorch's default for ``nn.Linear``: weight and bias
    uniform in ``[-1/sqrt(in_features), 1/sqrt(in_features)]`` (Kaiming-uniform
    with ``a = sqrt(5)``).
    """

    #: The bias may be left to the activation after it (see
    #: `pair_bias_activations`); ``defer_bias``
    #: says it was, and the output is then ``x @ W`` alone.
    folds_bias = True
    defer_bias = False
    #: The constructor arguments `config` records, in order.
    _CONFIG: tuple[str, ...] = ("in_features", "out_features", "bias")

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        if in_features < 1 or out_features < 1:
            raise ValueError(f"expecting positive feature counts, got "
                             f"in_features={in_features}, out_features={out_features}")
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.bias = bool(bias)
        #: The block of the weight this rank holds is ``(local_in, local_out)``:
        #: the whole weight (a tensor-parallel Linear holds a slice).
        self.local_in, self.local_out = self.in_features, self.out_features

    def param_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        shapes = [("weight", (self.local_in, self.local_out))]
        if self.bias:
            shapes.append(("bias", (self.local_out,)))
        return shapes

    def init_params(self, rng: np.random.Generator) -> None:
        bound = 1.0 / math.sqrt(self.in_features)
        for name, shape in self.param_shapes():
            host = rng.uniform(-bound, bound, size=shape).astype(self.dtype)
            self.params[name][...] = self.xp.asarray(host)

    def output_features(self, in_features: int) -> int:
        if in_features != self.local_in:
            part = f" (its part of {self.in_features})" if self.local_in < self.in_features else ""
            raise ValueError(f"layer {self.index} ({type(self).__name__}) expects "
                             f"{self.local_in} input features{part}, got {in_features}")
        return self.local_out

    def allocate(self, rows: int, in_features: int, train: bool,
                 need_dx: bool) -> dict[str, Any]:
        xp = self.xp
        buf = {"y": xp.empty((rows, self.local_out), dtype=self.dtype)}
        if train and need_dx:
            buf["dx"] = xp.empty((rows, self.local_in), dtype=self.dtype)
        return buf

    def forward(self, x: Any, buf: dict[str, Any], ctx: BatchContext | None) -> Any:
        xp, y = self.xp, buf["y"]
        xp.matmul(x, self.params["weight"], out=y)
        if self.bias and not self.defer_bias:
            y += self.params["bias"]
        buf["x"] = x  # a reference, not a copy: the weight gradient needs it
        return y

    def handover_groups(self) -> list[tuple[tuple[str, ...], bool]]:
        """Handed over piece by piece ([`mpishard.nn.handover`][mpishard.nn.handover]):
        the bias, then the weight in blocks of rows, last first."""
        return ([(("bias",), False)] if self.bias else []) + [(("weight",), True)]

    def backward_params(self, dy: Any, buf: dict[str, Any], grads: Any,
                        scratch: dict[str, Any] | None) -> None:
        xp = self.xp
        if isinstance(grads, HandOver):
            self._backward_pieces(dy, buf, grads)
            return
        out = store_gradient(grads["weight"], scratch, "weight")
        xp.matmul(buf["x"].T, dy, out=out)
        finish_gradient(xp, grads["weight"], out)
        if self.bias:
            out = store_gradient(grads["bias"], scratch, "bias")
            xp.sum(dy, axis=0, out=out)
            finish_gradient(xp, grads["bias"], out)

    def _backward_pieces(self, dy: Any, buf: dict[str, Any], hand: HandOver) -> None:
        """The bias, then ``x[:, rows].T @ dy`` for each row block of the weight,
        each piece between the hooks."""
        xp, x = self.xp, buf["x"]
        for name in ("bias", "weight") if self.bias else ("weight",):
            for piece in hand.pieces(name):
                views, scratch = hand.begin(piece)
                out = store_gradient(views[name], scratch, name)
                if piece.rows is None:
                    xp.sum(dy, axis=0, out=out)
                else:
                    xp.matmul(x[:, piece.rows].T, dy, out=out)
                finish_gradient(xp, views[name], out)
                hand.end(piece)

    def backward_input(self, dy: Any, buf: dict[str, Any]) -> Any:
        dx = buf["dx"]
        self.xp.matmul(dy, self.params["weight"].T, out=dx)
        return dx

    def config(self) -> dict[str, Any]:
        return {"class": type(self).__name__,
                "args": {name: getattr(self, name) for name in self._CONFIG}}

    def __repr__(self) -> str:
        return f"Linear({self.in_features}, {self.out_features}, bias={self.bias})"


class LayerNorm(Layer):
    """Normalise each row over its features, then scale and shift.

    ``y = (x - mean) / sqrt(var + eps) * weight + bias``, with the biased
    variance over the last axis (as PyTorch). ``weight`` starts at ones and
    ``bias`` at zeros.
    """

    def __init__(self, features: int, eps: float = 1e-5) -> None:
        if features < 1:
            raise ValueError(f"expecting a positive feature count, got {features}")
        self.features = int(features)
        self.eps = float(eps)

    def param_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        return [("weight", (self.features,)), ("bias", (self.features,))]

    def init_params(self, rng: np.random.Generator) -> None:
        self.params["weight"].fill(1)
        self.params["bias"].fill(0)

    def output_features(self, in_features: int) -> int:
        if in_features != self.features:
            raise ValueError(f"layer {self.index} (LayerNorm) expects {self.features} "
                             f"features, got {in_features}")
        return self.features

    def allocate(self, rows: int, in_features: int, train: bool,
                 need_dx: bool) -> dict[str, Any]:
        xp, dt, f = self.xp, self.dtype, self.features
        buf = {
            "y": xp.empty((rows, f), dtype=dt),
            "xhat": xp.empty((rows, f), dtype=dt),
            "tmp": xp.empty((rows, f), dtype=dt),
            "mean": xp.empty((rows, 1), dtype=dt),
            "rstd": xp.empty((rows, 1), dtype=dt),
        }
        if train:
            buf["mean2"] = xp.empty((rows, 1), dtype=dt)
        return buf

    def forward(self, x: Any, buf: dict[str, Any], ctx: BatchContext | None) -> Any:
        prm = self.params
        return layer_norm_forward(x, prm["weight"], prm["bias"], self.eps, buf["y"],
                                  buf["xhat"], buf["mean"], buf["rstd"], buf["tmp"])

    def backward_params(self, dy: Any, buf: dict[str, Any], grads: dict[str, Any],
                        scratch: dict[str, Any] | None) -> None:
        xp, tmp = self.xp, buf["tmp"]
        out = store_gradient(grads["weight"], scratch, "weight")
        xp.multiply(dy, buf["xhat"], out=tmp)
        xp.sum(tmp, axis=0, out=out)
        finish_gradient(xp, grads["weight"], out)
        out = store_gradient(grads["bias"], scratch, "bias")
        xp.sum(dy, axis=0, out=out)
        finish_gradient(xp, grads["bias"], out)

    def backward_input(self, dy: Any, buf: dict[str, Any]) -> Any:
        # dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) with g = dy * weight,
        # computed in place in dy (the parameter gradients were taken already).
        return layer_norm_backward(dy, self.params["weight"], buf["xhat"], buf["rstd"],
                                   buf["tmp"], buf["mean"], buf["mean2"])

    def config(self) -> dict[str, Any]:
        return {"class": "LayerNorm", "args": {"features": self.features, "eps": self.eps}}

    def __repr__(self) -> str:
        return f"LayerNorm({self.features}, eps={self.eps})"
