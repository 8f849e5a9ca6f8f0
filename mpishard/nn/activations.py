"""Elementwise activations: :class:`ReLU`, :class:`GELU` (tanh approximation), :class:`Tanh`.

Their backward multiplies ``dy`` in place by the local derivative: ``dy`` is
scratch of the model, so no gradient buffer of their own is needed.
"""

from __future__ import annotations

import math
from typing import Any

from .base import BatchContext, Layer

__all__ = [
    "GELU",
    "ReLU",
    "Tanh",
]


class ReLU(Layer):
    """``y = max(x, 0)``; the derivative at 0 is taken as 0."""

    def allocate(self, rows: int, in_features: int, train: bool,
                 need_dx: bool) -> dict[str, Any]:
        xp = self.xp
        buf = {"y": xp.empty((rows, in_features), dtype=self.dtype)}
        if train:
            buf["mask"] = xp.empty((rows, in_features), dtype=bool)
        return buf

    def forward(self, x: Any, buf: dict[str, Any], ctx: BatchContext | None) -> Any:
        return self.xp.maximum(x, 0, out=buf["y"])

    def backward_input(self, dy: Any, buf: dict[str, Any]) -> Any:
        # A masked store, not dy * mask: multiplying by a bool array makes NumPy
        # cast it through an iteration buffer on every call.
        xp, mask = self.xp, buf["mask"]
        xp.less_equal(buf["y"], 0, out=mask)
        xp.copyto(dy, 0, where=mask)
        return dy


class GELU(Layer):
    """Gaussian error linear unit, **tanh approximation** (PyTorch's ``approximate="tanh"``).

    ``y = 0.5 x (1 + tanh(u))`` with ``u = sqrt(2/pi) (x + 0.044715 x^3)``. It
    differs from the exact ``0.5 x (1 + erf(x / sqrt 2))`` by less than 5e-4
    anywhere; the approximation is used because NumPy has no ``erf`` ufunc.
    """

    _C = math.sqrt(2.0 / math.pi)
    _A = 0.044715

    def allocate(self, rows: int, in_features: int, train: bool,
                 need_dx: bool) -> dict[str, Any]:
        xp, shape = self.xp, (rows, in_features)
        buf = {name: xp.empty(shape, dtype=self.dtype) for name in ("y", "t", "s")}
        if train:
            buf["s2"] = xp.empty(shape, dtype=self.dtype)
        return buf

    def forward(self, x: Any, buf: dict[str, Any], ctx: BatchContext | None) -> Any:
        xp, t, s, y = self.xp, buf["t"], buf["s"], buf["y"]
        xp.multiply(x, x, out=s)
        s *= self._A
        s += 1.0
        s *= x
        s *= self._C                     # s = u
        xp.tanh(s, out=t)                # kept for backward
        xp.add(t, 1.0, out=y)
        y *= x
        y *= 0.5
        buf["x"] = x
        return y

    def backward_input(self, dy: Any, buf: dict[str, Any]) -> Any:
        # dy/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2)
        xp, x, t, s, s2 = self.xp, buf["x"], buf["t"], buf["s"], buf["s2"]
        xp.multiply(t, t, out=s)
        xp.subtract(1.0, s, out=s)
        s *= x
        xp.multiply(x, x, out=s2)
        s2 *= 3.0 * self._A
        s2 += 1.0
        s *= s2
        s *= self._C
        s += t
        s += 1.0
        s *= 0.5
        dy *= s
        return dy


class Tanh(Layer):
    """``y = tanh(x)``."""

    def allocate(self, rows: int, in_features: int, train: bool,
                 need_dx: bool) -> dict[str, Any]:
        xp, shape = self.xp, (rows, in_features)
        buf = {"y": xp.empty(shape, dtype=self.dtype)}
        if train:
            buf["s"] = xp.empty(shape, dtype=self.dtype)
        return buf

    def forward(self, x: Any, buf: dict[str, Any], ctx: BatchContext | None) -> Any:
        return self.xp.tanh(x, out=buf["y"])

    def backward_input(self, dy: Any, buf: dict[str, Any]) -> Any:
        xp, y, s = self.xp, buf["y"], buf["s"]
        xp.multiply(y, y, out=s)
        xp.subtract(1.0, s, out=s)
        dy *= s
        return dy
