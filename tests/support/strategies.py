"""The data-parallel strategies of the tests, by test id."""

from __future__ import annotations

from mpishard.strategies import DDPOptimizer, ZeRO2Optimizer

__all__ = ["STRATEGIES"]

#: The data-parallel strategies with each of ZeRO-2's reduce methods pinned, by
#: test id: ``STRATEGIES[name](optimizer, config, **options)``.
STRATEGIES = {
    "ddp": lambda opt, cfg, **kw: DDPOptimizer(opt, cfg, **kw),
    "zero2-reduce_scatter": lambda opt, cfg, **kw: ZeRO2Optimizer(
        opt, cfg, reduce_method="reduce_scatter", **kw),
    "zero2-allreduce": lambda opt, cfg, **kw: ZeRO2Optimizer(
        opt, cfg, reduce_method="allreduce", **kw),
}
