"""Every exception and warning class mpishard raises or issues on purpose.

The collective agreement on an error (every rank raises the same one) is
``FlatComm.agree``; the rules are on the docs site's errors page.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CheckpointWarning",
    "CommunicationError",
    "DataPositionWarning",
    "HandOver",
    "InexactRecoveryWarning",
    "MpiShardError",
    "NonFiniteError",
    "TopologyError",
    "UsageError",
]


class MpiShardError(Exception):
    """Base class of every error mpishard raises on purpose."""


class TopologyError(MpiShardError, ValueError):
    """A parallel layout that does not fit the communicator it is asked of."""


class CheckpointError(MpiShardError):
    """A checkpoint that is truncated, corrupt, foreign or incompatible (a missing
    file raises ``FileNotFoundError``)."""


class CommunicationError(MpiShardError, RuntimeError):
    """A collective that failed or did not finish in time."""


class UsageError(MpiShardError, ValueError):
    """A problem with the command line or a configuration file of ``mpishard``:
    one line on rank 0, exit code 2."""


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


class HandOver(MpiShardError):
    """Training cannot go on in this process after a lost rank: it hands over to a
    relaunch (``mpishard run``, a requeued batch job) or simply leaves.

    Raised on every survivor, with the same message; the training loop catches
    it, has ``speaker`` say the message once, and ends the process with
    ``exit_code`` (see [`mpishard.recovery.handover`][mpishard.recovery.handover]).

    Attributes:
        exit_code: what the process ends with: 75 (``EXIT_STOPPED``: relaunch me
            from the newest checkpoint) or 0 (a dropped replica's rank whose work
            goes on elsewhere).
        speaker: True on the one rank that writes the message.
        stopped: why the run stopped, as the metrics' ``end`` record says it.
    """

    def __init__(self, message: str, *, exit_code: int, speaker: bool,
                 stopped: str = "hand-over") -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.speaker = speaker
        self.stopped = stopped


class CheckpointWarning(UserWarning):
    """A checkpoint loaded into a strategy whose settings (learning-rate schedule,
    clipping, accumulation, optimizer hyperparameters) differ from the file's."""


class DataPositionWarning(UserWarning):
    """An ``optimize()`` argument differs from the data position it continues;
    the message says what is used."""


class InexactRecoveryWarning(UserWarning):
    """A recovery that could not keep the run exact where it was (ZeRO-2 without
    the lost shard: rolled back to the newest checkpoint)."""
