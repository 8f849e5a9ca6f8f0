"""The single-process model API of the library's models: describe, train, predict, copy.

Nothing here reads or writes a file: saving, loading and bytes are
[`mpishard.models`][mpishard.models], the model-files layer above ``nn`` and
[`mpishard.checkpoint`][mpishard.checkpoint], which gets what it stores through
[`DescribedModel`][mpishard.protocols.DescribedModel]
([`Described.architecture`][mpishard.nn.Described.architecture] and
[`Described.training_metadata`][mpishard.nn.Described.training_metadata]).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..backend import array_namespace
from ..flat import ParamLayout
from ..optim import SGD
from ..protocols import BucketedModel

__all__ = [
    "ARCHITECTURE_VERSION",
    "Described",
    "ModelMethods",
    "TrainingHistory",
]

#: Version of the record `Described.architecture` returns. Version 1 (before
#: layers described themselves) listed ``{"type", "args"}`` layers of a Sequential;
#: `mpishard.models.build_architecture` still reads it.
ARCHITECTURE_VERSION = 2

_HISTORY = "_training_history"


@dataclass
class TrainingHistory:
    """What [`ModelMethods.train`][mpishard.nn.ModelMethods.train] keeps on a model between
    calls."""

    optimizer: Any = None
    state: dict[str, Any] = field(default_factory=dict)
    optimizer_steps: int = 0           # updates by the current optimizer (its 1-based step)
    steps: int = 0                     # train() steps in all, across optimizers
    losses: list[float] = field(default_factory=list)


class Described:
    """A model that describes itself for model files and checkpoints.

    Meets [`DescribedModel`][mpishard.protocols.DescribedModel]. A subclass overrides
    [`config`][mpishard.nn.Described.config]; the rest follows from it.
    """

    def config(self) -> dict[str, Any] | None:
        """The model as JSON (``{"class", "args"}``), or None when it cannot be
        rebuilt from data (it holds code, or a layer that does not describe itself)."""
        return None

    def architecture(self) -> dict[str, Any] | None:
        """The record a file stores: [`config`][mpishard.nn.Described.config] with ``"version"``, or
        None."""
        config = self.config()
        return None if config is None else {"version": ARCHITECTURE_VERSION, **config}

    def training_metadata(self) -> dict[str, Any] | None:
        """``{"steps", "losses"}`` of [`ModelMethods.train`][mpishard.nn.ModelMethods.train], or
        None if it never ran."""
        history = self.__dict__.get(_HISTORY)
        if history is None:
            return None
        return {"steps": history.steps, "losses": [float(v) for v in history.losses]}

    def restore_training_metadata(self, steps: int, losses: list[float]) -> None:
        """Set the step count and loss history (as read from a file); the optimizer
        and its state are not part of a model file and start afresh."""
        history = self._history()
        history.steps = int(steps)
        history.losses = [float(v) for v in losses]

    def _history(self) -> TrainingHistory:
        history = self.__dict__.get(_HISTORY)
        if history is None:
            history = self.__dict__[_HISTORY] = TrainingHistory()
        return history


class ModelMethods(Described):
    """``train``, ``predict``, ``get_model_metadata``, ``clone`` and ``with_parameters``.

    A mixin for a [`Model`][mpishard.protocols.Model] (``params``, ``grads``,
    ``layout``, ``forward``, ``forward_backward``) in one process.
    """

    params: Any
    grads: Any
    layout: ParamLayout

    def train(self, x: Any, y: Any, optimizer: Any = None) -> float:
        """One plain optimizer step on the batch ``(x, y)`` in this process; the loss.

        ``optimizer`` (a [`mpishard.optim`][mpishard.optim] optimizer) is kept on the model and
        used by later calls that pass none; the first call without one uses
        ``SGD(lr=0.01)``. A new optimizer starts with fresh state. The loss goes
        into the history of [`get_model_metadata`][mpishard.nn.ModelMethods.get_model_metadata].

        Raises:
            RuntimeError: the model's gradients belong to a strategy (``grads`` is None).
        """
        if self.grads is None:
            raise RuntimeError("the model's gradients are bound to a training strategy: "
                               "train with the strategy's train_step()")
        history = self._history()
        if optimizer is None:
            optimizer = history.optimizer if history.optimizer is not None else SGD(lr=0.01)
        if optimizer is not history.optimizer:
            history.optimizer = optimizer
            history.state = optimizer.init_state(self.params.size, self.params.dtype,
                                                 array_namespace(self.params))
            history.optimizer_steps = 0
        if isinstance(self, BucketedModel):
            self.set_batch_context(history.steps, 0, len(x))
        loss = float(self.forward_backward(x, y))
        history.optimizer_steps += 1
        history.steps += 1
        optimizer.update(self.params, self.grads, history.state, history.optimizer_steps,
                         optimizer.lr)
        history.losses.append(loss)
        return loss

    def predict(self, x: Any) -> Any:
        """The model's output for ``x`` (``forward``; dropout off)."""
        return self.forward(x)   # type: ignore[attr-defined]

    def get_model_metadata(self) -> dict[str, Any]:
        """Tensor shapes, parameter count, dtype, architecture, training history, metrics."""
        dtype = np.dtype(self.params.dtype)
        history = self.training_metadata() or {"steps": 0, "losses": []}
        losses = history["losses"]
        return {
            "class": type(self).__name__,
            "dtype": dtype.name,
            "parameter_count": int(self.layout.size),
            "parameter_bytes": int(self.layout.size * dtype.itemsize),
            "tensors": self.layout.describe(),
            "architecture": self.architecture(),
            "history": history,
            "metrics": {"steps": history["steps"],
                        "last_loss": losses[-1] if losses else None,
                        "min_loss": min(losses) if losses else None},
        }

    def clone(self) -> Any:
        """An independent copy: same class, parameters and history."""
        xp = array_namespace(self.params)
        new = copy.copy(self)
        new.params = self.params.copy()
        new.grads = xp.zeros_like(new.params)
        if _HISTORY in self.__dict__:
            new.__dict__[_HISTORY] = copy.deepcopy(self.__dict__[_HISTORY], _modules(xp))
        return new

    def with_parameters(self, vector: Any) -> Any:
        """A copy of this model (as [`clone`][mpishard.nn.ModelMethods.clone]) whose parameters are
        ``vector``.

        Raises:
            ValueError: ``vector`` is not 1-D of the model's parameter count.
        """
        shape = tuple(getattr(vector, "shape", np.shape(vector)))
        if shape != (self.layout.size,):
            raise ValueError(f"expecting a parameter vector of shape ({self.layout.size},), "
                             f"got {shape}")
        new = self.clone()
        xp = array_namespace(new.params)
        new.params[...] = xp.asarray(vector, dtype=new.params.dtype)
        return new


def _modules(xp: Any) -> dict[int, Any]:
    """A ``copy.deepcopy`` memo that keeps the array modules: modules cannot be copied."""
    return {id(np): np, id(xp): xp}


def layer_metadata(layers: list[Any]) -> list[dict[str, Any]]:
    """Per layer: index, type, repr, tensor shapes and parameter count."""
    out = []
    for i, layer in enumerate(layers):
        shapes = {f"{i}.{local}": list(shape) for local, shape in layer.param_shapes()}
        out.append({"index": i, "type": type(layer).__name__, "repr": repr(layer),
                    "parameters": shapes,
                    "parameter_count": sum(math.prod(s) for s in shapes.values())})
    return out
