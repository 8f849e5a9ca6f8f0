"""Spare ranks without MPI jobs: who takes which place, and the settings that ask for
spares (``mpishard train --spares``, the TOML key, ``mpishard run --spares``); the
promotions themselves: ``tests/faults/test_spares.py``."""

from __future__ import annotations

import pytest

from mpishard.commands.config import UsageError, plan_runs
from mpishard.launch.agent import ElasticAgent
from mpishard.recovery.spares import seats


@pytest.mark.parametrize("every, size, expected", [
    ([0, 2, 3, -1, -1], 4, ([1], {3: 1})),                 # one lost, one spare left
    ([1, 3, -1, -1], 4, ([0, 2], {2: 0, 3: 2})),            # two lost, two spares
    ([0, 1, 3, -1, -1], 4, ([2], {3: 2})),
    ([0, 3, -1], 4, ([1, 2], {2: 1})),                     # too few spares: one seat
    ([0, 1, 2, 3, -1], 4, ([], {})),                       # a spare died, no worker
])
def test_the_ith_lost_rank_goes_to_the_ith_spare(every, size, expected):
    assert seats(every, size) == expected


def test_spares_from_the_flag_the_toml_file_and_mpishard_run(tmp_path, monkeypatch):
    monkeypatch.delenv("MPISHARD_SPARES", raising=False)
    run, = plan_runs({"example": "burgers", "spares": 1}, 5)
    assert run.spares == 1     # the layout is the 4 training ranks'
    toml = tmp_path / "run.toml"
    toml.write_text('example = "burgers"\nbatch_size = 64\n[parallel]\nspares = 2\n')
    run, = plan_runs({"config": str(toml)}, 6)
    assert run.spares == 2
    run, = plan_runs({"example": "burgers"}, 4)
    assert run.spares == 0
    monkeypatch.setenv("MPISHARD_SPARES", "1")     # what mpishard run --spares 1 sets
    run, = plan_runs({"example": "burgers"}, 5)
    assert run.spares == 1
    with pytest.raises(UsageError, match=r"--spares must be from 0 to 3 \(the ranks but one\), "
                                         r"got 4"):
        plan_runs({"example": "burgers", "spares": 4}, 4)
    with pytest.raises(UsageError, match="does not split across 3 data-parallel rank"):
        plan_runs({"example": "burgers", "batch_size": 64, "spares": 1}, 4)


def test_mpishard_run_passes_spares_to_the_workers_and_needs_ulfm():
    agent = ElasticAgent(["python", "train.py"], min_workers=3, spares=1, launcher="mpirun",
                         fault_tolerance="ulfm")
    assert agent.spares == 1
    with pytest.raises(ValueError, match="--spares 1 needs --fault-tolerance ulfm"):
        ElasticAgent(["python", "train.py"], min_workers=3, spares=1, launcher="mpirun")
    with pytest.raises(ValueError, match="fewer spares than --min-workers"):
        ElasticAgent(["python", "train.py"], min_workers=1, spares=1, launcher="mpirun",
                     fault_tolerance="ulfm")
