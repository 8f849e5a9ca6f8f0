"""End the whole job when one rank dies of an uncaught exception."""

from __future__ import annotations

import sys
import traceback

__all__ = ["install_abort_hook"]

_installed: list = []


def install_abort_hook(comm) -> None:
    """Make an uncaught exception print its traceback and abort the job.

    ``comm`` is the :class:`~mpishard.comm.FlatComm` the library trains on; the
    message names this rank's world rank, host and rank in ``comm``.
    ``MPI_Abort`` ends every process of the job (under Open MPI all of
    ``MPI.COMM_WORLD``, a simulation sharing the job included).

    Without it, one rank's exception leaves the others waiting in the next
    collective until the job's time limit. The hook chains to the previous
    ``sys.excepthook`` only for the printing; installing it twice is harmless.
    """
    if _installed:
        return
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        if comm.size > 1:
            comm.abort("uncaught exception", code=1, detail=text)
        else:
            previous(exc_type, exc, tb)

    sys.excepthook = hook
    _installed.append(hook)
