"""Exception classes (the collective agreement on them is ``FlatComm.agree``)."""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CheckpointWarning",
    "CommunicationError",
    "MpiShardError",
    "NonFiniteError",
    "TopologyError",
]


class MpiShardError(Exception):
    """Base class of every error mpishard raises on purpose."""


class TopologyError(MpiShardError, ValueError):
    """A parallel layout that does not fit the communicator it is asked of."""


class CheckpointError(MpiShardError):
    """A checkpoint that is missing, truncated, corrupt, foreign or incompatible."""


class CheckpointWarning(UserWarning):
    """A checkpoint loaded into a strategy whose settings (learning-rate schedule,
    clipping, accumulation, optimizer hyperparameters) differ from the file's."""


class CommunicationError(MpiShardError, RuntimeError):
    """A collective that failed or did not finish in time."""


class NonFiniteError(MpiShardError, FloatingPointError):
    """A NaN or infinite loss or gradient norm in a training step, raised on every
    rank with the parameters and optimizer state left as they were before the step.

    Attributes:
        step: the 1-based number of the step that was refused.
        rank: the first data-parallel rank where a non-finite local loss or
            gradient appeared, or None when no rank could be named.
        world_rank: that rank's rank in ``MPI.COMM_WORLD``, or None.
    """

    def __init__(self, message: str, step: int | None = None, rank: int | None = None,
                 world_rank: int | None = None) -> None:
        super().__init__(message)
        self.step = step
        self.rank = rank
        self.world_rank = world_rank
