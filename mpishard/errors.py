"""Exception classes and the collective agreement on rank-dependent errors."""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CommunicationError",
    "MpiShardError",
    "TopologyError",
    "agree",
]


class MpiShardError(Exception):
    """Base class of every error mpishard raises on purpose."""


class TopologyError(MpiShardError, ValueError):
    """A parallel layout that does not fit the communicator it is asked of."""


class CheckpointError(MpiShardError):
    """A checkpoint that is missing, truncated, corrupt, foreign or incompatible."""


class CommunicationError(MpiShardError, RuntimeError):
    """A collective that failed or did not finish in time."""


def agree(comm, message: str | None, exc_type: type[Exception] = MpiShardError) -> None:
    """Raise ``exc_type`` on every rank of ``comm`` if any rank has a ``message``.

    A check whose outcome can differ between ranks must not raise on only some of
    them: the others would wait forever in the next collective. Each rank passes
    its own finding (``None`` when all is well); the lowest failing rank's message
    is raised everywhere, prefixed with that rank. Collective over ``comm``.
    """
    if comm is None or comm.Get_size() == 1:
        if message is not None:
            raise exc_type(message)
        return
    rank = comm.Get_rank()
    first_bad = comm.allreduce(rank if message is not None else comm.Get_size(), op=_min_op())
    if first_bad == comm.Get_size():
        return
    text = comm.bcast(message, root=first_bad)
    raise exc_type(text if comm.Get_size() == 1 else f"rank {first_bad}: {text}")


def _min_op():
    from mpi4py import MPI

    return MPI.MIN
