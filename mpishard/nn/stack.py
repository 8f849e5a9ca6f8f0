"""``LayerStack``: a contiguous range of a model's top-level layers on one flat vector.

Every serial model of [`mpishard.nn`][mpishard.nn] (``Sequential``/``MLP``, ``GPT``,
``ParallelMLP``) is a ``LayerStack`` of all its layers; a pipeline stage is one of
the range ``[start, stop)``, named and initialised exactly as in the whole model,
run through the stage API (``forward_stage``, ``loss``, ``backward_stage``) that
pipeline schedules are written on. Tensor names do not depend on the partition:
``"3.attn.wq"`` is called that in the serial model, in every tensor-parallel rank
(which holds a slice of it, [`TensorShard`][mpishard.nn.TensorShard]) and in the
stage that holds layer 3.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..backend import array_namespace
from ..flat import ParameterShard, ParamLayout, Range
from ..protocols import BACKWARD, FORWARD, INFERENCE, BackwardHooks, ParameterHooks
from .activations import pair_bias_activations
from .base import BatchContext, Layer
from .handover import HandOver, HandOverState, plan_layer
from .losses import Loss
from .shards import TensorShard

__all__ = ["LayerStack", "uninitialised_shards"]

# Within uninitialised_shards(): models built in shards skip the initialisation.
_SKIP_INIT = [False]


@contextmanager
def uninitialised_shards() -> Iterator[None]:
    """Within it, a model built in shards (``shard=``) allocates its shard but
    does not initialise it (it holds zeros): for a rebuild whose values are moved
    in next (a recovery's), where drawing them would be compute thrown away. Local."""
    before, _SKIP_INIT[0] = _SKIP_INIT[0], True
    try:
        yield
    finally:
        _SKIP_INIT[0] = before


# -- a range of top-level layers: the model and pipeline-stage class -------------------

_FORWARD, _LOSS, _DONE = "forward", "loss", "backward"


@dataclass
class _Workspace:
    """Every buffer of one micro-batch slot (or of inference) for one input shape."""

    shape: tuple[int, ...]
    x: Any                              # the stage input, copied in
    layers: list[dict[str, Any]]
    out_shape: tuple[int, ...]
    loss: dict[str, Any] | None         # the criterion's buffers (last stage, training)
    dy: Any = None                      # the incoming output gradient, copied in
    out: Any = None
    grad_out: Any = None                # d(loss)/d(output) left by loss()
    state: str = _DONE


def _shared(stack: Any) -> HandOverState:
    """A fresh state shared by a model's hand-overs (hooks, accumulation)."""
    return HandOverState(xp=stack.xp, dtype=stack.dtype)


def _collect_arrays(obj: Any, held: dict[int, Any]) -> None:
    """Every array in ``obj`` (nested dicts, lists and tuples) into ``held``, by
    the id of the array that owns its memory (a view's base)."""
    if isinstance(obj, dict):
        for value in obj.values():
            _collect_arrays(value, held)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _collect_arrays(value, held)
    elif hasattr(obj, "nbytes") and hasattr(obj, "shape"):
        while getattr(obj, "base", None) is not None and hasattr(obj.base, "nbytes"):
            obj = obj.base
        held[id(obj)] = obj


def _kind(buf: Any) -> Any:
    """What makes two layers' buffers interchangeable: their keys, shapes and
    dtypes (arrays), values (numbers, flags); None (never shared) for anything else."""
    if isinstance(buf, dict):
        parts = [(key, _kind(value)) for key, value in sorted(buf.items())]
        return None if any(kind is None for _, kind in parts) else tuple(parts)
    if isinstance(buf, (list, tuple)):
        parts = [_kind(value) for value in buf]
        return None if any(kind is None for kind in parts) else (type(buf), tuple(parts))
    if buf is None or isinstance(buf, (bool, int, float, str)):
        return (type(buf), buf)
    shape, dtype = getattr(buf, "shape", None), getattr(buf, "dtype", None)
    if shape is None or dtype is None:
        return None
    return ("array", tuple(shape), str(dtype), getattr(buf, "base", None) is None)


def _ping_pong(alike: dict[Any, tuple[list[Any], list[int]]], key: Any, buf: Any) -> Any:
    """``buf``, or the one of the two sets of its kind not used last (inference)."""
    if key[1] is None:
        return buf
    sets, turn = alike.setdefault(key, ([], [0]))
    if len(sets) < 2:
        sets.append(buf)
    chosen = sets[turn[0] % 2]
    turn[0] += 1
    return chosen


class LayerStack:
    """Top-level layers ``[start, stop)`` of a model, each possibly tensor-parallel.

    The base class of [`GPT`][mpishard.nn.GPT] and
    [`ParallelMLP`][mpishard.nn.ParallelMLP], usable with any list of
    [`Layer`][mpishard.nn.Layer]. ``layers`` is the list of the **whole** model;
    ``stage_layers=(start, stop)`` builds only those layers (a pipeline stage),
    ``None`` all of them. Tensors are named ``"<i>.<name>"`` by the layer's index
    ``i`` in the whole model and layer ``i`` draws its initial values from
    ``numpy.random.default_rng([seed, i])``, so a stage holds exactly the
    tensors, with exactly the values, that the whole model holds for its layers.
    A tensor-parallel layer draws its full logical tensors from that stream and
    keeps its slice (see [`tensor_shards`][mpishard.nn.LayerStack.tensor_shards]).

    ``shard=ParameterShard(rank, ranks)`` ([`ParameterShard`][mpishard.flat.ParameterShard])
    builds only that ZeRO-3 shard of the flat vector: each layer that overlaps it
    is initialised alone in a scratch of the largest layer's size and the
    overlap kept, so the shard holds exactly the bits the whole model would, at
    any ``ranks``, and the peak is the shard plus about a layer. ``params`` and
    ``grads`` are then None and the model runs only once a ZeRO-3 strategy has
    attached it ([`built_shard`][mpishard.nn.LayerStack.built_shard];
    [`ZeRO3Optimizer.build`][mpishard.strategies.zero3.ZeRO3Optimizer.build] builds
    and attaches).

    Activations between layers may have any shape (``(rows, features)`` for an
    MLP, ``(batch, tokens, d_model)`` for a GPT). The loss is the mean over all
    positions but the last axis of the final output (rows; or batch x tokens).

    **Whole model** (``stage_layers`` None or covering every layer): the
    [`BucketedModel`][mpishard.protocols.BucketedModel] protocol, ``forward(x)`` and
    ``forward_backward(x, y, accumulate=False, loss_scale=1.0)``. Whole model or
    stage: the [`ShardableModel`][mpishard.protocols.ShardableModel] protocol
    (``bind_parameters``, ``set_parameter_hooks``), called around every layer's
    parameter reads in ``forward``, ``forward_stage`` and the backward.

    **Stage API**, for pipeline schedules (GPipe, 1F1B). ``micro`` names a
    micro-batch slot: each slot has its own activations, allocated on its first
    use (and when its input shape changes) and reused afterwards, so any number
    of micro-batches can be in flight, and a schedule that reuses slot numbers
    ``0 .. M-1`` every step allocates nothing after the first step.

    * ``forward_stage(x, micro)``: runs the stage's layers on ``x`` (copied in,
      so the caller may reuse its receive buffer) and returns the output
      activations, a buffer of the slot that stays valid until the slot's next
      ``forward_stage``. Consumes the batch context of
      [`set_batch_context`][mpishard.nn.LayerStack.set_batch_context]: set it before each
      micro-batch when the model has dropout (step, the micro-batch's first row in the global batch,
      and the global batch size).
    * ``loss(y, micro)`` (last stage only): the mean loss of the slot's output
      against ``y``; keeps d(loss)/d(output) for ``backward_stage``.
    * ``backward_stage(grad_out, micro, accumulate=False)``: backward through
      the stage from ``grad_out`` (d(loss)/d(output), copied in; ``None`` on the
      last stage: from ``loss``). Gradients overwrite the gradient views, or are
      added with ``accumulate=True`` (every micro-batch after a step's first).
      Backward hooks are called as in ``forward_backward``. Returns
      d(loss)/d(input) of the stage, a buffer of the slot (valid until its next
      backward), or ``None`` on the first stage (no one needs the gradient of
      the data).

    Each micro-batch loss is its own mean: a schedule running ``M`` equal
    micro-batches scales the accumulated gradient by ``1 / M`` (as the
    data-parallel strategies do with ``grad_scale``). ``stage_input_shape`` and
    ``stage_output_shape`` give the activation shapes a schedule sends and
    receives, from the shape of the model's input batch.

    Raises:
        TypeError: ``dtype`` is not float32 or float64.
        ValueError: no layers, a bad ``stage_layers``, or no loss for the last stage.
    """

    def __init__(self, layers: Sequence[Layer], loss: Loss | None, dtype: Any = np.float64,
                 xp: Any = np, seed: int = 0, *,
                 stage_layers: tuple[int, int] | None = None,
                 shard: ParameterShard | None = None) -> None:
        dt = np.dtype(dtype)
        if dt not in (np.dtype(np.float32), np.dtype(np.float64)):
            raise TypeError(f"expecting dtype float32 or float64, got {dt}")
        n = len(layers)
        if n == 0:
            raise ValueError("expecting at least one layer, got none")
        bounds = (0, n) if stage_layers is None else tuple(int(i) for i in stage_layers)
        start, stop = bounds if len(bounds) == 2 else (0, 0)
        if not 0 <= start < stop <= n:
            raise ValueError(f"expecting stage_layers (start, stop) with 0 <= start < stop <= "
                             f"{n} (the model's top-level layers), got {stage_layers}")
        if stop == n and loss is None:
            raise ValueError("the last stage needs a loss, got None")
        self.num_layers = n
        self.stage_layers = (start, stop)
        self.all_layers = list(layers)      # unbuilt outside the stage: shapes only
        self.layers = self.all_layers[start:stop]
        self.criterion = loss if stop == n else None
        self.dtype = dt
        self.seed = int(seed)

        self.layout = ParamLayout()
        self._names: list[list[tuple[str, str]]] = []    # per layer: (local, global)
        for i, layer in enumerate(self.layers, start):
            names = []
            for local, shape in layer.param_shapes():
                self.layout.add(f"{i}.{local}", shape)
                names.append((local, f"{i}.{local}"))
            self._names.append(names)
        self._ranges: list[Range | None] = []
        for names in self._names:
            specs = [self.layout[name] for _, name in names]
            self._ranges.append(Range(specs[0].offset, specs[-1].range.stop) if specs else None)
        #: ``(range, values)``: this rank's shard of the vector, built in shards and
        #: not attached yet (``built_shard``); None otherwise.
        self._built: tuple[Range, Any] | None = None
        if shard is not None and self.layout.size:
            self._build_shard(xp, shard.range(self.layout.size))
        else:
            self._build_whole(xp)
        # act(x @ W + b) in one pass where an activation follows a Linear.
        pair_bias_activations(self.layers)
        # In a forward, the range whose parameter reads end with each layer: its
        # own, or, for a Linear whose bias the next activation adds, that
        # activation's (the parameter hooks' after() comes once both have run).
        self._reads_end: list[Range | None] = list(self._ranges)
        for j, layer in enumerate(self.layers[:-1]):
            if getattr(layer, "defer_bias", False) and self._ranges[j] is not None:
                self._reads_end[j], self._reads_end[j + 1] = None, self._ranges[j]
        if self.criterion is not None:
            self.criterion.build(self.xp, dt)
        self._grad_views: list[dict[str, Any]] | None = (
            None if self.grads is None else
            self._views_of(lambda name: self.layout.view(self.grads, name)))

        # The first stage stops its backward at its first layer with parameters:
        # nothing needs the gradient of the data. Later stages go down to their
        # first layer and return the gradient of their input.
        with_params = [j for j, r in enumerate(self._ranges) if r is not None]
        self._first_param = with_params[0] if with_params else len(self.layers)

        self._hooks: BackwardHooks | None = None
        self._param_hooks: ParameterHooks | None = None
        self._context: BatchContext | None = None
        self._calls = 0
        self._workspaces: dict[tuple[bool, int], _Workspace] = {}
        self._scratch: list[dict[str, Any]] | None = None
        #: Per layer, its gradients' hand-over by piece (bind_gradient_pieces), or None.
        self._handovers: list[HandOver | None] | None = None
        self._handover_state: HandOverState | None = None

    def _build_whole(self, xp: Any) -> None:
        """Both whole vectors, each layer built on its views and initialised."""
        self.params = self.layout.allocate(self.dtype, xp)
        self.grads = self.layout.allocate(self.dtype, xp)
        self.xp = array_namespace(self.params)
        views = self._views_of(lambda name: self.layout.view(self.params, name))
        for j, layer in enumerate(self.layers):
            i = self.stage_layers[0] + j
            layer.build(i, self.xp, self.dtype, views[j])
            layer.init_params(np.random.default_rng([self.seed, i]))

    def _build_shard(self, xp: Any, shard: Range) -> None:
        """Only ``shard`` of the vector: each layer is built on one scratch the size
        of the largest layer and, where its range overlaps ``shard``, initialised
        there from its own stream and the overlap copied. The same bits as
        ``_build_whole`` at any number of shards: layer ``i`` draws from
        ``default_rng([seed, i])`` and nothing else. No gradient: the strategy
        binds it."""
        store = xp.zeros(len(shard), dtype=self.dtype)
        self.xp = array_namespace(store)
        self.params = self.grads = None
        scratch = self.xp.empty(max(len(r) for r in self._ranges if r is not None),
                                dtype=self.dtype)
        for j, (layer, r) in enumerate(zip(self.layers, self._ranges)):
            i = self.stage_layers[0] + j
            base = r.start if r is not None else 0
            layer.build(i, self.xp, self.dtype, {
                local: self.layout.view(scratch, name, base) for local, name in self._names[j]})
            mine = r.intersect(shard) if r is not None else Range(0, 0)
            if _SKIP_INIT[0] and r is not None:
                continue        # uninitialised_shards(): the values are moved in next
            if r is None or len(mine):
                layer.init_params(np.random.default_rng([self.seed, i]))
            if len(mine):
                store[mine.shift(shard.start).slice()] = scratch[mine.shift(base).slice()]
        # The layers keep views of the scratch until bind_parameters builds them
        # again on a strategy's buffers: the model cannot run before that.
        self._built = (shard, store)

    # -- where this stage sits ------------------------------------------------------

    @property
    def is_first_stage(self) -> bool:
        return self.stage_layers[0] == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_layers[1] == self.num_layers

    def stage_input_shape(self, batch_shape: Sequence[int]) -> tuple[int, ...]:
        """The shape of this stage's input when the model's input has ``batch_shape``."""
        return self._shape_after(tuple(batch_shape), self.stage_layers[0])

    def stage_output_shape(self, batch_shape: Sequence[int]) -> tuple[int, ...]:
        """The shape of this stage's output when the model's input has ``batch_shape``."""
        return self._shape_after(tuple(batch_shape), self.stage_layers[1])

    def tensor_shards(self) -> dict[str, TensorShard]:
        """Which slice of which logical tensor each local tensor is, by name, in layout order."""
        out: dict[str, TensorShard] = {}
        for layer, names in zip(self.layers, self._names):
            local = layer.local_shards()
            for lname, gname in names:
                shard = local.get(lname)
                out[gname] = (TensorShard.full(gname, self.layout[gname].shape) if shard is None
                              else shard.renamed(gname))
        return out

    # -- the Model protocol -----------------------------------------------------------

    def forward(self, x: Any) -> Any:
        """The stage's output for ``x`` without dropout (the logits, for a whole model).

        Returns a new array: the internal buffer is reused by the next call.
        """
        ws = self._workspace(x, train=False, micro=0)
        return self._forward(ws, None, INFERENCE).copy()

    def forward_backward(self, x: Any, y: Any, *, accumulate: bool = False,
                         loss_scale: float = 1.0) -> float:
        """Mean loss over the positions of ``x``; gradients into the gradient views.

        The gradients, of ``loss_scale`` times the mean loss, overwrite what the
        views hold, or are added to it with ``accumulate=True``. (A data-parallel
        strategy passes a rank's row count, so that ranks with unequal batches
        are weighted by their rows: scaling d(loss)/d(output), a buffer of one
        value per output, costs nothing beside the backward.) Uses micro-batch
        slot 0 of the stage API.

        Raises:
            RuntimeError: this is a pipeline stage, not the whole model.
            ValueError, TypeError: ``x`` or ``y`` do not fit the model.
        """
        if not (self.is_first_stage and self.is_last_stage):
            raise RuntimeError(f"forward_backward needs the whole model; this stage holds "
                               f"layers {list(self.stage_layers)} of {self.num_layers}: use "
                               f"forward_stage, loss and backward_stage")
        self.forward_stage(x, 0)
        loss = self._loss(y, 0, loss_scale)
        self.backward_stage(None, 0, accumulate=accumulate)
        return float(loss)  # after the backward is queued: a GPU is not made to wait

    # -- the stage API ------------------------------------------------------------------

    def forward_stage(self, x: Any, micro: int = 0) -> Any:
        """Run the stage on ``x`` in micro-batch slot ``micro``; return its output buffer.

        Raises:
            ValueError, TypeError: ``x`` does not fit the stage's first layer.
        """
        ws = self._workspace(x, train=True, micro=micro)
        ctx = self._take_context(ws.shape[0])
        h = self._forward(ws, ctx, FORWARD)
        ws.out, ws.grad_out, ws.state = h, None, _FORWARD
        return h

    def loss(self, y: Any, micro: int = 0, *, scale: float = 1.0) -> float:
        """Mean loss of slot ``micro``'s output against ``y``. Last stage only.

        The backward that follows starts from the gradient of ``scale`` times
        the mean loss (the value returned is the plain mean).

        Raises:
            RuntimeError: not the last stage, or no ``forward_stage`` in the slot.
            ValueError, TypeError: ``y`` does not fit the output.
        """
        return float(self._loss(y, micro, scale))

    def backward_stage(self, grad_out: Any = None, micro: int = 0, *,
                       accumulate: bool = False) -> Any:
        """Backward through the stage for slot ``micro``; the input gradient or None.

        Raises:
            RuntimeError: the slot has no forward to go back through (or, with
                ``grad_out=None``, no loss).
            ValueError: ``grad_out`` does not have the output's shape.
        """
        ws = self._train_workspace(micro, "backward_stage")
        if grad_out is None:
            if ws.state != _LOSS:
                raise RuntimeError(f"backward_stage(None, {micro}) starts from the loss: call "
                                   f"loss(y, {micro}) first (last stage), or pass grad_out")
            dy = ws.grad_out
        else:
            if ws.state not in (_FORWARD, _LOSS):
                raise RuntimeError(f"micro-batch slot {micro}: backward_stage without a "
                                   f"forward_stage since its last backward")
            grad_out = self.xp.asarray(grad_out)
            if tuple(grad_out.shape) != ws.out_shape:
                raise ValueError(f"expecting grad_out of the output's shape {ws.out_shape}, "
                                 f"got {tuple(grad_out.shape)}")
            if ws.dy is None:
                ws.dy = self.xp.empty(ws.out_shape, dtype=self.dtype)
            ws.dy[...] = grad_out      # layers overwrite their dy: never the caller's
            dy = ws.dy
        ws.state = _DONE
        return self._backward(dy, ws, accumulate)

    def activation_bytes(self) -> int:
        """Bytes held by the training workspaces of every micro-batch slot
        (activations, their gradients, the layers' scratch and the loss's
        buffers): every array they hold, nested ones included (a block's
        sub-layers), each allocation counted once (a view, such as a layer's
        reference to its input, counts the array it is a view of). Local."""
        held: dict[int, Any] = {}
        for (train, _), ws in self._workspaces.items():
            if train:
                _collect_arrays([ws.x, ws.dy, ws.layers, ws.loss], held)
        return sum(int(a.nbytes) for a in held.values())

    # -- the BucketedModel protocol -------------------------------------------------------

    def bind_gradients(self, view: Callable[[str], Any]) -> None:
        """Write the gradient of tensor ``name`` into ``view(name)`` from now on.

        ``view`` is called once per tensor, here; ``grads`` becomes ``None``.

        Raises:
            ValueError: a view has the wrong shape.
            TypeError: a view has the wrong dtype or backend.
        """
        self._grad_views = self._views_of(self._checked(view, "gradient"))
        self._handovers = None
        self.grads = None

    def gradient_pieces(self, max_elements: int) -> list[Range]:
        """The world ranges the backward writes in one go once
        [`bind_gradient_pieces`][mpishard.nn.LayerStack.bind_gradient_pieces]
        bound it with ``max_elements``, in layout order: groups of whole
        tensors, and row blocks of at most ``max_elements`` of the 2-D weights
        ([`mpishard.nn.handover`][mpishard.nn.handover]). Gradient buckets cut
        at these bound the buffers by the bucket size, not the largest layer."""
        out: list[Range] = []
        for layer, names, r in zip(self.layers, self._names, self._ranges):
            if r is not None:
                pieces, _ = plan_layer(layer, names, self.layout, max_elements, None,
                                       _shared(self))
                out += reversed(pieces)
        return out

    def bind_gradient_pieces(self, view: Callable[[Range], Any], max_elements: int) -> None:
        """Write the gradients piece by piece (``gradient_pieces(max_elements)``)
        into ``view(piece)`` (a 1-D array of the piece's length), each piece
        between the backward hooks' ``before(piece)`` and ``after(piece)``,
        pieces in descending offsets. ``view`` is called once per piece, here;
        ``grads`` becomes None (``bind_gradients`` undoes it).

        Raises:
            ValueError: a view of the wrong length.
        """
        shared = _shared(self)

        def checked(r: Range) -> Any:
            v = view(r)
            if tuple(v.shape) != (len(r),) or v.dtype != self.dtype:
                raise ValueError(f"gradient view of {r}: expecting ({len(r)},) {self.dtype}, "
                                 f"got {tuple(v.shape)} {v.dtype}")
            return v

        self._handovers = [
            None if r is None else
            plan_layer(layer, names, self.layout, max_elements, checked, shared)[1]
            for layer, names, r in zip(self.layers, self._names, self._ranges)]
        self._handover_state = shared
        self._grad_views = None
        self.grads = None

    # -- the ShardableModel protocol -------------------------------------------------------

    def bind_parameters(self, view: Callable[[str], Any], params: Any = None) -> None:
        """Read the parameters of tensor ``name`` from ``view(name)`` from now on.

        ``view`` is called once per tensor, here (each layer is built again on
        the new views; nothing is copied); ``params`` becomes ``params``: the
        whole vector the views are of, or ``None`` (the storage is a strategy's).

        Raises:
            ValueError: a view has the wrong shape.
            TypeError: a view has the wrong dtype or backend.
        """
        views = self._views_of(self._checked(view, "parameter"))
        for j, layer in enumerate(self.layers):
            layer.build(self.stage_layers[0] + j, self.xp, self.dtype, views[j])
        self.params = params
        self._built = None

    def built_shard(self) -> tuple[Range, Any] | None:
        """``(r, values)``: built in shards (``shard=``) and not attached yet, this
        rank's shard ``r`` of the whole model's vector; else None
        ([`BuiltInShards`][mpishard.protocols.BuiltInShards])."""
        return self._built

    def set_parameter_hooks(self, hooks: ParameterHooks | None) -> None:
        """Call ``hooks.before(r, phase)`` / ``hooks.after(r, phase)`` around each
        layer's parameter reads (``r``: the world range of the layer's tensors)."""
        self._param_hooks = hooks

    def set_backward_hooks(self, hooks: BackwardHooks | None) -> None:
        """Call ``hooks.before(r)`` / ``hooks.after(r)`` around each layer's gradient
        writes (``r``: the world range of the layer's tensors), layers last to first."""
        self._hooks = hooks

    def set_batch_context(self, step: int, start: int, global_size: int) -> None:
        """The next forward sees rows ``[start, start + len(x))`` of step ``step``'s global batch.

        Applies to one ``forward_backward`` or ``forward_stage``. Without it the
        step is the number of earlier training forwards and the batch is the
        whole global batch.

        Raises:
            ValueError: a negative number, or ``start > global_size``.
        """
        if step < 0 or start < 0 or global_size < 0 or start > global_size:
            raise ValueError(f"expecting 0 <= start <= global_size and step >= 0, got "
                             f"step={step}, start={start}, global_size={global_size}")
        self._context = BatchContext(int(step), int(start), int(global_size))

    # -- internals ------------------------------------------------------------------------

    def _checked(self, view: Callable[[str], Any], what: str) -> Callable[[str], Any]:
        """``view``, checking the shape, dtype and backend of what it returns."""
        def checked(name: str) -> Any:
            v = view(name)
            shape = self.layout[name].shape
            if tuple(v.shape) != shape:
                raise ValueError(f"{what} view of {name!r}: expecting shape {shape}, "
                                 f"got {tuple(v.shape)}")
            if v.dtype != self.dtype or array_namespace(v) is not self.xp:
                raise TypeError(f"{what} view of {name!r}: expecting {self.xp.__name__} "
                                f"{self.dtype}, got {array_namespace(v).__name__} {v.dtype}")
            return v

        return checked

    def _views_of(self, view: Callable[[str], Any]) -> list[dict[str, Any]]:
        return [{local: view(name) for local, name in names} for names in self._names]

    def _shape_after(self, shape: tuple[int, ...], stop: int) -> tuple[int, ...]:
        for layer in self.all_layers[:stop]:
            shape = tuple(layer.output_shape(shape))
        return shape

    def _need_dx(self, j: int) -> bool:
        return j > self._first_param or not self.is_first_stage

    def _workspace(self, x: Any, train: bool, micro: int) -> _Workspace:
        """The slot's workspace for ``x``'s shape, with ``x`` copied into it."""
        if self._built is not None:
            raise RuntimeError(
                f"{type(self).__name__} was built in shards (shard={self._built[0]} of its "
                f"{self.layout.size} parameters): attach it to a ZeRO-3 strategy "
                f"(ZeRO3Optimizer.build does both) before running it")
        xp, first = self.xp, self.layers[0]
        x = xp.asarray(x)
        if first.index_input and x.dtype.kind not in "iu":
            raise TypeError(f"layer {first.index} ({type(first).__name__}) expects integer "
                            f"indices, got dtype {x.dtype}")
        key = (train, int(micro))
        ws = self._workspaces.get(key)
        if ws is None or ws.shape != tuple(x.shape):
            # Another shape (a recovery re-split the batch): the old one goes first.
            self._workspaces.pop(key, None)
            ws = None
            ws = self._workspaces[key] = self._make_workspace(tuple(x.shape), train)
        ws.x[...] = x
        return ws

    def _make_workspace(self, shape: tuple[int, ...], train: bool) -> _Workspace:
        """A slot's buffers for input ``shape``. Training keeps every layer's (the
        backward reads them); inference shares them between layers whose buffers
        are alike (each transformer block, say), two sets of each kind used in
        turn, so the memory is that of two layers of a kind, not of all: a
        layer's input is the output of the layer before, so the set the last
        layer of its kind wrote is the one it must not write."""
        xp = self.xp
        dtype = np.int64 if self.layers[0].index_input else self.dtype
        x = xp.empty(shape, dtype=dtype)
        buffers = []
        alike: dict[Any, tuple[list[dict[str, Any]], list[int]]] = {}
        for j, layer in enumerate(self.layers):
            out_shape = tuple(layer.output_shape(shape))     # raises on a misfit
            buf = layer.allocate_shape(shape, train, self._need_dx(j))
            if not train:
                buf = _ping_pong(alike, (type(layer), _kind(buf)), buf)
            buffers.append(buf)
            shape = out_shape
        loss = None
        if train and self.criterion is not None:
            loss = self.criterion.allocate(math.prod(shape[:-1]), shape[-1])
        return _Workspace(tuple(x.shape), x, buffers, shape, loss)

    def _train_workspace(self, micro: int, what: str) -> _Workspace:
        ws = self._workspaces.get((True, int(micro)))
        if ws is None or ws.state == _DONE:
            raise RuntimeError(f"{what}: micro-batch slot {micro} has no forward_stage to "
                               f"follow (none yet, or its backward is done)")
        return ws

    def _loss(self, y: Any, micro: int, scale: float = 1.0) -> Any:
        if self.criterion is None:
            raise RuntimeError(f"loss() is computed on the last stage; this stage holds "
                               f"layers {list(self.stage_layers)} of {self.num_layers}")
        ws = self._train_workspace(micro, "loss")
        lead = ws.out_shape[:-1]
        y = self.xp.asarray(y)
        if tuple(y.shape[:len(lead)]) != lead:
            raise ValueError(f"expecting targets whose leading shape is the output's "
                             f"{lead}, got shape {tuple(y.shape)}")
        rows, features = math.prod(lead), ws.out_shape[-1]
        y = y.reshape((rows,) + tuple(y.shape[len(lead):]))
        target = self.criterion.check_target(y, rows, features)
        value, grad = self.criterion.loss_and_grad(ws.out.reshape(rows, features), target,
                                                   ws.loss)
        if scale != 1.0:
            grad *= scale          # d(loss)/d(output): one value per output, in place
        ws.grad_out, ws.state = grad.reshape(ws.out_shape), _LOSS
        return value

    def _take_context(self, rows: int) -> BatchContext:
        ctx, self._context = self._context, None
        if ctx is None:
            ctx = BatchContext(self._calls, 0, rows)
        elif ctx.start + rows > ctx.global_size:
            raise ValueError(f"batch context: rows [{ctx.start}, {ctx.start + rows}) do not "
                             f"fit a global batch of {ctx.global_size}")
        self._calls += 1
        return ctx

    def _accumulation_scratch(self) -> list[dict[str, Any]]:
        # One buffer as large as the largest tensor serves every tensor: each is
        # computed there and added to its gradient before the next one is.
        if self._scratch is None:
            flat = self.xp.empty(max((s.size for s in self.layout), default=0), dtype=self.dtype)
            self._scratch = self._views_of(
                lambda name: flat[:self.layout[name].size].reshape(self.layout[name].shape))
        return self._scratch

    def _forward(self, ws: _Workspace, ctx: BatchContext | None, phase: str) -> Any:
        """Layers first to last, each layer's parameter reads between the hooks."""
        hooks = self._param_hooks
        h = ws.x
        for layer, buf, r, end in zip(self.layers, ws.layers, self._ranges, self._reads_end):
            if hooks is not None and r is not None:
                hooks.before(r, phase)
            h = layer.forward(h, buf, ctx)
            if hooks is not None and end is not None:
                hooks.after(end, phase)
        return h

    def _backward(self, dy: Any, ws: _Workspace, accumulate: bool) -> Any:
        """Layers last to first: parameter gradients between the hooks, then dx
        (the parameter hooks around both: each may read the parameters)."""
        hooks, reads, hands = self._hooks, self._param_hooks, self._handovers
        if hands is not None:
            self._handover_state.hooks = hooks
            self._handover_state.accumulate = accumulate
        scratch = self._accumulation_scratch() if accumulate and hands is None else None
        stop = self._first_param if self.is_first_stage else 0
        for j in range(len(self.layers) - 1, stop - 1, -1):
            layer, buf, r = self.layers[j], ws.layers[j], self._ranges[j]
            if reads is not None and r is not None:
                reads.before(r, BACKWARD)
            if r is not None and hands is not None:
                hands[j].backward(layer, dy, buf)
            elif r is not None:
                if hooks is not None:
                    hooks.before(r)
                layer.backward_params(dy, buf, self._grad_views[j],
                                      None if scratch is None else scratch[j])
                if hooks is not None:
                    hooks.after(r)
            if self._need_dx(j):
                dy = layer.backward_input(dy, buf)
            if reads is not None and r is not None:
                reads.after(r, BACKWARD)
        return None if self.is_first_stage else dy

    def __repr__(self) -> str:
        inner = ", ".join(repr(layer) for layer in self.layers)
        return (f"{type(self).__name__}([{inner}], stage_layers={self.stage_layers}, "
                f"loss={self.criterion!r}, dtype={self.dtype.name}, params={self.layout.size})")
