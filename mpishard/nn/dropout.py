"""Inverted dropout whose masks do not depend on how a batch is split."""

from __future__ import annotations

from typing import Any

import numpy as np

from .base import BatchContext, Layer

__all__ = [
    "Dropout",
]


class Dropout(Layer):
    """Zero each element with probability ``p`` in training; scale the rest by ``1/(1-p)``.

    The mask of a training step is drawn for the **whole global batch**, shape
    ``(global_size, features)``, from
    ``numpy.random.default_rng([seed, layer_index, step])``, and this call's rows
    ``[start, start + rows)`` of it are used (see
    [`BatchContext`][mpishard.nn.BatchContext]). So one process on the global batch,
    any data-parallel split of it, and any split into accumulated micro-batches
    all see the same mask: the gradients agree to rounding.

    The uniform numbers are drawn on the host with NumPy (the same stream on
    every backend) and kept until the step changes, so micro-batches of one step
    draw them once. With CuPy the mask rows are copied to the device each call.

    In inference (``forward`` of the model) dropout is the identity.
    """

    def __init__(self, p: float, seed: int = 0) -> None:
        if not 0.0 <= p < 1.0:
            raise ValueError(f"expecting a dropout probability in [0, 1), got {p}")
        self.p = float(p)
        self.seed = int(seed)
        self._uniform: np.ndarray | None = None
        self._uniform_key: tuple[int, int, int] | None = None

    def build(self, index: int, xp: Any, dtype: Any, params: dict[str, Any]) -> None:
        super().build(index, xp, dtype, params)
        self._uniform_key = None  # the stream depends on the index

    def allocate(self, rows: int, in_features: int, train: bool,
                 need_dx: bool) -> dict[str, Any]:
        if not train or self.p == 0.0:
            return {}
        shape = (rows, in_features)
        return {
            "y": self.xp.empty(shape, dtype=self.dtype),
            "host_drop": np.empty(shape, dtype=bool),      # True where zeroed
        }

    def global_uniform(self, ctx: BatchContext, features: int) -> np.ndarray:
        """The uniform numbers of step ``ctx.step``: shape ``(global_size, features)``."""
        key = (ctx.step, ctx.global_size, features)
        if key != self._uniform_key:
            shape = (ctx.global_size, features)
            if self._uniform is None or self._uniform.shape != shape:
                self._uniform = np.empty(shape, dtype=np.float32)
            rng = np.random.default_rng([self.seed, self.index, ctx.step])
            rng.random(dtype=np.float32, out=self._uniform)
            self._uniform_key = key
        return self._uniform

    def forward(self, x: Any, buf: dict[str, Any], ctx: BatchContext | None) -> Any:
        if ctx is None or self.p == 0.0:
            return x
        xp, y, host_drop = self.xp, buf["y"], buf["host_drop"]
        rows, features = x.shape
        u = self.global_uniform(ctx, features)
        np.less(u[ctx.start:ctx.start + rows], self.p, out=host_drop)
        # xp.asarray is a no-op for NumPy and the host-to-device copy for CuPy.
        drop = buf["drop"] = xp.asarray(host_drop)
        # Scale, then a masked store of zeros: no float mask to hold, and no
        # bool-to-float cast through NumPy's iteration buffer.
        xp.multiply(x, 1.0 / (1.0 - self.p), out=y)
        xp.copyto(y, 0, where=drop)
        return y

    def backward_input(self, dy: Any, buf: dict[str, Any]) -> Any:
        if "drop" in buf:
            dy *= 1.0 / (1.0 - self.p)
            self.xp.copyto(dy, 0, where=buf["drop"])
        return dy

    def config(self) -> dict[str, Any] | None:
        if type(self) is not Dropout:     # a subclass with other arguments
            return None
        return {"class": "Dropout", "args": {"p": self.p, "seed": self.seed}}

    def __repr__(self) -> str:
        return f"Dropout(p={self.p}, seed={self.seed})"
