"""The single-process model API behind the methods of ``Sequential`` and ``FunctionModel``.

``serialize()`` / ``deserialize()``, ``save_model()`` / ``load_model()``,
``predict()``, ``train()``, ``get_model_metadata()``, ``with_parameters()`` and
``clone()`` are thin methods on the models that call the functions here, so the
models do not import the checkpoint layer. A model file is a checkpoint of
kind ``"model"`` (format version 1, sealed, checksummed): the parameters, the
architecture of a :class:`~mpishard.nn.Sequential` of library layers, and the
history of :func:`train_step`. Bytes from :func:`serialize_model` are the same
file, held in memory. Never pickle.

``train()`` keeps its optimizer and state on the model between calls; a model
file does not store them (it is a model, not a training run: use
:func:`~mpishard.checkpoint.save_checkpoint` with a strategy for that).
"""

from __future__ import annotations

import copy
import io
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..backend import array_namespace, is_device_array, to_numpy
from ..errors import CheckpointError
from ..flat import ParamLayout, Range
from .architecture import build_architecture, describe_architecture
from .container import verify_image
from .format import MODEL, PARAMS, CheckpointInfo, read_info
from .read import open_checkpoint, read_blocks
from .strategy import (
    Placement,
    declared,
    global_problem,
    local_problem,
    model_attrs,
    root_attrs,
    vector_pieces,
    vector_requests,
)
from .write import write_checkpoint_file, write_image

__all__ = [
    "clone_model",
    "deserialize_model",
    "describe_architecture",
    "load_model",
    "load_model_into",
    "model_from_bytes",
    "model_metadata",
    "predict",
    "save_model",
    "serialize_model",
    "train_step",
    "training_metadata",
    "with_parameters",
]

_RECORD = "_mpishard_training"
_BYTES = "<serialized model>"


@dataclass
class TrainingRecord:
    """What :func:`train_step` keeps on a model."""

    optimizer: Any = None
    state: dict[str, Any] = field(default_factory=dict)
    optimizer_steps: int = 0           # updates by the current optimizer (its 1-based step)
    steps: int = 0                     # train() steps in all, across optimizers
    losses: list[float] = field(default_factory=list)


def _record(model: Any, create: bool = True) -> TrainingRecord | None:
    rec = model.__dict__.get(_RECORD)
    if rec is None and create:
        rec = TrainingRecord()
        setattr(model, _RECORD, rec)
    return rec


def training_metadata(model: Any) -> dict[str, Any] | None:
    """``{"steps", "losses"}`` of :func:`train_step`, or None if it never ran."""
    rec = _record(model, create=False)
    if rec is None:
        return None
    return {"steps": rec.steps, "losses": [float(v) for v in rec.losses]}


# --- prediction and training ------------------------------------------------

def predict(model: Any, x: Any) -> Any:
    """The model's output for ``x`` (``forward``; dropout off)."""
    return model.forward(x)


def train_step(model: Any, x: Any, y: Any, optimizer: Any = None) -> float:
    """One plain optimizer step on the batch ``(x, y)`` in this process; the loss.

    ``optimizer`` (a :mod:`mpishard.optim` optimizer) is kept on the model and
    used by later calls that pass none; the first call without one uses
    ``SGD(lr=0.01)``. A new optimizer starts with fresh state. The loss is
    appended to the history of :func:`model_metadata`.

    Raises:
        RuntimeError: the model's gradients belong to a strategy (``grads`` is None).
    """
    from ..optim import SGD

    if model.grads is None:
        raise RuntimeError("the model's gradients are bound to a training strategy: "
                           "train with the strategy's train_step()")
    rec = _record(model)
    if optimizer is None:
        optimizer = rec.optimizer if rec.optimizer is not None else SGD(lr=0.01)
    if optimizer is not rec.optimizer:
        rec.optimizer = optimizer
        rec.state = optimizer.init_state(model.params.size, model.params.dtype,
                                         array_namespace(model.params))
        rec.optimizer_steps = 0
    if hasattr(model, "set_batch_context"):
        model.set_batch_context(rec.steps, 0, len(x))
    loss = float(model.forward_backward(x, y))
    rec.optimizer_steps += 1
    rec.steps += 1
    optimizer.update(model.params, model.grads, rec.state, rec.optimizer_steps, optimizer.lr)
    rec.losses.append(loss)
    return loss


