"""Model files: a model's parameters, architecture record and history, on disk or as bytes.

A model file is a checkpoint of kind ``"model"`` (format version 1, sealed,
checksummed), written and read in this process alone: the parameters as
logical tensors, the architecture record of
[`architecture`][mpishard.nn.Described.architecture] (JSON, never code) and the history of
[`train`][mpishard.nn.ModelMethods.train]. Bytes from [`serialize`][mpishard.models.serialize] are
the same file, held in memory. Never pickle.

The optimizer and its state are not stored (a model file is a model, not a
training run: use [`save_checkpoint`][mpishard.checkpoint.save_checkpoint] with a strategy
for that). Any file of the checkpoint format loads: [`load_model`][mpishard.models.load_model] of a
training checkpoint rebuilds its model whole, in one process.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from ..backend import array_namespace, is_device_array, to_numpy
from ..checkpoint.compare import architecture_problem
from ..checkpoint.container import verify_image
from ..checkpoint.format import MODEL, PARAMS, CheckpointInfo, read_info
from ..checkpoint.read import open_checkpoint, read_blocks
from ..checkpoint.state import (
    Placement,
    declared,
    global_problem,
    local_problem,
    model_attrs,
    root_attrs,
    vector_pieces,
    vector_requests,
)
from ..checkpoint.write import write_checkpoint_file, write_image
from ..errors import CheckpointError
from ..flat import ParamLayout, Range
from ..nn import Described, FunctionModel
from .architecture import build_architecture

__all__ = [
    "deserialize",
    "load_model",
    "load_model_into",
    "model_from_bytes",
    "save_model",
    "serialize",
]

_BYTES = "<serialized model>"


def _model_file(model: Any) -> tuple[list, list, dict]:
    """The tensors, pieces and attributes of a model file."""
    _check_whole(model)
    layout: ParamLayout = model.layout
    dtype = np.dtype(model.params.dtype)
    host = to_numpy(model.params) if is_device_array(model.params) else model.params
    history = model.training_metadata() if isinstance(model, Described) else None
    place = Placement.single(model)
    attrs = {
        "/": root_attrs("model", (history or {}).get("steps", 0), 0, 1, 1, 1, 1, "none",
                        dtype),
        PARAMS: {},
        MODEL: model_attrs(model) or {"class": type(model).__name__, "architecture": "null",
                                       "metadata": "null"},
    }
    return (declared(layout, place, PARAMS, dtype),
            vector_pieces(layout, place, PARAMS, host, 0, Range(0, layout.size)), attrs)


def _check_whole(model: Any) -> None:
    if getattr(model, "params", 0) is None:
        raise CheckpointError("the model's parameters are sharded (ZeRO-3): a model file "
                              "holds the whole vector; use it inside "
                              "strategy.gathered_parameters()")


def serialize(model: Any) -> bytes:
    """The model file of ``model``, as bytes (an in-memory HDF5 image; never pickle)."""
    tensors, pieces, attrs = _model_file(model)
    return write_image(tensors, pieces, attrs, name=_BYTES, order_groups=(PARAMS,))


def save_model(model: Any, path: str | os.PathLike) -> str:
    """Write the model file of ``model`` at ``path`` (atomically, in this process);
    the absolute path.

    Raises:
        CheckpointError: the folder is missing or not writable, or a tensor name
            cannot be stored.
    """
    tensors, pieces, attrs = _model_file(model)
    return write_checkpoint_file(path, None, tensors, pieces, attrs, driver="serial",
                                 order_groups=(PARAMS,))


def _load_into(model: Any, info: CheckpointInfo, opener: Callable[[], Any] | None,
               strict_architecture: bool = True) -> Any:
    _check_whole(model)
    place = Placement.single(model)
    problem = (local_problem(info, model.layout, place, model.params.dtype)
               or global_problem(info, {s.logical_name for s in place.shards.values()})
               or architecture_problem(info, model, strict_architecture))
    if problem:
        raise CheckpointError(problem)
    n = model.layout.size
    stage = np.empty(n, dtype=model.params.dtype)
    read_blocks(info, None,
                vector_requests(info, model.layout, place, PARAMS, stage, 0, Range(0, n)),
                opener)
    xp = array_namespace(model.params)
    xp.copyto(model.params, xp.asarray(stage))
    if isinstance(model, Described):
        meta = info.metadata if isinstance(info.metadata, dict) else {}
        losses = meta.get("losses")
        model.restore_training_metadata(info.step, losses if isinstance(losses, list) else [])
    return model


def _open_bytes(data: bytes | bytearray | memoryview) -> tuple[CheckpointInfo, Callable[[], Any]]:
    # h5py is imported where a file is opened, as everywhere in the library: importing
    # mpishard needs no HDF5. (An external package, not a layer of ours.)
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


def deserialize(model: Any, data: bytes, *, strict_architecture: bool = True) -> Any:
    """Load the parameters (and history) of [`serialize`][mpishard.models.serialize] bytes into
    ``model``; the model. ``strict_architecture`` as in
    [`load_model_into`][mpishard.models.load_model_into].

    Raises:
        TypeError: ``data`` is not bytes.
        CheckpointError: damaged bytes, or another model (names, shapes, dtype,
            architecture).
    """
    info, opener = _open_bytes(data)
    return _load_into(model, info, opener, strict_architecture)


def load_model_into(model: Any, path: str | os.PathLike, *,
                    strict_architecture: bool = True) -> Any:
    """Load the parameters (and history) of the file ``path`` into ``model``; the model.

    Reads model files and training checkpoints alike, into any
    [`Model`][mpishard.protocols.Model] with the file's tensors. When the file and
    the model both record an architecture, they must agree (seed and dtype
    aside): another one is an error listing the differences, unless
    ``strict_architecture=False``.

    Raises:
        FileNotFoundError: no file at ``path``.
        CheckpointError: not a valid checkpoint, or another model (names, shapes,
            dtype, architecture).
    """
    info = open_checkpoint(os.path.abspath(os.fspath(path)), None)
    return _load_into(model, info, None, strict_architecture)


def _build(info: CheckpointInfo, f: Callable | None, predict_fn: Callable | None, xp: Any) -> Any:
    if f is not None:
        layout = ParamLayout((r.name, r.shape) for r in info.params())
        return FunctionModel(f, xp.zeros(layout.size, dtype=np.dtype(info.dtype)), layout,
                             predict=predict_fn)
    return build_architecture(info.architecture, info.path, xp)


def load_model(path: str | os.PathLike, f: Callable | None = None,
               predict: Callable | None = None, xp: Any = np) -> Any:
    """A new model from the file ``path`` (a model file or a training checkpoint),
    in this process, on the array backend ``xp``.

    A library model ([`Sequential`][mpishard.nn.Sequential], ``MLP``, ``GPT``,
    ``ParallelMLP``) is rebuilt from the architecture record in the file; a
    tensor-parallel or pipeline model's checkpoint gives the whole model. A
    [`FunctionModel`][mpishard.nn.FunctionModel] needs its function back: pass ``f`` (and
    ``predict``) and the model is built with the file's layout.

    Raises:
        FileNotFoundError: no file at ``path``.
        CheckpointError: not a valid checkpoint, or no architecture and no ``f``.
    """
    info = open_checkpoint(os.path.abspath(os.fspath(path)), None)
    return _load_into(_build(info, f, predict, xp), info, None)


def model_from_bytes(data: bytes, f: Callable | None = None, predict: Callable | None = None,
                     xp: Any = np) -> Any:
    """A new model from [`serialize`][mpishard.models.serialize] bytes (as
    [`load_model`][mpishard.models.load_model])."""
    info, opener = _open_bytes(data)
    return _load_into(_build(info, f, predict, xp), info, opener)
