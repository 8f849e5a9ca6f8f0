"""The end of a process that cannot go on after a lost rank: one line, then the exit code."""

from __future__ import annotations

import sys
from typing import NoReturn

from ..comm import ulfm
from ..errors import HandOver

__all__ = ["leave"]


def leave(over: HandOver) -> NoReturn:
    """End this process with ``over.exit_code`` (no ``MPI_Finalize``:
    :func:`mpishard.comm.ulfm.leave`), its ``speaker`` writing the message on
    stderr first. Local."""
    if over.speaker:
        sys.stderr.write(f"[mpishard] {over}\n")
    ulfm.leave(over.exit_code)
    raise AssertionError("unreachable: ulfm.leave ends the process")