def model_metadata(model: Any) -> dict[str, Any]:
    """Layers and tensor shapes, parameter count, dtype, training history and metrics."""
    layout: ParamLayout = model.layout
    arch = describe_architecture(model)
    info: dict[str, Any] = {
        "class": type(model).__name__,
        "dtype": np.dtype(model.params.dtype).name,
        "parameter_count": int(layout.size),
        "parameter_bytes": int(layout.size * np.dtype(model.params.dtype).itemsize),
        "tensors": layout.describe(),
        "architecture": arch,
    }
    if hasattr(model, "layers"):
        layers = []
        for i, layer in enumerate(model.layers):
            shapes = {f"{i}.{local}": list(shape) for local, shape in layer.param_shapes()}
            layers.append({"index": i, "type": type(layer).__name__, "repr": repr(layer),
                           "parameters": shapes,
                           "parameter_count": sum(math.prod(s) for s in shapes.values())})
        info["layers"] = layers
    history = training_metadata(model) or {"steps": 0, "losses": []}
    losses = history["losses"]
    info["history"] = history
    info["metrics"] = {"steps": history["steps"],
                       "last_loss": losses[-1] if losses else None,
                       "min_loss": min(losses) if losses else None}
    return info


# --- copies -------------------------------------------------------------------

def clone_model(model: Any) -> Any:
    """An independent copy: same class, architecture, parameters and history."""
    from ..nn import Sequential

    xp = array_namespace(model.params)
    memo = {id(np): np, id(xp): xp}   # modules cannot be deep-copied
    if isinstance(model, Sequential):
        layers = copy.deepcopy(model.layers, memo)
        loss = copy.deepcopy(model.criterion, memo)
        new = type(model).__new__(type(model))
        Sequential.__init__(new, layers, loss, dtype=model.dtype, xp=model.xp, seed=model.seed)
        for key, value in model.__dict__.items():   # a subclass's own (MLP.sizes), the history
            if key not in new.__dict__:
                new.__dict__[key] = copy.deepcopy(value, memo)
        new.params[...] = model.params
        return new
    new = copy.copy(model)
    new.params = model.params.copy()
    new.grads = xp.zeros_like(new.params)
    if _RECORD in model.__dict__:
        new.__dict__[_RECORD] = copy.deepcopy(model.__dict__[_RECORD], memo)
    return new


def with_parameters(model: Any, vector: Any) -> Any:
    """A copy of ``model`` (as :func:`clone_model`) whose parameters are ``vector``.

    Raises:
        ValueError: ``vector`` is not 1-D of the model's parameter count.
    """
    shape = tuple(getattr(vector, "shape", np.shape(vector)))
    if shape != (model.layout.size,):
        raise ValueError(f"expecting a parameter vector of shape ({model.layout.size},), "
                         f"got {shape}")
    new = clone_model(model)
    xp = array_namespace(new.params)
    new.params[...] = xp.asarray(vector, dtype=new.params.dtype)
    return new


# --- files and bytes -----------------------------------------------------------

def _model_file(model: Any) -> tuple[list, list, dict]:
    """The tensors, pieces and attributes of a model file."""
    layout: ParamLayout = model.layout
    dtype = np.dtype(model.params.dtype)
    host = to_numpy(model.params) if is_device_array(model.params) else model.params
    rec = _record(model, create=False)
    place = Placement.single(model)
    attrs = {
        "/": root_attrs("model", rec.steps if rec else 0, 0, 1, 1, 1, 1, "none", dtype),
        PARAMS: {},
        MODEL: model_attrs(model) or {"class": type(model).__name__, "architecture": "null",
                                       "metadata": "null"},
    }
    return (declared(layout, place, PARAMS, dtype),
            vector_pieces(layout, place, PARAMS, host, 0, Range(0, layout.size)), attrs)


def serialize_model(model: Any) -> bytes:
    """The model file, as bytes (an in-memory HDF5 image; never pickle)."""
    tensors, pieces, attrs = _model_file(model)
    return write_image(tensors, pieces, attrs, name=_BYTES, order_groups=(PARAMS,))


