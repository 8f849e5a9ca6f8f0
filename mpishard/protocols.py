"""The plug-in points: what a model and an optimizer must provide.

A **model** owns one flat parameter vector and one flat gradient vector of the
same length and dtype (NumPy or CuPy), a :class:`~mpishard.flat.ParamLayout`
naming the tensors in them, and two methods. Any user class with these members
works with every strategy.

The library's own models (:mod:`mpishard.nn`) also implement
:class:`BucketedModel`: they let a strategy redirect where gradients are written
and tell it when each layer's gradients are complete, which is how DDP overlaps
its Allreduces with the backward pass and how ZeRO-2 avoids ever holding the full
reduced gradient.

An **optimizer** updates any contiguous range of the flat vectors: it is given
``params[r]``, ``grads[r]`` and state arrays of length ``len(r)``, and never knows
which strategy calls it (ZeRO-2 is "the same optimizer on my shard").
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

from .flat import ParamLayout, Range

__all__ = [
    "BackwardHooks",
    "BucketedModel",
    "Model",
    "Optimizer",
]


@runtime_checkable
class Model(Protocol):
    """The minimum a model needs for every strategy.

    ``forward_backward(x, y)`` returns the mean loss over the rows of ``x`` (a
    Python float) and writes d(loss)/d(params) into ``grads``, overwriting it.
    ``forward(x)`` returns predictions without touching ``grads``.
    """

    params: Any
    grads: Any
    layout: ParamLayout

    def forward(self, x: Any) -> Any: ...

    def forward_backward(self, x: Any, y: Any) -> float: ...


class BackwardHooks(Protocol):
    """Callbacks a strategy gives a :class:`BucketedModel`.

    ``before(r)`` is called before a layer writes gradients to world range ``r``
    (the union of its tensors' ranges), so a strategy can make sure the buffer
    behind those views is free. ``after(lo)`` is called after the layer wrote
    them: every gradient at offsets ``>= lo`` is now final for this backward.
    """

    def before(self, r: Range) -> None: ...

    def after(self, lo: int) -> None: ...


@runtime_checkable
class BucketedModel(Model, Protocol):
    """A model whose gradient storage and backward progress a strategy can see.

    * ``forward_backward(x, y, accumulate=False)``: with ``accumulate=True`` the
      gradients are added to what the gradient views hold instead of overwriting.
    * ``bind_gradients(view)``: from now on the gradient of tensor ``name`` is
      written into ``view(name)`` (an array of the tensor's shape). After this the
      model's ``grads`` attribute may be ``None``: the storage belongs to the
      strategy (ZeRO-2 gives views into a few bounded bucket buffers).
    * ``set_backward_hooks(hooks)``: call ``hooks.before``/``hooks.after`` around
      each layer's gradient writes, layers visited last to first; ``None`` removes.
    * ``set_batch_context(step, start, global_size)``: the rows of the next
      ``forward_backward`` are rows ``[start, start + len(x))`` of the global batch
      of optimizer step ``step``; layers that draw random numbers (Dropout) draw
      them for the global batch so that any data-parallel split sees the same masks.
    """

    def forward_backward(self, x: Any, y: Any, *, accumulate: bool = False) -> float: ...

    def bind_gradients(self, view: Callable[[str], Any]) -> None: ...

    def set_backward_hooks(self, hooks: BackwardHooks | None) -> None: ...

    def set_batch_context(self, step: int, start: int, global_size: int) -> None: ...


@runtime_checkable
class Optimizer(Protocol):
    """An update rule for any contiguous range of a flat vector.

    ``init_state(size, dtype, xp)`` returns zeroed state arrays of length ``size``
    by name (``{}`` for plain SGD). ``update(params, grads, state, step, lr,
    grad_scale)`` updates ``params`` in place from ``grads * grad_scale`` (grads are
    read, never written); ``step`` is the 1-based count of this update and ``lr``
    the learning rate for it (the schedule already applied). ``grad_scale`` folds
    gradient averaging and clipping into the update, saving a pass over memory.
    """

    lr: float

    def hyperparameters(self) -> dict[str, Any]: ...

    def init_state(self, size: int, dtype: Any, xp: Any) -> dict[str, Any]: ...

    def update(self, params: Any, grads: Any, state: dict[str, Any], step: int,
               lr: float, grad_scale: float = 1.0) -> None: ...
