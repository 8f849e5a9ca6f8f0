"""The end of a process that cannot go on after a lost rank: one line, then the exit code."""

from __future__ import annotations

import sys
from typing import NoReturn

from ..comm import ulfm
from ..errors import HandOver

__all__ = ["GRACE", "hand_over"]

#: Seconds a rank that hands over without speaking gives the speaker.
GRACE = 5.0


def hand_over(over: HandOver) -> NoReturn:
    """End this process with ``over.exit_code`` (no ``MPI_Finalize``:
    [`ulfm.exit_now`][mpishard.comm.ulfm.exit_now]), its ``speaker`` writing the
    message on stderr first; with a non-zero code the others first give it
    ``GRACE`` seconds (5). Local."""
    if over.speaker:
        sys.stderr.write(f"[mpishard] {over}\n")
    # The others give the speaker time to write its line: ranks that left before it
    # took the line with them (seen in CI under mpirun --with-ft ulfm: exit 75 and
    # no line). A launcher that ends the job at the first non-zero exit (SIGTERM:
    # mpirun without ULFM) ends this wait; mpirun --with-ft ulfm waits for every
    # rank, so there the hand-over ends GRACE later. No MPI call: after a lost rank
    # one may block (a barrier here once hung a job in Open MPI 5's non-blocking
    # collectives).
    quiet = not over.speaker and over.exit_code != 0
    ulfm.exit_now(over.exit_code, linger=GRACE if quiet else 0.0)
    raise AssertionError("unreachable: ulfm.exit_now ends the process")


#: 0.5's name of ``hand_over`` (the faults guide names it), kept importable.
leave = hand_over
