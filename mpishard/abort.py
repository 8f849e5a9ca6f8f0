"""End the whole job when one rank dies of an uncaught exception."""

from __future__ import annotations

import sys
import traceback

__all__ = ["install_abort_hook"]

_installed: list = []


def install_abort_hook(comm) -> None:
    """Make an uncaught exception print its traceback and ``Abort`` ``comm``.

    Without it, one rank's exception leaves the others waiting in the next
    collective until the job's time limit. The hook chains to the previous
    ``sys.excepthook`` only for the printing; installing it twice is harmless.
    """
    if _installed:
        return
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        try:
            rank = comm.Get_rank()
            text = "".join(traceback.format_exception(exc_type, exc, tb))
            sys.stderr.write(f"[mpishard] rank {rank}: uncaught exception, aborting the job\n{text}")
            sys.stderr.flush()
        finally:
            if comm.Get_size() > 1:
                comm.Abort(1)
            else:
                previous(exc_type, exc, tb)

    sys.excepthook = hook
    _installed.append(hook)
