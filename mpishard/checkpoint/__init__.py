"""Parallel HDF5 checkpoints that reshard on load.

Model files (``save_model``, ``load_model``, ``model_from_bytes``) moved to
[`mpishard.models`][mpishard.models], the layer above this one."""

from .background import wait_for_checkpoint
from .collective import resolve_driver
from .files import CheckpointManager, checkpoint_name, latest_checkpoint, list_checkpoints
from .format import FORMAT, FORMAT_VERSION, CheckpointInfo, TensorRecord
from .state import load_checkpoint, save_checkpoint
from .tools import inspect_checkpoint, verify_checkpoint

__all__ = [
    "CheckpointInfo",
    "CheckpointManager",
    "FORMAT",
    "FORMAT_VERSION",
    "TensorRecord",
    "checkpoint_name",
    "inspect_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "resolve_driver",
    "save_checkpoint",
    "verify_checkpoint",
    "wait_for_checkpoint",
]
