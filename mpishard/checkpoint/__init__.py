"""Parallel HDF5 checkpoints that reshard on load, and the model file API."""

from .files import CheckpointManager, checkpoint_name, latest_checkpoint, list_checkpoints
from .format import FORMAT, FORMAT_VERSION, CheckpointInfo, TensorRecord
from .model_api import load_model, model_from_bytes, save_model
from .strategy import load_checkpoint, save_checkpoint
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
    "load_model",
    "model_from_bytes",
    "save_checkpoint",
    "save_model",
    "verify_checkpoint",
]
