"""The single-process model API that every library model shares (a mixin).

Thin methods over :mod:`mpishard.checkpoint.model_api`, imported inside each
method because the checkpoint layer sits above ``nn``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ModelFileMethods"]


class ModelFileMethods:
    """``train``, ``get_model_metadata``, ``serialize``/``deserialize``,
    ``save_model``/``load_model``, ``with_parameters`` and ``clone``."""

    def train(self, x: Any, y: Any, optimizer: Any = None) -> float:
        """One optimizer step on ``(x, y)`` in this process; returns the loss.

        The optimizer (``SGD(lr=0.01)`` on the first call without one) and its
        state stay on the model for later calls; the loss goes into the history.
        """
        from ..checkpoint.model_api import train_step

        return train_step(self, x, y, optimizer)

    def get_model_metadata(self) -> dict[str, Any]:
        """Layers or tensor shapes, parameter count, dtype, training history, metrics."""
        from ..checkpoint.model_api import model_metadata

        return model_metadata(self)

    def serialize(self) -> bytes:
        """The model file (parameters, architecture when known, history) as bytes:
        HDF5, never pickle."""
        from ..checkpoint.model_api import serialize_model

        return serialize_model(self)

    def deserialize(self, data: bytes) -> Any:
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

    def load_model(self, path: Any) -> Any:
        """Load the parameters of a model file or checkpoint into this model.

        Raises:
            FileNotFoundError: no file at ``path``.
            CheckpointError: not a valid model file, or another architecture.
        """
        from ..checkpoint.model_api import load_model_into

        return load_model_into(self, path)

    def with_parameters(self, vector: Any) -> Any:
        """A copy of this model whose parameters are ``vector``."""
        from ..checkpoint.model_api import with_parameters

        return with_parameters(self, vector)

    def clone(self) -> Any:
        """An independent copy: same class, parameters and history."""
        from ..checkpoint.model_api import clone_model

        return clone_model(self)
