"""The layer interface of [`Sequential`][mpishard.nn.Sequential] and the batch context."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from .shards import TensorShard

__all__ = [
    "BatchContext",
    "Layer",
]


@dataclass(frozen=True)
class BatchContext:
    """Where the rows of one ``forward_backward`` sit in the global batch.

    The rows are rows ``[start, start + rows)`` of the global batch of optimizer
    step ``step``, which has ``global_size`` rows. Layers that draw random numbers
    draw them for the whole global batch and use their rows, so that any
    data-parallel split of the batch sees the same numbers.
    """

    step: int
    start: int
    global_size: int


class Layer:
    """One step of a [`Sequential`][mpishard.nn.Sequential]: a map from rows to rows.

    A layer owns no parameter or batch memory of its own:

    * its parameters are views of the model's flat vector, handed to
      [`build`][mpishard.nn.Layer.build] by name (``"weight"``, ``"bias"``);
    * its activations and scratch live in a dict of buffers made by
      [`allocate`][mpishard.nn.Layer.allocate] once per batch shape and passed back to
      [`forward`][mpishard.nn.Layer.forward] and the backward methods, so the step loop allocates
      nothing;
    * its gradients are written into views chosen by the model (the flat
      gradient vector, or whatever a strategy bound with ``bind_gradients``).

    Backward is split in two so a model can tell a strategy the moment a layer's
    gradients are final: [`backward_params`][mpishard.nn.Layer.backward_params] writes
    d(loss)/d(params), then [`backward_input`][mpishard.nn.Layer.backward_input] returns
    d(loss)/d(input). Both may overwrite ``dy``: it is scratch of the model that nothing reads
    afterwards.

    Inputs are 2-D, ``(rows, features)``; a layer of other shapes (the
    sequence layers of [`GPT`][mpishard.nn.GPT]) overrides
    [`output_shape`][mpishard.nn.Layer.output_shape] and
    [`allocate_shape`][mpishard.nn.Layer.allocate_shape] and runs in a
    [`LayerStack`][mpishard.nn.LayerStack].
    """

    index: int = 0
    xp: Any = np
    dtype: np.dtype = np.dtype(np.float64)
    params: dict[str, Any]

    def param_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """The layer's tensors by local name, in the order they are laid out."""
        return []

    def build(self, index: int, xp: Any, dtype: Any, params: dict[str, Any]) -> None:
        """Attach the layer to a model: its position, backend, dtype, parameter views."""
        self.index = index
        self.xp = xp
        self.dtype = np.dtype(dtype)
        self.params = params

    def init_params(self, rng: np.random.Generator) -> None:
        """Fill the parameter views from ``rng`` (a host generator)."""

    def output_features(self, in_features: int) -> int:
        """Width of the output for an input of width ``in_features``."""
        return in_features

    def allocate(self, rows: int, in_features: int, train: bool,
                 need_dx: bool) -> dict[str, Any]:
        """Buffers for batches of ``rows`` rows; backward ones only when ``train``.

        ``need_dx`` is False when no one will ask for d(loss)/d(input) (the
        first layer with parameters and those before it).
        """
        return {}

    def forward(self, x: Any, buf: dict[str, Any], ctx: BatchContext | None) -> Any:
        """The output for ``x``; ``ctx`` is None for inference (no dropout)."""
        raise NotImplementedError

    def backward_params(self, dy: Any, buf: dict[str, Any], grads: dict[str, Any],
                        scratch: dict[str, Any] | None) -> None:
        """Write d(loss)/d(params) into ``grads``.

        With ``scratch`` (views of the same shapes) the gradient is computed
        there and added to ``grads`` instead: that is gradient accumulation.
        """

    def backward_input(self, dy: Any, buf: dict[str, Any]) -> Any:
        """d(loss)/d(input) from d(loss)/d(output) ``dy`` (which may be overwritten)."""
        raise NotImplementedError

    # -- shapes other than (rows, features), and tensor shards ------------------
    #
    # Used by `LayerStack` (GPT, pipeline
    # stages, tensor parallelism); `Sequential` does not
    # call them. The defaults describe a layer of rows that holds its tensors
    # in full.

    #: The layer reads integer indices (token ids), not floating-point features.
    index_input: bool = False

    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        """Shape of the output for an input of shape ``in_shape``.

        The default is ``(rows, output_features(features))`` for 2-D inputs;
        sequence layers (``(batch, tokens, features)``) override it.
        """
        rows, features = _rows_features(self, in_shape)
        return (rows, self.output_features(features))

    def allocate_shape(self, in_shape: tuple[int, ...], train: bool,
                       need_dx: bool) -> dict[str, Any]:
        """[`allocate`][mpishard.nn.Layer.allocate] for an input of shape ``in_shape`` (2-D by
        default)."""
        rows, features = _rows_features(self, in_shape)
        return self.allocate(rows, features, train, need_dx)

    def local_shards(self) -> dict[str, TensorShard]:
        """The tensors this rank holds only a slice of, by local name.

        Tensors not listed are held in full, identical on every rank of the
        tensor-parallel group (see `mpishard.nn.shards`).
        """
        return {}

    def config(self) -> dict[str, Any] | None:
        """The layer as JSON: ``{"class": name, "args": constructor arguments}``.

        [`layer_from_config`][mpishard.nn.layer_from_config] builds an equal, unbuilt layer from
        it; a model file stores it, never code. This default describes a class
        that takes no constructor arguments (an activation). A layer with
        arguments overrides it; one that does not (a user's layer) returns None:
        it cannot be rebuilt from a file, only loaded into.
        """
        return no_argument_config(self, Layer)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def no_argument_config(obj: Any, base: type) -> dict[str, Any] | None:
    """``{"class": ..., "args": {}}`` when ``obj``'s class has ``base``'s constructor
    (so it takes no arguments), else None."""
    if type(obj).__init__ is not base.__init__:
        return None
    return {"class": type(obj).__name__, "args": {}}


def _rows_features(layer: Layer, shape: tuple[int, ...]) -> tuple[int, int]:
    if len(shape) != 2:
        raise ValueError(f"layer {layer.index} ({type(layer).__name__}) expects 2-D input "
                         f"(rows, features), got shape {tuple(shape)}")
    return int(shape[0]), int(shape[1])


def store_gradient(grad: Any, scratch: dict[str, Any] | None, name: str) -> Any:
    """Where a layer should compute gradient ``name``: ``grad`` or its scratch."""
    return grad if scratch is None else scratch[name]


def finish_gradient(xp: Any, grad: Any, out: Any) -> None:
    """Add ``out`` to ``grad`` when it was computed in scratch (accumulation)."""
    if out is not grad:
        xp.add(grad, out, out=grad)
