"""Optimizers by name: ``get_optimizer`` and the checkpoint round trip of hyperparameters."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from .adam import Adam, AdamW
from .base import FlatOptimizer
from .sgd import SGD

__all__ = [
    "OPTIMIZERS",
    "get_optimizer",
    "optimizer_from_hyperparameters",
]

#: Registered optimizer classes by lower-case name.
OPTIMIZERS: dict[str, type[FlatOptimizer]] = {
    "adam": Adam,
    "adamw": AdamW,
    "sgd": SGD,
}


def get_optimizer(name: str, **kwargs: Any) -> FlatOptimizer:
    """Build the optimizer called ``name`` (``"sgd"``, ``"adam"``, ``"adamw"``; any case).

    Raises:
        ValueError: an unknown name, or bad hyperparameters.
        TypeError: an argument the optimizer does not take.
    """
    return _class_of(name)(**kwargs)


def optimizer_from_hyperparameters(hyperparameters: dict[str, Any]) -> FlatOptimizer:
    """Rebuild an optimizer from the dict its ``hyperparameters()`` returned.

    Raises:
        ValueError: no or an unknown ``"name"``, a key the optimizer does not
            know, or bad hyperparameters.
    """
    d = dict(hyperparameters)
    if "name" not in d:
        raise ValueError(f"expecting a 'name' among the hyperparameters, got {sorted(d)}")
    cls = _class_of(d.pop("name"))
    known = {f.name for f in fields(cls) if f.init and f.name != "chunk_size"}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"expecting hyperparameters of {cls.__name__} among {sorted(known)}, "
                         f"got unknown {unknown}")
    if "betas" in d:
        d["betas"] = tuple(d["betas"])
    return cls(**d)


def _class_of(name: str) -> type[FlatOptimizer]:
    cls = OPTIMIZERS.get(str(name).lower())
    if cls is None:
        raise ValueError(f"expecting an optimizer among {sorted(OPTIMIZERS)}, got {name!r}")
    return cls
