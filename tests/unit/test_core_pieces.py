"""The pieces beside a data-parallel core's loop (parallel/attach.py, reads.py,
accounting.py, answers.py, totals.py): each on its own, and the core still
answering every name it had before they moved out. One process."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mpishard.flat import ParamLayout, Range
from mpishard.nn import MLP
from mpishard.optim import SGD
from mpishard.parallel import DDPCore, ZeRO2Core, ZeRO3Core
from mpishard.parallel.attach import ModelCalls, _model_problem
from mpishard.parallel.totals import StepTotals

# What DataParallelCore answered in 0.5 and still does (methods, properties, attributes).
PUBLIC = ["attach", "backward", "step", "train_step", "no_sync", "current_lr", "run_model",
          "rebuild", "communicators", "recovery_problem", "whole_parameters",
          "drops_replicas", "gathered_parameters", "parameter_shard",
          "optimizer_state_shard", "synchronize_optimizer_state", "verify_in_sync",
          "memory_report", "note_peak", "reset_timings", "reducer", "reduction_timings",
          "state", "set_progress", "step_count", "skipped_steps", "data_position",
          "replace_options", "options", "timings", "last_grad_norm", "buckets",
          "bucketed", "overlap_timings", "sets_batch_context", "attach_seconds", "totals",
          "reduction", "placement", "layout", "dtype", "xp", "dp", "config", "optimizer"]


class _Unscaled:
    """A model whose forward_backward takes accumulate but not loss_scale."""

    def __init__(self, grad: np.ndarray) -> None:
        self.params = np.zeros_like(grad)
        self.grads = np.zeros_like(grad)
        self.layout = ParamLayout([("w", grad.shape)])
        self.grad = grad

    def forward(self, x):
        return x

    def forward_backward(self, x, y, accumulate=False):
        if accumulate:
            self.grads += self.grad
        else:
            self.grads[...] = self.grad
        return 0.5


@pytest.mark.parametrize("cls", [DDPCore, ZeRO2Core, ZeRO3Core])
def test_the_core_answers_every_name_it_had(cls):
    core = cls(SGD(lr=0.1), model=MLP([3, 4, 2], dtype=np.float64, seed=1))
    missing = [name for name in PUBLIC if not hasattr(core, name)]
    assert missing == []
    report = core.memory_report()
    assert report["peak"] >= report["total"] > 0
    core.note_peak(10**9)
    assert core.memory_report()["peak"] >= 10**9
    comms = core.communicators()
    assert len(comms) == len({id(c) for c in comms}) and core.recovery_problem() is None
    held, state = core.optimizer_state_shard()
    assert held == Range(0, core.layout.size) and set(state) == set(core.state)
    core.verify_in_sync()


def test_model_calls_weight_the_gradient_by_rows_either_way():
    g = np.array([1.0, -2.0, 3.0])
    model = _Unscaled(g)
    calls = ModelCalls(model)
    assert calls.accumulates and not (calls.scales_loss or calls.sets_batch_context)
    assert calls.run(model, None, None, False, 3) == 0.5
    np.testing.assert_array_equal(model.grads, 3 * g)
    calls.run(model, None, None, True, 2)       # added: the sum over 3 + 2 rows
    np.testing.assert_array_equal(model.grads, 5 * g)
    mlp = MLP([3, 2], dtype=np.float64, seed=2)
    assert ModelCalls(mlp).scales_loss and ModelCalls(mlp).accumulates


def test_a_model_that_cannot_be_trained_is_named():
    assert "got str" in _model_problem("not a model")
    model = _Unscaled(np.zeros(3, dtype=np.int64))
    assert "float32 or float64, got int64" in _model_problem(model)
    assert _model_problem(_Unscaled(np.zeros(3))) is None


def test_the_step_mean_from_the_reduced_totals():
    totals = StepTotals()
    totals.buffer = np.array([6.0, 3.0, 16.0, 0.0])    # loss sum, rows, squares, a flag
    loss, norm, scale = totals.mean(0.5)
    assert (loss, norm, scale) == (2.0, 4.0 * 0.5 / 3, 0.5 / 3)
    totals.buffer[2] = math.nan
    assert math.isnan(totals.mean(1.0)[1])
    totals.buffer[1] = 0
    with pytest.raises(ValueError, match="the global batch has no rows"):
        totals.mean(1.0)