def save_model(model: Any, path: str | os.PathLike) -> str:
    """Write the model file at ``path`` (atomically, in this process); the path.

    Raises:
        CheckpointError: the folder is missing or not writable, or a tensor name
            cannot be stored.
    """
    tensors, pieces, attrs = _model_file(model)
    return write_checkpoint_file(path, None, tensors, pieces, attrs, driver="serial",
                                 order_groups=(PARAMS,))


def _load_into(model: Any, info: CheckpointInfo, opener: Callable[[], Any] | None) -> Any:
    place = Placement.single(model)
    problem = (local_problem(info, model.layout, place, model.params.dtype)
               or global_problem(info, {s.logical_name for s in place.shards.values()}))
    if problem:
        raise CheckpointError(problem)
    n = model.layout.size
    stage = np.empty(n, dtype=model.params.dtype)
    read_blocks(info, None,
                vector_requests(info, model.layout, place, PARAMS, stage, 0, Range(0, n)),
                opener)
    xp = array_namespace(model.params)
    xp.copyto(model.params, xp.asarray(stage))
    meta = info.metadata or {}
    rec = _record(model)
    rec.steps = info.step
    losses = meta.get("losses") if isinstance(meta, dict) else None
    rec.losses = [float(v) for v in losses] if isinstance(losses, list) else []
    return model


def _open_bytes(data: bytes | bytearray | memoryview) -> tuple[CheckpointInfo, Callable[[], Any]]:
    import h5py

    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"expecting bytes, got {type(data).__name__}")
    data = bytes(data)
    verify_image(data, _BYTES)

    def opener() -> Any:
        return h5py.File(io.BytesIO(data), "r")

    try:
        f = opener()
    except OSError as exc:
        raise CheckpointError(f"{_BYTES}: HDF5 cannot open it: {exc}") from None
    with f:
        return read_info(f, _BYTES), opener


def deserialize_model(model: Any, data: bytes) -> Any:
    """Load parameters and history from :func:`serialize_model` bytes into ``model``.

    Raises:
        TypeError: ``data`` is not bytes.
        CheckpointError: damaged bytes, or another model (names, shapes, dtype).
    """
    info, opener = _open_bytes(data)
    return _load_into(model, info, opener)


def load_model_into(model: Any, path: str | os.PathLike) -> Any:
    """Load the parameters (and history) of the file ``path`` into ``model``; the model.

    Reads model files and training checkpoints alike.

    Raises:
        FileNotFoundError: no file at ``path``.
        CheckpointError: not a valid checkpoint, or another model.
    """
    info = open_checkpoint(os.path.abspath(os.fspath(path)), None)
    return _load_into(model, info, None)


def _build(info: CheckpointInfo, f: Callable | None, predict_fn: Callable | None, xp: Any) -> Any:
    if f is not None:
        from ..nn import FunctionModel

        layout = ParamLayout((r.name, r.shape) for r in info.params())
        return FunctionModel(f, xp.zeros(layout.size, dtype=np.dtype(info.dtype)), layout,
                             predict=predict_fn)
    return build_architecture(info.architecture, info.path, xp)


def load_model(path: str | os.PathLike, f: Callable | None = None,
               predict: Callable | None = None, xp: Any = np) -> Any:
    """A new model from the file ``path``, in this process.

    A :class:`~mpishard.nn.Sequential` is rebuilt from the architecture the file
    records. A :class:`~mpishard.nn.FunctionModel` needs its function back:
    pass ``f`` (and ``predict``) and the model is built with the file's layout.

    Raises:
        FileNotFoundError: no file at ``path``.
        CheckpointError: not a valid checkpoint, or no architecture and no ``f``.
    """
    info = open_checkpoint(os.path.abspath(os.fspath(path)), None)
    return _load_into(_build(info, f, predict, xp), info, None)


def model_from_bytes(data: bytes, f: Callable | None = None, predict: Callable | None = None,
                     xp: Any = np) -> Any:
    """A new model from :func:`serialize_model` bytes (as :func:`load_model`)."""
    info, opener = _open_bytes(data)
    return _load_into(_build(info, f, predict, xp), info, opener)
