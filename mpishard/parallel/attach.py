"""What a data-parallel core checks and learns of a model when it attaches it.

[`check_model`][mpishard.parallel.attach.check_model] refuses what cannot be
trained (agreed over ``groups.dp``); [`ModelCalls`][mpishard.parallel.attach.ModelCalls]
calls the model's ``forward_backward`` as its signature allows (``loss_scale``,
``accumulate``) and places a micro-batch's rows in the global batch
(``set_batch_context``); [`own_gradient`][mpishard.parallel.attach.own_gradient]
gives a model back the gradient vector a sharded strategy took from it. Used
by [`DataParallelCore.attach`][mpishard.parallel.base.DataParallelCore.attach].
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import numpy as np

from ..comm import FlatComm
from ..errors import MpiShardError
from ..protocols import Model

__all__ = ["ModelCalls", "check_model", "own_gradient"]

_FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def check_model(dp: FlatComm, model: Any, built: tuple[Any, Any] | None = None) -> Any:
    """Refuse a model that cannot be trained, or whose parameter count or dtype
    differs between the ranks of ``dp``; return the values it holds (its
    ``params``, or its shard where it was built in shards: ``built``, the
    ``(range, values)`` of [`built_shard_of`][mpishard.protocols.built_shard_of]).
    Collective over ``dp``.

    Raises:
        TypeError: not a model, or parameters that are not float32/float64 1-D
            arrays (on every rank).
        MpiShardError: the parameter count or dtype differs between ranks.
    """
    dp.agree(_model_problem(model) if built is None else None, TypeError)
    values = model.params if built is None else built[1]
    every = dp.allgather((model.layout.size, values.dtype.str))
    if len(set(every)) > 1:
        detail = ", ".join(f"rank {r} has {c} {np.dtype(d).name}"
                           for r, (c, d) in enumerate(every))
        raise MpiShardError(f"parameters differ between data-parallel ranks: {detail}")
    return values


def _model_problem(model: Any) -> str | None:
    """Why ``model`` cannot be trained, or None."""
    if not isinstance(model, Model):
        return (f"expecting a model with params, grads, layout, forward() and "
                f"forward_backward(), got {type(model).__name__}")
    params = model.params
    if params is None:
        return ("model.params is None: the parameters are sharded by the ZeRO-3 strategy "
                "the model is attached to; call its unshard() first")
    if getattr(params, "ndim", None) != 1:
        return f"model.params must be a 1-D array, got shape {getattr(params, 'shape', None)}"
    if params.dtype not in _FLOAT_DTYPES:
        return f"model.params must be float32 or float64, got {params.dtype}"
    if params.size != model.layout.size:
        return f"model.params has {params.size} elements but its layout has {model.layout.size}"
    grads = model.grads
    if grads is not None and (grads.shape != params.shape or grads.dtype != params.dtype):
        return (f"model.grads must match params ({params.shape}, {params.dtype}), "
                f"got ({grads.shape}, {grads.dtype})")
    return None


def own_gradient(model: Any, xp: Any, dtype: Any) -> None:
    """Give ``model`` one full gradient vector again: a strategy it was attached to
    before (ZeRO-2) bound its gradients to that strategy's bucket buffers, or it
    was built in shards, and ``grads`` was None. Made once, at attach."""
    grads = xp.zeros(model.layout.size, dtype=dtype)
    layout = model.layout

    def view(name: str) -> Any:
        spec = layout[name]
        return grads[spec.offset:spec.offset + spec.size].reshape(spec.shape)

    model.bind_gradients(view)
    model.grads = grads


def _accepts_keyword(fn: Callable, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


class ModelCalls:
    """How a core calls the model it attached: what its ``forward_backward``
    accepts, and whether it takes ``set_batch_context``. Made at attach. Local."""

    def __init__(self, model: Any) -> None:
        #: ``forward_backward`` adds into the gradient there (``accumulate=True``).
        self.accumulates = _accepts_keyword(model.forward_backward, "accumulate")
        #: ``forward_backward`` scales d(loss)/d(output) itself (``loss_scale=``).
        self.scales_loss = _accepts_keyword(model.forward_backward, "loss_scale")
        #: The model takes ``set_batch_context`` (dropout's rows of the global batch).
        self.sets_batch_context = hasattr(model, "set_batch_context")

    def run(self, model: Any, x: Any, y: Any, accumulate: bool, rows: int) -> float:
        """The model's forward and backward, its gradient weighted by ``rows``
        (the mean loss's gradient times the rows: the sum over them).

        Library models scale d(loss)/d(output) inside their backward
        (``loss_scale``), which costs nothing. Any other model's gradient is
        multiplied afterwards (one pass; with ``accumulate`` the sum so far is
        divided by ``rows`` first and multiplied back with the new term).
        """
        if self.scales_loss:
            if accumulate:
                return float(model.forward_backward(x, y, accumulate=True, loss_scale=rows))
            return float(model.forward_backward(x, y, loss_scale=rows))
        grads = model.grads
        if accumulate:
            grads *= 1.0 / rows
            loss = model.forward_backward(x, y, accumulate=True)
        else:
            loss = model.forward_backward(x, y)
        grads *= rows
        return float(loss)

    @staticmethod
    def batch_context(model: Any, step: int, micro: int, rows: int, batch_start: int | None,
                      global_rows: int | None, dp: FlatComm, accumulation_steps: int) -> None:
        """Tell ``model`` where micro-batch ``micro`` of ``rows`` rows lies in the
        global batch of step ``step``: at ``batch_start`` of ``global_rows``, or
        (neither given) as an even split over ``dp`` and ``accumulation_steps``."""
        if batch_start is not None:
            model.set_batch_context(step, batch_start, global_rows)
        elif micro < accumulation_steps:
            # Only known for an even accumulation_steps split; extra no_sync()
            # micro-batches of a hand-written loop leave the model to its own counter.
            per_rank = rows * accumulation_steps
            model.set_batch_context(step, dp.rank * per_rank + micro * rows,
                                    per_rank * dp.size)
