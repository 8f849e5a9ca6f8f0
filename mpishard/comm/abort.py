"""End the whole job when one rank dies of an uncaught exception."""

from __future__ import annotations

import sys
import traceback

from mpi4py import MPI

__all__ = ["install_abort_hook"]

_installed: list = []
#: The communicator of the newest configuration: the hook names its ranks.
_current: list = []


def install_abort_hook(comm) -> None:
    """Make an uncaught exception print its traceback and abort the job.

    ``comm`` is the [`FlatComm`][mpishard.comm.FlatComm] the library trains on; the
    message names this rank's world rank, host and rank in ``comm``, and says
    what ends: ``MPI_Abort`` ends every process of the job (under Open MPI all
    of ``MPI.COMM_WORLD``, a simulation sharing the job included), not only
    ``comm``.

    Without it, one rank's exception leaves the others waiting in the next
    collective until the job's time limit. The hook chains to the previous
    ``sys.excepthook`` only for the printing; installing it again only makes
    ``comm`` the one it names (the newest configuration's).
    """
    _current[:] = [comm]
    if _installed:
        return
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        comm = _current[0]
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        world = MPI.COMM_WORLD.Get_size()
        if comm.size > 1 or world > 1:
            scope = (f"all {world} processes of MPI.COMM_WORLD" if world == comm.size else
                     f"all {world} processes of MPI.COMM_WORLD, not only the {comm.size} "
                     f"that train")
            comm.abort(f"uncaught {exc_type.__name__}: {exc}; MPI_Abort ends {scope} "
                       f"(ShardingConfiguration(abort_on_exception=False) leaves exceptions "
                       f"to your code)", code=1, detail=text)
        else:
            previous(exc_type, exc, tb)

    sys.excepthook = hook
    _installed.append(hook)
