"""What a checkpoint recorded against what is loading it: architecture and settings.

A file stores the architecture record of the model that wrote it (JSON of the
layers' ``config()``) and the training settings of the strategy (learning-rate
schedule, clipping, accumulation, optimizer hyperparameters). Tensor names and
shapes alone let a model of another architecture load a file without a word (a
``gelu`` MLP into a ``relu`` one, a GPT with 2 heads into one with 4):
`architecture_differences` lists what differs, and loading refuses it
unless asked not to. Settings are the caller's to choose: `setting_differences`
lists those that differ, and loading warns about them.
"""

from __future__ import annotations

import json
from typing import Any

from ..optim.schedules import schedule_from_dict
from .format import CheckpointInfo

__all__ = [
    "ARCHITECTURE_IGNORED",
    "architecture_differences",
    "architecture_problem",
    "schedule_text",
    "setting_differences",
    "strategy_settings",
]

#: Keys of an architecture record that do not make another architecture: how the
#: parameters were initialised (``seed``, ``init_std``: the file's replace them),
#: the ``dtype`` (checked on its own, with its own message).
ARCHITECTURE_IGNORED = ("seed", "init_std", "dtype")

# Classes whose records describe the same computation on the same logical tensors
# as another's: the tensor-parallel classes record their whole, unsplit selves,
# the twins of the serial ones. Value: (the serial class, the arguments that
# still matter; None: all).
_TWINS = {
    "ParallelMLP": ("MLP", None),
    "ColumnParallelLinear": ("Linear", ("in_features", "out_features", "bias")),
    "RowParallelLinear": ("Linear", ("in_features", "out_features", "bias")),
    "VocabParallelCrossEntropy": ("SoftmaxCrossEntropy", ()),
}

_MAX_LISTED = 8


def _normal(value: Any) -> Any:
    if isinstance(value, dict):
        out = {k: _normal(v) for k, v in value.items() if k not in ARCHITECTURE_IGNORED}
        twin = _TWINS.get(out.get("class")) if isinstance(out.get("class"), str) else None
        if twin is not None:
            out["class"], kept = twin
            if kept is not None and isinstance(out.get("args"), dict):
                out["args"] = {k: v for k, v in out["args"].items() if k in kept}
        return out
    if isinstance(value, (list, tuple)):
        return [_normal(v) for v in value]
    return value


def _walk(a: Any, b: Any, path: str, out: list[str]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=lambda k: (k != "class", str(k))):
            where = key if not path else f"{path}.{key}"
            if key == "args" and path == "" and key in a and key in b:
                where = ""   # the model's own arguments are named plainly: "activation"
            if key not in a:
                out.append(f"{where}: absent in the file, {b[key]!r} in the model")
            elif key not in b:
                out.append(f"{where}: {a[key]!r} in the file, absent in the model")
            else:
                _walk(a[key], b[key], where, out)
        return
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            _walk(x, y, f"{path}[{i}]", out)
        return
    if a != b:
        if isinstance(a, list) and isinstance(b, list):
            out.append(f"{path}: {len(a)} entries in the file, {len(b)} in the model")
        else:
            out.append(f"{path}: {a!r} in the file, {b!r} in the model")


def architecture_differences(file_record: dict[str, Any] | None,
                             model_record: dict[str, Any] | None) -> list[str]:
    """What differs between two architecture records, one line each
    (``"activation: 'gelu' in the file, 'relu' in the model"``); empty when they
    describe the same model, or when either is None or of another record version
    (nothing to compare). ``seed`` and ``dtype`` are not compared."""
    if not isinstance(file_record, dict) or not isinstance(model_record, dict):
        return []
    if file_record.get("version") != model_record.get("version"):
        return []
    a = _normal({k: v for k, v in file_record.items() if k != "version"})
    b = _normal({k: v for k, v in model_record.items() if k != "version"})
    out: list[str] = []
    _walk(a, b, "", out)
    return out


def architecture_problem(info: CheckpointInfo, model: Any, strict: bool) -> str | None:
    """Why ``model`` is not the architecture recorded in ``info`` (None if it is, if
    either side records none, or with ``strict=False``)."""
    if not strict or not hasattr(model, "architecture"):
        return None
    differences = architecture_differences(info.architecture, model.architecture())
    if not differences:
        return None
    listed = "; ".join(differences[:_MAX_LISTED])
    more = (f"; and {len(differences) - _MAX_LISTED} more"
            if len(differences) > _MAX_LISTED else "")
    return (f"{info.path}: written by a model of another architecture, although the tensor "
            f"names and shapes fit: {listed}{more} (pass strict_architecture=False to load "
            f"the tensors anyway)")


def strategy_settings(strategy: Any) -> dict[str, Any]:
    """The settings of ``strategy`` a checkpoint records beside its state."""
    return {"max_grad_norm": strategy.max_grad_norm,
            "accumulation_steps": strategy.accumulation_steps}


def schedule_text(record: dict[str, Any] | None) -> str:
    """A schedule's ``to_dict()`` as its constructor call (``CosineSchedule(...)``)."""
    if record is None:
        return "none"
    try:
        return repr(schedule_from_dict(record))
    except ValueError:
        return str(record)


def setting_differences(info: CheckpointInfo, strategy: Any) -> list[str]:
    """The settings of ``strategy`` that differ from those ``info`` recorded, one
    line each: the optimizer's hyperparameters, the learning-rate schedule (when
    both have one that describes itself), clipping and accumulation (files that
    record them). The same on every rank."""
    out: list[str] = []
    hyper = strategy.optimizer.hyperparameters()
    recorded = info.optimizer or {}
    for key in sorted(set(hyper) | set(recorded)):
        if key != "name" and key in recorded and recorded.get(key) != hyper.get(key):
            out.append(f"optimizer {key}: {recorded.get(key)!r} in the file, "
                       f"{hyper.get(key)!r} in the strategy")
    schedule = strategy.schedule
    mine = schedule.to_dict() if hasattr(schedule, "to_dict") else None
    if info.schedule is not None and mine is not None and _same(info.schedule) != _same(mine):
        out.append(f"schedule: {schedule_text(info.schedule)} in the file, "
                   f"{schedule_text(mine)} in the strategy")
    settings = info.settings or {}
    for key, value in strategy_settings(strategy).items():
        if key in settings and settings[key] != value:
            out.append(f"{key}: {settings[key]!r} in the file, {value!r} in the strategy")
    return out


def _same(record: dict[str, Any]) -> str:
    return json.dumps(record, sort_keys=True)
