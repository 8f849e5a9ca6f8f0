"""Checkpoint format version 1: names, attributes, and the header a reader checks.

One HDF5 file, sealed in its user block (`mpishard.checkpoint.container`)::

    /                       format="mpishard-checkpoint", format_version=1, kind,
                            library_version, step, epoch, world_size, dp, tp, pp,
                            strategy, dtype, created, checksum (algorithm), schedule (JSON),
                            lr (the learning rate at ``step``; training checkpoints),
                            settings (JSON: max_grad_norm, accumulation_steps; since 0.3)
    /params                 order (JSON: tensor names in flat-vector order)
    /params/<name>          each parameter at its logical shape; attribute checksum
    /optimizer              name, hyperparameters (JSON), state_names (JSON)
    /optimizer/<state>/<name>   e.g. exp_avg, at the parameter's shape; checksum
    /data                   epoch, samples_consumed, seed, batch_size, num_samples, shuffle;
                            batches (a stream's batch count; only for a stream's position)
    /model                  class, architecture (JSON), metadata (JSON)   [optional]

``kind`` is ``"training"`` (written by [`save_checkpoint`][mpishard.checkpoint.save_checkpoint]) or
``"model"`` (`save_model`, no optimizer). Tensor names are the layout's
(``"0.weight"``); they may not contain ``/``. A reader never trusts the file:
every attribute is type-checked here and every problem is a
[`CheckpointError`][mpishard.errors.CheckpointError] naming the file.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import CheckpointError
from .checksum import ALGORITHM, Checksum

__all__ = [
    "CheckpointInfo",
    "FORMAT",
    "FORMAT_VERSION",
    "TensorRecord",
    "check_tensor_name",
    "read_info",
]

FORMAT = "mpishard-checkpoint"
FORMAT_VERSION = 1
PARAMS = "params"
OPTIMIZER = "optimizer"
DATA = "data"
MODEL = "model"
KINDS = ("training", "model")
_FLOATS = ("<f4", "<f8")


@dataclass(frozen=True)
class TensorRecord:
    """One dataset of a checkpoint, a logical tensor: ``group`` (``"params"``,
    ``"optimizer/<state>"``), ``name``, its logical ``shape`` and ``dtype`` (a
    numpy dtype string such as ``"<f8"``).

    A writer declares it with ``key``, which orders tensors inside their group
    (the flat-vector offset); a reader finds it with the file's ``checksum``.
    """

    group: str
    name: str
    shape: tuple[int, ...]
    dtype: str
    key: int = 0
    checksum: Checksum | None = None

    @property
    def path(self) -> str:
        return f"{self.group}/{self.name}"

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclass
class CheckpointInfo:
    """What a checkpoint holds, as read from its header (no tensor data)."""

    path: str
    format_version: int
    kind: str
    library_version: str
    step: int
    epoch: int
    layout: dict[str, Any]              # world_size, dp, tp, pp, strategy
    dtype: str
    created: str
    schedule: dict[str, Any] | None
    optimizer: dict[str, Any] | None    # hyperparameters, "name" included
    state_names: list[str]
    data: dict[str, Any] | None         # data position (a strategy's data_position)
    order: list[str]                    # parameter names in flat-vector order
    tensors: dict[str, TensorRecord] = field(default_factory=dict)   # by path
    architecture: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    lr: float | None = None             # the learning rate at ``step``, schedule applied
    settings: dict[str, Any] | None = None   # max_grad_norm, accumulation_steps (0.3 on)
    #: What `load_checkpoint` found different from the
    #: file (the strategy's settings) or took from it (the schedule); one line each.
    notes: list[str] = field(default_factory=list)

    def params(self) -> list[TensorRecord]:
        """The parameter records in flat-vector order."""
        return [self.tensors[f"{PARAMS}/{n}"] for n in self.order]

    def state(self, state: str) -> list[TensorRecord]:
        return [self.tensors[f"{OPTIMIZER}/{state}/{n}"] for n in self.order]

    @property
    def parameter_count(self) -> int:
        return sum(r.size for r in self.params())


def check_tensor_name(name: str) -> str | None:
    """Why ``name`` cannot be a dataset name, or None."""
    if not isinstance(name, str) or not name or "/" in name or name in (".", ".."):
        return f"tensor name {name!r} cannot be stored: expecting a non-empty name without '/'"
    return None


# --- reading ---------------------------------------------------------------

def _attr(obj: Any, key: str, where: str, path: str) -> Any:
    try:
        return obj.attrs[key]
    except KeyError:
        raise CheckpointError(f"{path}: attribute {key!r} of {where} is missing") from None
    except Exception as exc:  # h5py raises OSError and others for damaged attributes
        raise CheckpointError(f"{path}: attribute {key!r} of {where} cannot be read: "
                              f"{exc}") from None


def _int(obj: Any, key: str, where: str, path: str, low: int = 0) -> int:
    v = _attr(obj, key, where, path)
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < low:
        raise CheckpointError(f"{path}: attribute {key!r} of {where}: expecting an integer "
                              f">= {low}, got {v!r}")
    return int(v)


def _str(obj: Any, key: str, where: str, path: str) -> str:
    v = _attr(obj, key, where, path)
    if isinstance(v, bytes):
        v = v.decode("utf-8", "replace")
    if not isinstance(v, str):
        raise CheckpointError(f"{path}: attribute {key!r} of {where}: expecting a string, "
                              f"got {v!r}")
    return v


def _json(obj: Any, key: str, where: str, path: str,
          kinds: tuple = (dict, list, type(None))) -> Any:
    text = _str(obj, key, where, path)
    try:
        value = json.loads(text)
    except ValueError:
        raise CheckpointError(f"{path}: attribute {key!r} of {where} is not valid JSON") from None
    if not isinstance(value, kinds):
        raise CheckpointError(f"{path}: attribute {key!r} of {where}: unexpected JSON "
                              f"{value!r:.80}")
    return value


def _dataset(f: Any, dpath: str, path: str) -> Any:
    try:
        obj = f.get(dpath)
    except Exception as exc:
        raise CheckpointError(f"{path}: {dpath} cannot be read: {exc}") from None
    if obj is None:
        raise CheckpointError(f"{path}: dataset {dpath} is missing")
    if not hasattr(obj, "shape") or not hasattr(obj, "dtype"):
        raise CheckpointError(f"{path}: {dpath} is not a dataset")
    return obj


def _record(f: Any, group: str, name: str, path: str) -> TensorRecord:
    dpath = f"{group}/{name}"
    d = _dataset(f, dpath, path)
    try:
        dtype = np.dtype(d.dtype).newbyteorder("<").str
        shape = tuple(int(s) for s in d.shape)
        layout = d.id.get_create_plist().get_layout()
    except Exception as exc:
        raise CheckpointError(f"{path}: {dpath} cannot be read: {exc}") from None
    if dtype not in _FLOATS:
        raise CheckpointError(f"{path}: {dpath} has dtype {np.dtype(dtype).name}, "
                              f"expecting float32 or float64")
    import h5py

    if layout != h5py.h5d.CONTIGUOUS and math.prod(shape) > 0:
        raise CheckpointError(f"{path}: {dpath} is not stored contiguously (chunked or "
                              f"compact): not written by mpishard")
    raw = _attr(d, "checksum", dpath, path)
    a = np.asarray(raw)
    if a.shape != (2,) or a.dtype != np.uint64:
        raise CheckpointError(f"{path}: attribute 'checksum' of {dpath}: expecting 2 "
                              f"unsigned 64-bit integers, got {a.dtype} of shape {a.shape}")
    return TensorRecord(group, name, shape, dtype, checksum=Checksum.from_array(a))


def read_info(f: Any, path: str) -> CheckpointInfo:
    """Read and check the header of the open h5py file ``f`` (``path`` for messages).

    Checks the format name and version, every attribute's type, that each tensor
    named in ``/params`` ``order`` exists (and, with an optimizer, each state of
    it) at the same shape and a float dtype, and that every dataset has a
    checksum. Reads no tensor data.

    Raises:
        CheckpointError: naming ``path`` and what is wrong.
    """
    try:
        fmt = f.attrs.get("format")
    except Exception as exc:
        raise CheckpointError(f"{path}: its root attributes cannot be read: {exc}") from None
    if isinstance(fmt, bytes):
        fmt = fmt.decode("utf-8", "replace")
    if fmt != FORMAT:
        raise CheckpointError(f"{path}: not an mpishard checkpoint (root attribute 'format' is "
                              f"{fmt!r}, expecting {FORMAT!r})")
    version = _int(f, "format_version", "/", path)
    if version != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format_version {version} is not supported; this "
                              f"library reads version {FORMAT_VERSION}")
    kind = _str(f, "kind", "/", path)
    if kind not in KINDS:
        raise CheckpointError(f"{path}: kind {kind!r} is unknown, expecting one of {KINDS}")
    algorithm = _str(f, "checksum", "/", path)
    if algorithm != ALGORITHM:
        raise CheckpointError(f"{path}: checksum algorithm {algorithm!r} is unknown, "
                              f"expecting {ALGORITHM!r}")
    layout = {"world_size": _int(f, "world_size", "/", path, 1),
              "dp": _int(f, "dp", "/", path, 1), "tp": _int(f, "tp", "/", path, 1),
              "pp": _int(f, "pp", "/", path, 1), "strategy": _str(f, "strategy", "/", path)}
    dtype = _str(f, "dtype", "/", path)
    if PARAMS not in f:
        raise CheckpointError(f"{path}: group /{PARAMS} is missing")
    order = _json(f[PARAMS], "order", f"/{PARAMS}", path, (list,))
    if not all(isinstance(n, str) and check_tensor_name(n) is None for n in order):
        raise CheckpointError(f"{path}: attribute 'order' of /{PARAMS} holds an invalid name")
    if len(set(order)) != len(order):
        raise CheckpointError(f"{path}: attribute 'order' of /{PARAMS} names a tensor twice")
    info = CheckpointInfo(
        path=path, format_version=version, kind=kind,
        library_version=_str(f, "library_version", "/", path),
        step=_int(f, "step", "/", path), epoch=_int(f, "epoch", "/", path),
        layout=layout, dtype=dtype, created=_str(f, "created", "/", path),
        schedule=_json(f, "schedule", "/", path, (dict, type(None))),
        optimizer=None, state_names=[], data=None, order=list(order))
    if "lr" in f.attrs:
        lr = _attr(f, "lr", "/", path)
        if not isinstance(lr, (float, np.floating)):
            raise CheckpointError(f"{path}: attribute 'lr' of /: expecting a number, got {lr!r}")
        info.lr = float(lr)
    if "settings" in f.attrs:
        info.settings = _json(f, "settings", "/", path, (dict,))
    for name in order:
        rec = _record(f, PARAMS, name, path)
        if np.dtype(rec.dtype).name != dtype:
            raise CheckpointError(f"{path}: {rec.path} has dtype {np.dtype(rec.dtype).name}, "
                                  f"the file says {dtype}")
        info.tensors[rec.path] = rec
    extra = sorted(set(_keys(f[PARAMS], path)) - set(order))
    if extra:
        raise CheckpointError(f"{path}: /{PARAMS} holds tensors not in its order: {extra[:5]}")
    if OPTIMIZER in f:
        g = f[OPTIMIZER]
        hyper = _json(g, "hyperparameters", f"/{OPTIMIZER}", path, (dict,))
        name = _str(g, "name", f"/{OPTIMIZER}", path)
        if hyper.get("name") != name:
            raise CheckpointError(f"{path}: /{OPTIMIZER} name {name!r} differs from its "
                                  f"hyperparameters' {hyper.get('name')!r}")
        states = _json(g, "state_names", f"/{OPTIMIZER}", path, (list,))
        if not all(isinstance(s, str) and check_tensor_name(s) is None for s in states):
            raise CheckpointError(f"{path}: attribute 'state_names' of /{OPTIMIZER} is invalid")
        info.optimizer, info.state_names = hyper, list(states)
        for state in states:
            for pname in order:
                rec = _record(f, f"{OPTIMIZER}/{state}", pname, path)
                ref = info.tensors[f"{PARAMS}/{pname}"]
                if rec.shape != ref.shape or rec.dtype != ref.dtype:
                    raise CheckpointError(
                        f"{path}: {rec.path} has shape {rec.shape} {np.dtype(rec.dtype).name}, "
                        f"its parameter {ref.shape} {np.dtype(ref.dtype).name}")
                info.tensors[rec.path] = rec
    if DATA in f:
        g = f[DATA]
        info.data = {k: _int(g, k, f"/{DATA}", path) for k in
                     ("epoch", "samples_consumed", "seed", "batch_size", "num_samples")}
        info.data["shuffle"] = bool(_int(g, "shuffle", f"/{DATA}", path))
        if "batches" in g.attrs:   # a BatchStream's position
            info.data["batches"] = _int(g, "batches", f"/{DATA}", path)
    if MODEL in f:
        g = f[MODEL]
        info.architecture = _json(g, "architecture", f"/{MODEL}", path, (dict, type(None)))
        info.metadata = _json(g, "metadata", f"/{MODEL}", path, (dict, type(None)))
    return info


def _keys(group: Any, path: str) -> list[str]:
    try:
        return list(group.keys())
    except Exception as exc:
        raise CheckpointError(f"{path}: cannot list {group.name}: {exc}") from None
