"""The plug-in points: what a model and an optimizer must provide.

A **model** owns one flat parameter vector and one flat gradient vector of the
same length and dtype (NumPy or CuPy), a [`ParamLayout`][mpishard.flat.ParamLayout]
naming the tensors in them, and two methods. Any user class with these members
works with every strategy.

The library's own models ([`mpishard.nn`][mpishard.nn]) also implement
[`BucketedModel`][mpishard.protocols.BucketedModel]: they let a strategy redirect where gradients
are written and tell it when each layer's gradients are complete, which is how DDP overlaps
its Allreduces with the backward pass and how ZeRO-2 avoids ever holding the full
reduced gradient. They also implement [`ShardableModel`][mpishard.protocols.ShardableModel]: a
strategy may place their parameters elsewhere and is told before and after each layer reads
them, which is how ZeRO-3 gathers one bucket of parameters at a time.

An **optimizer** updates any contiguous range of the flat vectors: it is given
``params[r]``, ``grads[r]`` and state arrays of length ``len(r)``, and never knows
which strategy calls it (ZeRO-2 is "the same optimizer on my shard").
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

from .flat import ParamLayout, Range

__all__ = [
    "BACKWARD",
    "FORWARD",
    "INFERENCE",
    "PHASES",
    "BackwardHooks",
    "BucketedModel",
    "BuiltInShards",
    "built_shard_of",
    "CollectiveDataset",
    "Dataset",
    "DescribedModel",
    "HasCore",
    "Model",
    "Optimizer",
    "ParameterHooks",
    "RecoverableCore",
    "ShardableModel",
    "StrategyCore",
    "UnitPassModel",
]

#: The passes a `ParameterHooks` object is told about: a training forward
#: (its backward follows), the backward, and a forward for prediction only.
FORWARD, BACKWARD, INFERENCE = "forward", "backward", "inference"
PHASES = (FORWARD, BACKWARD, INFERENCE)


@runtime_checkable
class Model(Protocol):
    """The minimum a model needs for every strategy.

    ``forward_backward(x, y)`` returns the mean loss over the rows of ``x`` (a
    Python float) and writes d(loss)/d(params) into ``grads``, overwriting it.
    ``forward(x)`` returns predictions without touching ``grads``.

    Two keywords of ``forward_backward`` are optional and used when present:
    ``accumulate=True`` adds the gradient to ``grads`` instead of overwriting;
    ``loss_scale=s`` writes the gradient of ``s`` times the mean loss (the
    returned loss stays the plain mean). Strategies weight each rank's gradient
    by its row count through ``loss_scale``; for a model without it they
    multiply ``grads`` by the row count after the call (one more pass over the
    gradient) and reduce it only after the backward, without overlap.
    """

    params: Any
    grads: Any
    layout: ParamLayout

    def forward(self, x: Any) -> Any: ...

    def forward_backward(self, x: Any, y: Any) -> float: ...


class BackwardHooks(Protocol):
    """Callbacks a strategy gives a [`BucketedModel`][mpishard.protocols.BucketedModel]
    (`GradientBuckets` is the library's).

    ``before(r)`` is called before a layer writes gradients to world range ``r``
    (the union of its tensors' ranges), so a strategy can make sure the buffer
    behind those views is free. ``after(r)`` is called after the layer wrote
    them, with the same ``r``: every gradient at offsets ``>= r.start`` is now
    final for this backward (layers are visited last to first). Every gradient
    write happens between such calls, so a backward ends with ``after`` at the
    lowest offset, 0: strategies rely on it (a rank with no rows, which runs no
    backward, launches each bucket's reduction as the others' hooks do).
    """

    def before(self, r: Range) -> None: ...

    def after(self, r: Range) -> None: ...


@runtime_checkable
class BucketedModel(Model, Protocol):
    """A model whose gradient storage and backward progress a strategy can see.

    * ``forward_backward(x, y, accumulate=False, loss_scale=1.0)``: with
      ``accumulate=True`` the gradients are added to what the gradient views hold
      instead of overwriting; they are the gradients of ``loss_scale`` times the
      mean loss (a strategy passes the rank's row count, so the scaling happens
      inside the backward, before any bucket is reduced).
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

    def forward_backward(self, x: Any, y: Any, *, accumulate: bool = False,
                         loss_scale: float = 1.0) -> float: ...

    def bind_gradients(self, view: Callable[[str], Any]) -> None: ...

    def set_backward_hooks(self, hooks: BackwardHooks | None) -> None: ...

    def set_batch_context(self, step: int, start: int, global_size: int) -> None: ...


class ParameterHooks(Protocol):
    """Callbacks a strategy gives a [`ShardableModel`][mpishard.protocols.ShardableModel]
    ([`ParameterGather`][mpishard.comm.gather.ParameterGather] is the library's, for ZeRO-3).

    The symmetric twin of [`BackwardHooks`][mpishard.protocols.BackwardHooks], for parameter
    *reads*: ``before(r, phase)`` is called before a layer first reads its parameters in a
    pass, ``after(r, phase)`` after it last read them, with ``r`` the world range
    of the layer's tensors (a unit of the layout,
    [`unit_ranges`][mpishard.flat.unit_ranges]) and ``phase`` one of `PHASES`.
    Layers are visited first to last in ``"forward"`` and ``"inference"``, last
    to first in ``"backward"`` (where ``before`` comes before the gradient hooks'
    ``before`` and ``after`` after the layer's input gradient). Every parameter
    read of the model happens between such calls, so a strategy may keep the
    values elsewhere the rest of the time.
    """

    def before(self, r: Range, phase: str) -> None: ...

    def after(self, r: Range, phase: str) -> None: ...


@runtime_checkable
class ShardableModel(Protocol):
    """A model whose parameter storage and parameter reads a strategy can see.

    * ``bind_parameters(view, params=None)``: from now on the parameters of
      tensor ``name`` are read from ``view(name)`` (an array of the tensor's
      shape); ``params`` becomes the given whole vector the views are of, or
      ``None``: the storage belongs to the strategy (ZeRO-3 gives views into a
      few bucket-sized buffers and fills them just before use). Binding does
      not copy values.
    * ``set_parameter_hooks(hooks)``: call ``hooks.before``/``hooks.after``
      ([`ParameterHooks`][mpishard.protocols.ParameterHooks]) around each layer's parameter reads;
      ``None`` removes them.

    A model without it (a [`FunctionModel`][mpishard.nn.FunctionModel], a user's model)
    keeps its whole parameter vector under every strategy.
    """

    def bind_parameters(self, view: Callable[[str], Any], params: Any = None) -> None: ...

    def set_parameter_hooks(self, hooks: ParameterHooks | None) -> None: ...


@runtime_checkable
class BuiltInShards(ShardableModel, Protocol):
    """A [`ShardableModel`][mpishard.protocols.ShardableModel] that may have been
    built in ZeRO-3 shards (a [`LayerStack`][mpishard.nn.LayerStack] given
    ``shard=``[`ParameterShard`][mpishard.flat.ParameterShard]): then its
    ``params`` and ``grads`` are None and ``built_shard()`` is ``(r, values)``,
    this rank's shard ``r`` of the whole model's flat vector, until a ZeRO-3
    strategy attaches it (``bind_parameters`` ends it); otherwise None.
    ``dtype``: the parameters' dtype.
    """

    dtype: Any

    def built_shard(self) -> tuple[Range, Any] | None: ...


def built_shard_of(model: Any) -> tuple[Range, Any] | None:
    """``model.built_shard()`` for a [`BuiltInShards`][mpishard.protocols.BuiltInShards]
    model, else None."""
    return model.built_shard() if isinstance(model, BuiltInShards) else None


@runtime_checkable
class UnitPassModel(Protocol):
    """A model that runs several units of reproducible mode in one pass, each
    unit's gradient alone ([`HybridShardedModel`][mpishard.nn.hybrid.HybridShardedModel]: the
    units are the micro-batches of one pass of its pipeline schedule).

    * ``micro_batches``: the most units a pass runs.
    * ``forward_backward_units(xs, ys, losses, contexts, loss_scale,
      before_backward, after_backward)``: unit ``i`` is ``(xs[i], ys[i])``, its
      batch context ``contexts[i]`` (as ``set_batch_context``'s arguments; None:
      none); no backward accumulates: between ``after_backward(i)`` and the next
      unit's ``before_backward`` the model's gradient is unit ``i``'s alone, of
      ``loss_scale`` times its mean loss; ``losses[i]`` receives that mean.
    """

    micro_batches: int

    def forward_backward_units(self, xs: list[Any], ys: list[Any], losses: Any, *,
                               contexts: list[tuple[int, int, int]] | None = None,
                               loss_scale: float = 1.0,
                               before_backward: Callable[[int], None] | None = None,
                               after_backward: Callable[[int], None] | None = None
                               ) -> None: ...


@runtime_checkable
class DescribedModel(Protocol):
    """A model that describes itself for model files and checkpoints.

    ``architecture()``: a JSON-ready record from which
    [`mpishard.models.build_architecture`][mpishard.models.build_architecture] rebuilds the model in
    one process (``{"version", "class", "args"}``), or None when it cannot be rebuilt from
    data (a [`FunctionModel`][mpishard.nn.FunctionModel] holds code). ``training_metadata()``:
    ``{"steps", "losses"}`` of its single-process training, or None. A checkpoint
    stores both; a model without them is saved without.
    """

    def architecture(self) -> dict[str, Any] | None: ...

    def training_metadata(self) -> dict[str, Any] | None: ...


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


@runtime_checkable
class Dataset(Protocol):
    """Training samples read by row index into preallocated buffers.

    ``len(data)`` is the number of samples. ``buffers(rows, xp, float_dtype)``
    returns ``(x_out, y_out)``: empty arrays for ``rows`` samples on the device of
    ``xp``, floating-point data held in ``float_dtype`` (the model's) when given.
    ``gather(indices, x_out, y_out)`` copies the samples ``indices`` (a 1-D NumPy
    integer array) into the first ``len(indices)`` rows of the buffers; it is not
    collective (each rank reads its own rows). The training loop makes the buffers
    once and gathers into them every step. [`ArrayDataset`][mpishard.data.ArrayDataset]
    (in-memory arrays), [`StreamingDataset`][mpishard.data.StreamingDataset] (one that
    grows) and [`HDF5Dataset`][mpishard.data.HDF5Dataset] (an HDF5 file, or an
    h5py dataset pair) meet it; an ``(x, y)`` pair of arrays is wrapped in an
    ``ArrayDataset``.
    """

    def __len__(self) -> int: ...

    def buffers(self, rows: int, xp: Any, float_dtype: Any = None) -> tuple[Any, Any]: ...

    def gather(self, indices: Any, x_out: Any, y_out: Any) -> None: ...


@runtime_checkable
class CollectiveDataset(Protocol):
    """Samples spread over the ranks, fetched for each global batch collectively.

    ``len(data)`` is the number of samples of the whole set (the same on every
    rank); ``buffers`` is [`Dataset`][mpishard.protocols.Dataset]'s. ``gather_batch(batch, x_out,
    y_out)`` is given the indices of the whole global batch (the same on every rank of
    ``comm``) and fills the first ``n`` rows of the buffers with this rank's part
    of it, rows ``rank_rows(len(batch), comm.size, comm.rank)``
    ([`rank_rows`][mpishard.data.rank_rows]); it is collective over ``comm``, which must
    be the data-parallel group of the strategy that trains on it.
    [`LocalDataset`][mpishard.data.LocalDataset] (rows each rank holds) meets it.
    """

    comm: Any

    def __len__(self) -> int: ...

    def buffers(self, rows: int, xp: Any, float_dtype: Any = None) -> tuple[Any, Any]: ...

    def gather_batch(self, batch: Any, x_out: Any, y_out: Any) -> None: ...


@runtime_checkable
class StrategyCore(Protocol):
    """A parallel strategy core ([`mpishard.parallel`][mpishard.parallel]): what the training loop,
    checkpoints and recovery use of it.

    ``config`` is its [`ShardingConfiguration`][mpishard.config.ShardingConfiguration] and ``dp``
    the data-parallel group's communicator; ``model`` the attached model (None
    before `attach`); ``step_count``, ``skipped_steps`` and
    ``data_position`` are saved and restored with checkpoints;
    ``optimizer_state_shard()`` gives the world range of the optimizer state
    this rank holds and the state by name, ``parameter_shard()`` the world range
    of the parameters it holds and them (the whole vector, or a ZeRO-3 shard);
    ``gathered_parameters()`` the whole vector for a ``with`` block;
    ``dtype`` is the parameters' (None before attach); ``rebuild(config)`` sets
    the core up again over new groups keeping its options; ``memory_phase(name)``
    counts a ``with`` block as a phase of its ``memory_report``.
    """

    strategy: str
    config: Any
    dp: Any
    model: Any
    optimizer: Any
    accumulation_steps: int
    step_count: int
    skipped_steps: int
    data_position: dict[str, int] | None
    dtype: Any

    def attach(self, model: Any) -> None: ...

    def backward(self, x: Any, y: Any, *, batch_start: int | None = None,
                 global_rows: int | None = None) -> float: ...

    def step(self) -> float: ...

    def current_lr(self) -> float: ...

    def optimizer_state_shard(self) -> tuple[Range, dict[str, Any]]: ...

    def parameter_shard(self) -> tuple[Range, Any]: ...

    def gathered_parameters(self) -> AbstractContextManager[Any]: ...

    def memory_phase(self, name: str, traced: bool = True) -> AbstractContextManager[None]: ...

    def rebuild(self, config: Any) -> None: ...


@runtime_checkable
class RecoverableCore(StrategyCore, Protocol):
    """A strategy core that answers for itself after a lost rank
    ([`mpishard.recovery`][mpishard.recovery] asks it, never its class): the
    communicators to revoke, why it cannot go on in place, whether whole 3D
    replicas go on, its parts (``placement.recovery``: ``"replicated"`` or
    ``"sharded"``; ``totals.who``: who is who in the step group), and one method
    that sets the step count, skipped steps and data position."""

    skipped_steps: int
    placement: Any
    totals: Any
    drops_replicas: bool
    options: Any
    xp: Any
    layout: Any
    state: dict[str, Any]

    def communicators(self) -> list[Any]: ...

    def recovery_problem(self) -> str | None: ...

    def whole_parameters(self, params: Any) -> None: ...

    def set_progress(self, *, step_count: int = ..., skipped_steps: int = ...,
                     data_position: dict[str, int] | None = ...) -> None: ...


@runtime_checkable
class HasCore(Protocol):
    """A public strategy (`mpishard.strategies`): it trains through ``core``."""

    core: StrategyCore
