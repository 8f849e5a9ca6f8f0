"""The end of a process that cannot go on after a lost rank: one line, then the exit code."""

from __future__ import annotations

import sys
import time
from typing import NoReturn

from ..comm import ulfm
from ..errors import HandOver

__all__ = ["hand_over"]


def hand_over(over: HandOver) -> NoReturn:
    """End this process with ``over.exit_code`` (no ``MPI_Finalize``:
    [`ulfm.exit_now`][mpishard.comm.ulfm.exit_now]), its ``speaker`` writing the
    message on stderr first; with a non-zero code no rank of ``over.group``
    exits before the speaker has written (see `_after_the_speaker`). Local, but
    for that wait."""
    if over.speaker:
        sys.stderr.write(f"[mpishard] {over}\n")
        sys.stderr.flush()
    if over.exit_code != 0:
        _after_the_speaker(over)
    ulfm.exit_now(over.exit_code)
    raise AssertionError("unreachable: ulfm.exit_now ends the process")


#: How long the ranks of a hand-over wait for each other (seconds), and how long a
#: rank that cannot wait so gives the speaker before exiting.
GROUP_WAIT, GRACE = 10.0, 5.0


def _after_the_speaker(over: HandOver) -> None:
    """Return once the speaker has written its line: a non-zero exit makes
    ``mpirun`` kill the whole job at once, so a rank leaving first could take the
    line with it (seen: exit 75 and no line). The ranks of ``over.group`` meet
    ([`ulfm.meet`][mpishard.comm.ulfm.meet], at most ``GROUP_WAIT``) once the
    speaker has written;
    without a group, or where it fails (a rank lost meanwhile), a non-speaker
    waits ``GRACE`` (``mpirun`` ends it sooner, once the speaker exits)."""
    if over.group is not None and ulfm.meet(over.group, GROUP_WAIT):
        return
    if not over.speaker:
        time.sleep(GRACE)
