"""``evaluate``: the mean loss of a model on held-out data, without touching gradients."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..backend import array_namespace
from ..nn.losses import Loss, MSELoss, SoftmaxCrossEntropy

__all__ = ["evaluate"]


def evaluate(model: Any, x: Any, y: Any, batch: int = 32) -> float:
    """Mean loss of ``model`` on ``(x, y)``, computed in float64 with
    `mpishard.nn.losses`: [`SoftmaxCrossEntropy`][mpishard.nn.SoftmaxCrossEntropy] for
    integer targets (logits ``(..., classes)``, targets ``(...)``, as a GPT's;
    the mean over every predicted position), [`MSELoss`][mpishard.nn.MSELoss]
    otherwise (the mean over every output element). Evaluated ``batch`` rows at
    a time (a GPT's activations for a whole validation set would take hundreds of
    MiB); works on NumPy and CuPy models alike. Collective wherever the model's
    ``forward`` is (over the tensor and pipeline groups of a model-parallel
    model); otherwise no communication.
    """
    total, count = 0.0, 0
    loss: Loss | None = None
    scratch: dict[tuple[int, int], dict[str, Any]] = {}
    for lo in range(0, len(x), batch):
        out = model.forward(x[lo:lo + batch])
        xp = array_namespace(out)
        target = xp.asarray(y[lo:lo + batch])
        if loss is None:
            loss = SoftmaxCrossEntropy() if target.dtype.kind in "iu" else MSELoss()
            loss.build(xp, np.float64)
        if isinstance(loss, SoftmaxCrossEntropy):
            out = out.reshape(-1, out.shape[-1])
            target = target.reshape(-1)
        else:
            out = out.reshape(out.shape[0], -1)
            if target.size == out.size:
                target = target.reshape(out.shape)
        out = out.astype(np.float64, copy=False)
        rows, features = out.shape
        buf = scratch.get((rows, features))
        if buf is None:
            buf = scratch[(rows, features)] = loss.allocate(rows, features)
        value, _ = loss.loss_and_grad(out, loss.check_target(target, rows, features), buf)
        # Each loss is a mean: CE over rows, MSE over elements; weight it back.
        weight = rows if isinstance(loss, SoftmaxCrossEntropy) else out.size
        total += float(value) * weight
        count += weight
    return total / count if count else float("nan")
