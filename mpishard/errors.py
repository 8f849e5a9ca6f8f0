"""Exception classes (the collective agreement on them is ``FlatComm.agree``)."""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CommunicationError",
    "MpiShardError",
    "TopologyError",
]


class MpiShardError(Exception):
    """Base class of every error mpishard raises on purpose."""


class TopologyError(MpiShardError, ValueError):
    """A parallel layout that does not fit the communicator it is asked of."""


class CheckpointError(MpiShardError):
    """A checkpoint that is missing, truncated, corrupt, foreign or incompatible."""


class CommunicationError(MpiShardError, RuntimeError):
    """A collective that failed or did not finish in time."""
