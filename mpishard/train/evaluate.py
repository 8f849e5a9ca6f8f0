"""``evaluate``: the mean loss of a model on held-out data, without touching gradients."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..backend import array_namespace
from ..comm import FlatComm
from ..data import rank_rows
from ..nn.losses import Loss, MSELoss, SoftmaxCrossEntropy
from ..protocols import StrategyCore

__all__ = ["evaluate", "evaluation_group"]


def evaluation_group(core: StrategyCore) -> FlatComm | None:
    """The group a training run's evaluation shares the rows over: the core's
    data-parallel group. None (every row on every rank) in reproducible mode,
    whose values must not depend on the number of ranks, and on a spare rank."""
    config = core.config
    if config.reproducible or config.is_spare:
        return None
    return core.dp


def evaluate(model: Any, x: Any, y: Any, batch: int = 32, *,
             group: FlatComm | None = None) -> float:
    """Mean loss of ``model`` on ``(x, y)``, computed in float64 with
    `mpishard.nn.losses`: [`SoftmaxCrossEntropy`][mpishard.nn.SoftmaxCrossEntropy] for
    integer targets (logits ``(..., classes)``, targets ``(...)``, as a GPT's;
    the mean over every predicted position), [`MSELoss`][mpishard.nn.MSELoss]
    otherwise (the mean over every output element). Evaluated ``batch`` rows at
    a time (a GPT's activations for a whole validation set would take hundreds of
    MiB); works on NumPy and CuPy models alike. Collective wherever the model's
    ``forward`` is (over the tensor and pipeline groups of a model-parallel
    model, over ``groups.dp`` under ZeRO-3) and over ``group``.

    ``group``: a data-parallel group (a strategy's ``dp``; every rank holding
    the same ``x`` and ``y``) over which the rows are shared out: each rank
    evaluates its part (as even as possible) in the same number of ``forward``
    calls, and one ``Allreduce`` sums the totals, so every rank returns the mean
    over all rows (the same value, up to the order of the sums, as without
    ``group``). None: every row here.
    """
    n = len(x)
    lo, hi = (0, n) if group is None else rank_rows(n, group.size, group.rank)
    most = n if group is None else -(-n // group.size)     # the largest part
    totals = np.zeros(2)                                   # sum of losses, weight
    loss: Loss | None = None
    scratch: dict[tuple[int, int], dict[str, Any]] = {}
    for k in range(math.ceil(most / batch)):
        a, b = min(hi, lo + k * batch), min(hi, lo + (k + 1) * batch)
        if a == b:   # a shorter part: the forward still runs (collective under ZeRO-3)
            model.forward(x[:1])
            continue
        out = model.forward(x[a:b])
        xp = array_namespace(out)
        target = xp.asarray(y[a:b])
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
        totals[0] += float(value) * weight
        totals[1] += weight
    if group is not None:
        group.Allreduce(totals, slot="evaluate")
    return float(totals[0] / totals[1]) if totals[1] else float("nan")
