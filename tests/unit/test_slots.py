"""The elastic agent's slot sources and sizing rules, without MPI (the agent's jobs:
``tests/jobs/test_elastic.py`` and ``tests/jobs/test_launch.py``).
"""

from __future__ import annotations

import time

import pytest

from mpishard.exitcodes import EXIT_STOPPED
from mpishard.launch.slots import EXIT_RESIZE, SlotSource, next_size, slots_from_hostfile


def test_slot_sources_and_sizing(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1 slots=4\nnode2 slots=2  # comment\nnode3\n\n")
    assert slots_from_hostfile(hostfile.read_text()) == 7
    src = SlotSource(hostfile=str(hostfile))
    assert src.available() == 7
    before = src.stamp()
    time.sleep(0.01)
    hostfile.write_text("node1 slots=4\n")
    assert src.stamp() != before and src.available() == 4
    bad = tmp_path / "slots"
    bad.write_text("four")
    with pytest.raises(ValueError, match="expecting one non-negative integer"):
        SlotSource(slots_file=str(bad)).available()
    # One exit code for "checkpointed and stopped": the launch name is an alias of it.
    assert EXIT_RESIZE == EXIT_STOPPED == 75
    assert next_size("start", 0, 6, 2, 4) == 4
    assert next_size("failure", 4, 6, 2, 4) == 3
    assert next_size("failure", 3, 1, 2, 4) == 1     # below the minimum: the agent stops
    assert next_size("slots", 3, 4, 2, 8) == 4


def test_failure_sizing_counts_the_lost_workers(tmp_path):
    assert next_size("failure", 4, 4, 1, 4, lost=2) == 2
    assert next_size("failure", 4, 1, 1, 4, lost=2) == 1         # the source has fewer
    with pytest.raises(ValueError, match="expecting at least 1 lost worker, got 0"):
        next_size("failure", 4, 4, 1, 4, lost=0)
    slots = tmp_path / "slots"
    slots.write_text("4")
    source = SlotSource(slots_file=str(slots))
    written = slots.stat().st_mtime
    assert source.modified_since(written) and not source.modified_since(written + 1)
    assert not SlotSource(fixed=3).modified_since(0.0)
