"""A core's options have one home (``core.options``), and a public strategy writes a
core's attributes there, not onto itself (0.5: ``ddp.skipped_steps = 0`` landed on
the facade, which then hid the core's count). One process."""

from __future__ import annotations

import numpy as np
import pytest

from mpishard.nn import MLP
from mpishard.optim import SGD
from mpishard.strategies import DDPOptimizer, ZeRO2Optimizer, ZeRO3Optimizer


def test_a_write_through_the_facade_reaches_the_core():
    ddp = DDPOptimizer(SGD(lr=0.1))
    ddp.skipped_steps = 3
    ddp.step_count = 5
    assert ddp.core.skipped_steps == 3 and ddp.core.step_count == 5
    assert "skipped_steps" not in vars(ddp) and "step_count" not in vars(ddp)
    ddp.schedule = lambda step: 0.5          # an option: replaced in core.options
    assert ddp.core.options.schedule(1) == 0.5 and ddp.current_lr() == pytest.approx(0.05)
    ddp.label = "mine"                       # not a name of the core: the facade's own
    assert vars(ddp)["label"] == "mine" and not hasattr(ddp.core, "label")


def test_options_have_one_home_and_are_checked():
    core = ZeRO2Optimizer(SGD(lr=0.1), reduce_method="auto").core
    assert core.accumulation_steps == core.options.accumulation_steps == 1
    core.accumulation_steps = 2
    assert core.options.accumulation_steps == 2 and "accumulation_steps" not in vars(core)
    with pytest.raises(ValueError, match="bucket_mb must be positive, got -1"):
        core.bucket_mb = -1
    assert core.options.bucket_mb == 25.0


@pytest.mark.parametrize("cls", [ZeRO2Optimizer, ZeRO3Optimizer])
def test_the_resolved_reduce_method_has_its_own_name(cls):
    model = MLP([4, 6, 2], dtype=np.float64)
    opt = cls(SGD(lr=0.1), reduce_method="auto", model=model)
    assert opt.core.options.reduce_method == opt.reduce_method == "auto"
    assert opt.core.reduction.method in ("reduce_scatter", "allreduce", "ring")


def test_progress_is_set_through_one_method():
    core = DDPOptimizer(SGD(lr=0.1)).core
    core.set_progress(step_count=7, skipped_steps=1, data_position={"epoch": 2})
    assert (core.step_count, core.skipped_steps, core.data_position) == (7, 1, {"epoch": 2})
    core.set_progress(step_count=8)           # what is not given stays
    assert (core.step_count, core.skipped_steps) == (8, 1)


def test_parts_name_their_communicators_and_recovery():
    model = MLP([4, 6, 2], dtype=np.float64)
    for cls, kind in ((DDPOptimizer, "replicated"), (ZeRO2Optimizer, "sharded"),
                      (ZeRO3Optimizer, "sharded")):
        core = cls(SGD(lr=0.1), model=model).core
        assert core.placement.recovery == kind
        assert core.dp in core.communicators() and core.config.groups.world in core.communicators()
        with pytest.raises(NotImplementedError, match="admit: giving the state to ranks"):
            core.placement.admit(core.dp, [1])
        if cls is ZeRO3Optimizer:
            assert core.gather_comm in core.communicators()
            core.unshard()          # the model takes its whole vector back for the next


def test_the_flat_hierarchical_and_ring_reducers_are_reducers():
    from mpi4py import MPI

    from mpishard.comm import FlatComm
    from mpishard.comm.hierarchical import HierarchicalComm
    from mpishard.comm.reducer import OwnedReducer, Reducer
    from mpishard.comm.ring import RingComm

    flat = FlatComm(MPI.COMM_WORLD.Dup(), "test")
    owned = [HierarchicalComm(flat), RingComm(flat)]
    assert isinstance(flat, Reducer) and not isinstance(flat, OwnedReducer)
    for reducer in owned:
        assert isinstance(reducer, OwnedReducer), type(reducer).__name__
        assert all(isinstance(c, FlatComm) and c is not flat for c in reducer.communicators())
        reducer.free()
    flat.free()
