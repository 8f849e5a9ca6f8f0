"""The one line of a hand-over outlives the other ranks' exits.

Ranks that handed over (exit 75) before the speaker had written its line could
end the job without it (seen in CI: ``tests/faults/test_spares_3d.py`` ended
with exit 75 and no ``[mpishard]`` line). Here the speaker (rank 0) reaches
[`hand_over`][mpishard.recovery.hand_over] a second after the others, on
purpose; its line must be in the job's output, exactly once (the others give
the speaker ``GRACE`` seconds before they exit).

Runs in the fault-tolerant runtime (``.venv-ft/bin/python -m pytest
tests/faults/test_handover.py``); elsewhere it skips, saying why.
"""

from __future__ import annotations

import pytest
from test_ulfm import _ft_or_skip, ulfm_job

pytestmark = pytest.mark.launch

JOB = r"""
import time
from mpi4py import MPI
from mpishard.comm import from_comm
from mpishard.errors import HandOver
from mpishard.recovery import hand_over

world = from_comm(MPI.COMM_WORLD, "world")
world.barrier()
if world.rank == 0:
    time.sleep(1.0)      # the speaker comes last
hand_over(HandOver("train: the line of the speaker; exiting with 75 to be relaunched",
                   exit_code=75, speaker=world.rank == 0))
"""


def test_the_speakers_line_outlives_the_other_ranks_exits():
    _ft_or_skip()
    job = ulfm_job(4, JOB, timeout=60)
    lines = [line for line in job.stdout.splitlines() if line.startswith("[mpishard]")]
    assert lines == ["[mpishard] train: the line of the speaker; exiting with 75 to be "
                     "relaunched"], job.stdout
    assert job.returncode == 75, job.stdout
