"""Deprecated: the training-state checkpoint functions live in :mod:`mpishard.checkpoint.state`."""

from .._deprecated import forward_names
from . import state as _state

# Nothing is defined here: the names are read from their new homes, with a warning.
__all__: list[str] = []
_MOVED = ("load_checkpoint", "save_checkpoint")

__getattr__ = forward_names(__name__, {name: (_state, name) for name in _MOVED})
