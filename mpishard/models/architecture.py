"""A model from the architecture record a model file or checkpoint stores.

The record is what [`architecture`][mpishard.nn.Described.architecture] returned when the
file was written: ``{"version": 2, "class": ..., "args": ...}``, JSON made of the
layers' and models' own ``config()``, rebuilt by the registry of [`mpishard.nn`][mpishard.nn]
([`model_from_config`][mpishard.nn.model_from_config]). Only the library's classes are known; a
model with a user-defined layer is saved with no record (None) and can still be
loaded *into* a model the user builds. A [`FunctionModel`][mpishard.nn.FunctionModel]
wraps a Python function, which a file cannot hold (and would not, as pickle).

Version 1 records (files written before layers described themselves: a
[`Sequential`][mpishard.nn.Sequential] as ``{"type", "args"}`` layers and a loss name)
are read too.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import CheckpointError
from ..nn import ARCHITECTURE_VERSION, LayerStack, model_from_config

__all__ = ["build_architecture"]


def _from_version_1(record: dict[str, Any]) -> dict[str, Any]:
    """A version-1 record as a version-2 config (a Sequential of its layers)."""
    layers = [{"class": entry["type"], "args": entry["args"]} for entry in record["layers"]]
    return {"class": "Sequential", "args": {"layers": layers,
                                            "loss": {"class": record["loss"], "args": {}},
                                            "dtype": record["dtype"], "seed": record["seed"]}}


def build_architecture(record: dict[str, Any] | None, name: str,
                       xp: Any = np) -> LayerStack:
    """A new model, on the array backend ``xp``, from a file's architecture record.

    Raises:
        CheckpointError: no record, or one this library cannot build (naming
            ``name``, the file, and why).
    """
    if record is None:
        raise CheckpointError(f"{name}: records no architecture (written from a FunctionModel "
                              f"or a model with user-defined layers): build the model and call "
                              f"mpishard.models.load_model_into(model, path), or pass f= for a "
                              f"FunctionModel")
    try:
        version = record.get("version")
        if version == 1:
            config = _from_version_1(record)
        elif version == ARCHITECTURE_VERSION:
            config = {k: v for k, v in record.items() if k != "version"}
        else:
            raise ValueError(f"expecting architecture version 1 or {ARCHITECTURE_VERSION}, "
                             f"got {version!r}")
        return model_from_config(config, xp=xp)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"{name}: its architecture cannot be built: "
                              f"{type(exc).__name__}: {exc}") from None
