"""The end of a process that cannot go on after a lost rank: one line, then the exit code."""

from __future__ import annotations

import sys
from typing import NoReturn

from ..comm import ulfm
from ..errors import HandOver

__all__ = ["hand_over"]


def hand_over(over: HandOver) -> NoReturn:
    """End this process with ``over.exit_code`` (no ``MPI_Finalize``:
    [`ulfm.exit_now`][mpishard.comm.ulfm.exit_now]), its ``speaker`` writing the
    message on stderr first. Local."""
    if over.speaker:
        sys.stderr.write(f"[mpishard] {over}\n")
    ulfm.exit_now(over.exit_code)
    raise AssertionError("unreachable: ulfm.exit_now ends the process")


#: 0.5's name of ``hand_over`` (the faults guide names it), kept importable.
leave = hand_over
