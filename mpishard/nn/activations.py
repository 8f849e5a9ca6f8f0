"""Elementwise activations: [`ReLU`][mpishard.nn.ReLU], [`GELU`][mpishard.nn.GELU] (tanh
approximation), [`Tanh`][mpishard.nn.Tanh].

Their backward multiplies ``dy`` in place by the local derivative: ``dy`` is
scratch of the model, so no gradient buffer of their own is needed. The
arithmetic is `mpishard.kernels.nn`'s (one fused kernel a pass on a GPU).

An activation right after a layer with a bias ([`Linear`][mpishard.nn.Linear],
[`ColumnParallelLinear`][mpishard.nn.ColumnParallelLinear]) adds that bias itself: the model
pairs them (`pair_bias_activations`), the linear layer leaves its output
without the bias, and ``act(x + bias)`` is one pass instead of two. The
numbers are the same: the bias is added to the same product, in the same
precision, before the same activation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..kernels.nn import activation_backward, bias_activation
from .base import BatchContext, Layer

__all__ = [
    "GELU",
    "ReLU",
    "Tanh",
    "pair_bias_activations",
]


class _Activation(Layer):
    """An elementwise activation (``kind`` among `mpishard.kernels.nn.ACTIVATIONS`)."""

    kind = ""
    #: The layer whose bias this activation adds (set by `pair_bias_activations`).
    bias_of: Layer | None = None

    def _scratch_names(self, train: bool) -> tuple[str, ...]:
        return ()

    def allocate(self, rows: int, in_features: int, train: bool,
                 need_dx: bool) -> dict[str, Any]:
        xp, shape = self.xp, (rows, in_features)
        buf = {"y": xp.empty(shape, dtype=self.dtype)}
        for name in self._scratch_names(train):
            buf[name] = xp.empty(shape, dtype=bool if name == "mask" else self.dtype)
        return buf

    def forward(self, x: Any, buf: dict[str, Any], ctx: BatchContext | None) -> Any:
        bias = None if self.bias_of is None else self.bias_of.params["bias"]
        buf["x"] = x   # after the call: x + bias (GELU's backward reads it)
        return bias_activation(self.kind, x, bias, buf["y"], buf)

    def backward_input(self, dy: Any, buf: dict[str, Any]) -> Any:
        return activation_backward(self.kind, dy, buf["x"], buf["y"], buf)


class ReLU(_Activation):
    """``y = max(x, 0)``; the derivative at 0 is taken as 0."""

    kind = "relu"

    def _scratch_names(self, train: bool) -> tuple[str, ...]:
        return ("mask",) if train else ()


class GELU(_Activation):
    """Gaussian error linear unit, **tanh approximation** (PyTorch's ``approximate="tanh"``).

    ``y = 0.5 x (1 + tanh(u))`` with ``u = sqrt(2/pi) (x + 0.044715 x^3)``. It
    differs from the exact ``0.5 x (1 + erf(x / sqrt 2))`` by less than 5e-4
    anywhere; the approximation is used because NumPy has no ``erf`` ufunc.
    """

    kind = "gelu"

    def _scratch_names(self, train: bool) -> tuple[str, ...]:
        return ("t", "s", "s2") if train else ("t", "s")


class Tanh(_Activation):
    """``y = tanh(x)``."""

    kind = "tanh"

    def _scratch_names(self, train: bool) -> tuple[str, ...]:
        return ("s",) if train else ()


def pair_bias_activations(layers: Sequence[Layer]) -> None:
    """Let each activation that directly follows a layer with a bias it can leave
    out (``folds_bias``: Linear, ColumnParallelLinear) add that bias itself.
    Called by the models on their own layers in order, once they are made."""
    for before, after in zip(layers, layers[1:]):
        if (isinstance(after, _Activation) and getattr(before, "folds_bias", False)
                and getattr(before, "bias", False) is True):
            before.defer_bias = True
            after.bias_of = before
