"""Deadlines by kind on the library's groups: what each call waits under.

Run under ``mpirun -n N python -m pytest --with-mpi`` for N = 1, 2, 4. (What a wait
past each deadline does, in whole jobs: ``tests/jobs/test_coupled.py``.)
"""

from __future__ import annotations

import pytest
from mpi4py import MPI

from mpishard import ShardingConfiguration
from mpishard.comm.deadlines import Deadlines

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD


def test_every_group_of_a_configuration_has_its_deadlines():
    config = ShardingConfiguration(WORLD, timeout=30, data_timeout=None, io_timeout=600)
    assert config.deadlines == Deadlines(30.0, None, 600.0)
    g = config.groups
    for group in (g.world, g.dp, g.tp, g.pp):
        assert group.deadlines == config.deadlines
        assert (group.kind, group.timeout) == ("peer", 30.0)
    config.free()


def test_timeout_alone_still_bounds_every_kind():
    config = ShardingConfiguration(WORLD, timeout=45)
    assert config.deadlines == Deadlines(45.0, 45.0, 45.0)
    with config.world.deadline("data"):
        assert config.world.timeout == 45.0
    config.free()


def test_a_block_waits_under_its_kind_and_nests():
    config = ShardingConfiguration(WORLD, timeout=30, data_timeout=None, io_timeout=600)
    world = config.world
    with world.deadline("data"):
        assert (world.kind, world.timeout) == ("data", None)
        with world.deadline("io"):
            assert (world.kind, world.timeout) == ("io", 600.0)
            inherits = world.dup()                 # made inside: the same kind
            plain = world.dup(context=False)       # a group of its own: peer
        assert (world.kind, world.timeout) == ("data", None)
        assert world.allreduce(1) == WORLD.size   # a call under no limit completes
    assert (world.kind, world.timeout) == ("peer", 30.0)
    assert (inherits.kind, inherits.timeout) == ("io", 600.0)
    assert (plain.kind, plain.timeout) == ("peer", 30.0)
    assert config.groups.dp.kind == "peer"         # a kind is the group's own
    with pytest.raises(ValueError, match="expecting a deadline kind among"), \
            world.deadline("disk"):
        pass
    assert world.kind == "peer"
    inherits.free()
    plain.free()
    config.free()


def test_bad_deadlines_are_refused_on_every_rank():
    with pytest.raises(ValueError, match=r"^data_timeout must be positive seconds or None, "
                                         r"got -1$"):
        ShardingConfiguration(WORLD, timeout=30, data_timeout=-1)
    with pytest.raises(ValueError, match=r"^io_timeout must be positive seconds or None, "
                                         r"got 'slow'$"):
        ShardingConfiguration(WORLD, io_timeout="slow")
