"""A stack of layers over one flat parameter vector: the library's :class:`~mpishard.protocols.BucketedModel`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from ..backend import array_namespace
from ..flat import ParamLayout, Range
from ..protocols import BackwardHooks
from .base import BatchContext, Layer
from .losses import Loss

__all__ = [
    "Sequential",
]


@dataclass
class _Workspace:
    """Every buffer of one mode (training or inference) for one batch shape."""

    shape: tuple[int, int]
    layers: list[dict[str, Any]]
    loss: dict[str, Any] | None
    out_features: int
    x: Any = None           # the input cast to the model's dtype, made when needed


class Sequential:
    """Layers applied in order, then a loss; parameters in one flat vector.

    The layout names tensors ``"<index>.<name>"`` by the layer's position in
    ``layers`` (``"0.weight"``, ``"0.bias"``, ``"2.weight"``), in forward order.
    ``params`` and ``grads`` are two flat vectors of ``layout.size`` elements;
    every layer reads its parameters as views of ``params`` and writes its
    gradients into views of ``grads`` (or of what :meth:`bind_gradients` gave).

    Parameters are initialised deterministically: layer ``i`` draws from
    ``numpy.random.default_rng([seed, i])`` on the host, so the same ``seed``
    gives the same model on every rank and backend.

    Activations and scratch are allocated on the first call with a batch shape
    and reused until the shape changes (training and inference keep separate
    sets, so evaluating between steps does not re-make the training buffers).
    Inputs are ``(rows, features)`` arrays of the model's backend; another
    dtype is cast into a buffer. With CuPy, pass device arrays: a host array is
    copied to the device on every call.

    Implements :class:`~mpishard.protocols.BucketedModel`.

    Raises:
        TypeError: ``dtype`` is not float32 or float64.
        ValueError: ``layers`` is empty.
    """

    def __init__(self, layers: Sequence[Layer], loss: Loss, dtype: Any = np.float64,
                 xp: Any = np, seed: int = 0) -> None:
        dt = np.dtype(dtype)
        if dt not in (np.dtype(np.float32), np.dtype(np.float64)):
            raise TypeError(f"expecting dtype float32 or float64, got {dt}")
        if not layers:
            raise ValueError("expecting at least one layer, got none")
        self.layers = list(layers)
        self.loss = loss
        self.dtype = dt
        self.seed = int(seed)

        self.layout = ParamLayout()
        self._names: list[list[tuple[str, str]]] = []    # per layer: (local, global)
        for i, layer in enumerate(self.layers):
            names = []
            for local, shape in layer.param_shapes():
                self.layout.add(f"{i}.{local}", shape)
                names.append((local, f"{i}.{local}"))
            self._names.append(names)
        self.params = self.layout.allocate(dt, xp)
        self.grads = self.layout.allocate(dt, xp)
        self.xp = array_namespace(self.params)

        # The world range of each layer's tensors (None without parameters):
        # what a strategy is told before and after the layer writes gradients.
        self._ranges: list[Range | None] = []
        for i, layer in enumerate(self.layers):
            views = {local: self.layout.view(self.params, name) for local, name in self._names[i]}
            layer.build(i, self.xp, dt, views)
            layer.init_params(np.random.default_rng([self.seed, i]))
            specs = [self.layout[name] for _, name in self._names[i]]
            self._ranges.append(Range(specs[0].offset, specs[-1].range.stop) if specs else None)
        self.loss.build(self.xp, dt)
        self._grad_views = self._views_of(lambda name: self.layout.view(self.grads, name))

        # Backward stops at the first layer with parameters: nothing needs the
        # gradient with respect to the input of the model.
        with_params = [i for i, r in enumerate(self._ranges) if r is not None]
        self._first_param = with_params[0] if with_params else len(self.layers)

        self._hooks: BackwardHooks | None = None
        self._context: BatchContext | None = None
        self._calls = 0
        self._workspaces: dict[bool, _Workspace] = {}
        self._scratch: list[dict[str, Any]] | None = None

    # -- the Model protocol ---------------------------------------------------

    def forward(self, x: Any) -> Any:
        """The last layer's output for ``x`` (logits, no loss); dropout is off.

        Returns a new array: the internal buffer is reused by the next call.
        """
        x, ws = self._input(x, train=False)
        for layer, buf in zip(self.layers, ws.layers):
            x = layer.forward(x, buf, None)
        return x.copy()

    def forward_backward(self, x: Any, y: Any, *, accumulate: bool = False) -> float:
        """Mean loss over the rows of ``x``; gradients written into the gradient views.

        The gradients overwrite what the views hold, or are added to it with
        ``accumulate=True``. Dropout uses the context of
        :meth:`set_batch_context` if one was set since the last call.

        Raises:
            ValueError: ``x`` is not 2-D, or does not fit the layers, or ``y``
                does not fit the output, or the batch context is too small.
            TypeError: ``y`` has the wrong kind of dtype for the loss.
        """
        x, ws = self._input(x, train=True)
        rows = x.shape[0]
        target = self.loss.check_target(self.xp.asarray(y), rows, ws.out_features)
        ctx = self._take_context(rows)
        for layer, buf in zip(self.layers, ws.layers):
            x = layer.forward(x, buf, ctx)
        loss, dy = self.loss.loss_and_grad(x, target, ws.loss)
        self._backward(dy, ws, accumulate)
        return float(loss)  # after the backward is queued: a GPU is not made to wait

    # -- the BucketedModel protocol -------------------------------------------

    def bind_gradients(self, view: Callable[[str], Any]) -> None:
        """Write the gradient of tensor ``name`` into ``view(name)`` from now on.

        ``view`` is called once per tensor, here; ``grads`` becomes ``None``.

        Raises:
            ValueError: a view has the wrong shape.
            TypeError: a view has the wrong dtype or backend.
        """
        def checked(name: str) -> Any:
            v = view(name)
            shape = self.layout[name].shape
            if tuple(v.shape) != shape:
                raise ValueError(f"gradient view of {name!r}: expecting shape {shape}, "
                                 f"got {tuple(v.shape)}")
            if v.dtype != self.dtype or array_namespace(v) is not self.xp:
                raise TypeError(f"gradient view of {name!r}: expecting {self.xp.__name__} "
                                f"{self.dtype}, got {array_namespace(v).__name__} {v.dtype}")
            return v

        self._grad_views = self._views_of(checked)
        self.grads = None

    def set_backward_hooks(self, hooks: BackwardHooks | None) -> None:
        """Call ``hooks.before(r)`` / ``hooks.after(r.start)`` around each layer's gradient writes."""
        self._hooks = hooks

    def set_batch_context(self, step: int, start: int, global_size: int) -> None:
        """The next ``forward_backward`` sees rows ``[start, start + len(x))`` of step ``step``.

        Applies to one call. Without it, the step is the number of earlier
        ``forward_backward`` calls and the batch is the whole global batch.

        Raises:
            ValueError: a negative number, or ``start > global_size``.
        """
        if step < 0 or start < 0 or global_size < 0 or start > global_size:
            raise ValueError(f"expecting 0 <= start <= global_size and step >= 0, got "
                             f"step={step}, start={start}, global_size={global_size}")
        self._context = BatchContext(int(step), int(start), int(global_size))

    # -- internals --------------------------------------------------------------

    def _views_of(self, view: Callable[[str], Any]) -> list[dict[str, Any]]:
        return [{local: view(name) for local, name in names} for names in self._names]

    def _input(self, x: Any, train: bool) -> tuple[Any, _Workspace]:
        """``x`` on the model's backend and dtype, and the workspace for its shape."""
        x = self.xp.asarray(x)
        if x.ndim != 2:
            raise ValueError(f"expecting a 2-D batch (rows, features), got shape {x.shape}")
        ws = self._workspaces.get(train)
        if ws is None or ws.shape != x.shape:
            ws = self._workspaces[train] = self._make_workspace(x.shape, train)
        if x.dtype != self.dtype:
            if ws.x is None:
                ws.x = self.xp.empty(x.shape, dtype=self.dtype)
            ws.x[...] = x
            x = ws.x
        return x, ws

    def _make_workspace(self, shape: tuple[int, int], train: bool) -> _Workspace:
        rows, features = shape
        buffers = []
        for i, layer in enumerate(self.layers):
            out_features = layer.output_features(features)   # raises on a misfit
            buffers.append(layer.allocate(rows, features, train, i > self._first_param))
            features = out_features
        loss = self.loss.allocate(rows, features) if train else None
        return _Workspace(tuple(shape), buffers, loss, features)

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

    def _backward(self, dy: Any, ws: _Workspace, accumulate: bool) -> None:
        """Layers last to first: parameter gradients between the hooks, then dx."""
        hooks = self._hooks
        scratch = self._accumulation_scratch() if accumulate else None
        for i in range(len(self.layers) - 1, self._first_param - 1, -1):
            layer, buf, r = self.layers[i], ws.layers[i], self._ranges[i]
            if r is not None:
                if hooks is not None:
                    hooks.before(r)
                layer.backward_params(dy, buf, self._grad_views[i],
                                      None if scratch is None else scratch[i])
                if hooks is not None:
                    hooks.after(r.start)
            if i > self._first_param:
                dy = layer.backward_input(dy, buf)

    # -- the model API: thin methods over mpishard.checkpoint.model_api ---------
    # (imported inside each method: the checkpoint layer sits above nn)

    def predict(self, x: Any) -> Any:
        """The output for ``x``, as :meth:`forward` (dropout off)."""
        from ..checkpoint.model_api import predict

        return predict(self, x)

    def train(self, x: Any, y: Any, optimizer: Any = None) -> float:
        """One optimizer step on ``(x, y)`` in this process; returns the loss.

        The optimizer (``SGD(lr=0.01)`` on the first call without one) and its
        state stay on the model for later calls; the loss goes into the history.
        See :func:`mpishard.checkpoint.model_api.train_step`.
        """
        from ..checkpoint.model_api import train_step

        return train_step(self, x, y, optimizer)

    def get_model_metadata(self) -> dict[str, Any]:
        """Layers, tensor shapes, parameter count, dtype, training history, metrics."""
        from ..checkpoint.model_api import model_metadata

        return model_metadata(self)

    def serialize(self) -> bytes:
        """The model file (parameters, architecture, history) as bytes: HDF5, never pickle."""
        from ..checkpoint.model_api import serialize_model

        return serialize_model(self)

    def deserialize(self, data: bytes) -> Sequential:
        """Load parameters and history from :meth:`serialize` bytes into this model.

        Raises:
            CheckpointError: damaged bytes, or another architecture.
        """
        from ..checkpoint.model_api import deserialize_model

        return deserialize_model(self, data)

    def save_model(self, path: Any) -> str:
        """Write the model file at ``path`` (atomically); returns the path."""
        from ..checkpoint.model_api import save_model

        return save_model(self, path)

    def load_model(self, path: Any) -> Sequential:
        """Load the parameters of a model file or checkpoint into this model.

        Raises:
            FileNotFoundError: no file at ``path``.
            CheckpointError: not a valid model file, or another architecture.
        """
        from ..checkpoint.model_api import load_model_into

        return load_model_into(self, path)

    @classmethod
    def from_file(cls, path: Any, xp: Any = np) -> Sequential:
        """A new model rebuilt from the architecture a model file records."""
        from ..checkpoint.model_api import load_model

        return load_model(path, xp=xp)

    @classmethod
    def from_bytes(cls, data: bytes, xp: Any = np) -> Sequential:
        """A new model rebuilt from :meth:`serialize` bytes."""
        from ..checkpoint.model_api import model_from_bytes

        return model_from_bytes(data, xp=xp)

    def with_parameters(self, vector: Any) -> Sequential:
        """A copy of this model whose parameters are ``vector``."""
        from ..checkpoint.model_api import with_parameters

        return with_parameters(self, vector)

    def clone(self) -> Sequential:
        """An independent copy: same class, layers, parameters and history."""
        from ..checkpoint.model_api import clone_model

        return clone_model(self)

    def __repr__(self) -> str:
        inner = ", ".join(repr(layer) for layer in self.layers)
        return (f"{type(self).__name__}([{inner}], loss={self.loss!r}, "
                f"dtype={self.dtype.name}, params={self.layout.size})")
