"""Losses, each the mean over the rows of a batch:
[`SoftmaxCrossEntropy`][mpishard.nn.SoftmaxCrossEntropy], [`MSELoss`][mpishard.nn.MSELoss].

A mean over the rows *given* makes the loss of a data-parallel rank the mean of
its rows; a strategy combines the ranks' values weighted by their row counts to
get the mean over the global batch. An empty batch has loss 0 and gradient 0,
so a rank with no rows can still join the collectives with weight 0.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..kernels.nn import softmax_cross_entropy
from .base import no_argument_config

__all__ = [
    "Loss",
    "MSELoss",
    "SoftmaxCrossEntropy",
    "check_labels",
]


def check_labels(loss: Any, target: Any, rows: int) -> Any:
    """``target`` if it is integer class labels of shape ``(rows,)``, as a
    cross-entropy ``loss`` (named in the error) reads them.

    Raises:
        TypeError: not integers.
        ValueError: another shape.
    """
    if target.dtype.kind not in "iu":
        raise TypeError(f"{type(loss).__name__} expects integer class labels, "
                        f"got dtype {target.dtype}")
    if target.shape != (rows,):
        raise ValueError(f"expecting labels of shape ({rows},), got {target.shape}")
    return target


class Loss:
    """The last step of a [`Sequential`][mpishard.nn.Sequential]: model output and target to a
    number.

    Like a layer, a loss keeps its scratch in buffers made by `allocate`
    once per batch shape; `loss_and_grad` returns the loss and
    d(loss)/d(output) (the buffer ``buf["grad"]``).

    The loss is returned as a scalar of the backend (a 0-d CuPy array on a
    GPU), not a Python float: the model converts it only after the backward is
    queued, so the host does not wait for the GPU in the middle of a step.
    """

    xp: Any = np
    dtype: np.dtype = np.dtype(np.float64)

    def build(self, xp: Any, dtype: Any) -> None:
        self.xp = xp
        self.dtype = np.dtype(dtype)

    def allocate(self, rows: int, features: int) -> dict[str, Any]:
        return {"grad": self.xp.empty((rows, features), dtype=self.dtype)}

    def check_target(self, target: Any, rows: int, features: int) -> Any:
        """``target`` as this loss reads it; raises if it does not fit the output."""
        raise NotImplementedError

    def loss_and_grad(self, out: Any, target: Any, buf: dict[str, Any]) -> tuple[Any, Any]:
        raise NotImplementedError

    def config(self) -> dict[str, Any] | None:
        """The loss as JSON, or None (see [`config`][mpishard.nn.Layer.config])."""
        return no_argument_config(self, Loss)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class SoftmaxCrossEntropy(Loss):
    """Cross-entropy of softmax(logits) against integer class labels, mean over rows.

    ``loss = mean_i (logsumexp(z_i) - z_i[y_i])``, computed through a log-softmax
    shifted by the row maximum so that large logits do not overflow. Labels are
    an integer array of shape ``(rows,)`` with values in ``[0, classes)``
    (NumPy raises ``IndexError`` for one outside; CuPy does not check).
    """

    def allocate(self, rows: int, features: int) -> dict[str, Any]:
        xp, dt, shape = self.xp, self.dtype, (rows, features)
        return {
            "grad": xp.empty(shape, dtype=dt),            # softmax, then the gradient
            "logp": xp.empty(shape, dtype=dt),
            "onehot": xp.empty(shape, dtype=dt),
            "rowmax": xp.empty((rows, 1), dtype=dt),
            "sumexp": xp.empty((rows, 1), dtype=dt),
            "rows": xp.arange(rows),
            "rowloss": xp.empty(rows, dtype=dt),          # the fused kernel's, per row
        }

    def check_target(self, target: Any, rows: int, features: int) -> Any:
        return check_labels(self, target, rows)

    def loss_and_grad(self, out: Any, target: Any, buf: dict[str, Any]) -> tuple[Any, Any]:
        return softmax_cross_entropy(out, target, buf)


class MSELoss(Loss):
    """Mean squared error: the plain mean over all ``rows * outputs`` elements.

    ``loss = sum((out - target)^2) / (rows * outputs)``, which equals the mean
    over rows of each row's sum of squares divided by the output width (PyTorch's
    ``MSELoss(reduction="mean")``). Targets are floating point, of the output's
    shape; ``(rows,)`` is accepted for a single output.
    """

    def check_target(self, target: Any, rows: int, features: int) -> Any:
        if target.dtype.kind != "f":
            raise TypeError(f"MSELoss expects floating-point targets, got dtype {target.dtype}")
        if target.shape == (rows,) and features == 1:
            return target.reshape(rows, 1)
        if target.shape != (rows, features):
            raise ValueError(f"expecting targets of shape ({rows}, {features}), "
                             f"got {target.shape}")
        return target

    def loss_and_grad(self, out: Any, target: Any, buf: dict[str, Any]) -> tuple[Any, Any]:
        xp, d = self.xp, buf["grad"]
        n = out.size
        xp.subtract(out, target, out=d)
        scale = 1.0 / n if n else 0.0
        loss = xp.vdot(d.ravel(), d.ravel()) * scale
        d *= 2.0 * scale
        return loss, d
