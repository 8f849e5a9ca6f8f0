"""Collectives on flat buffers over one process group."""

from .communicator import FlatComm, Handle
from .cuda import cuda_aware, cuda_aware_reason

__all__ = ["FlatComm", "Handle", "cuda_aware", "cuda_aware_reason"]
