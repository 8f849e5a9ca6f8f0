"""``DDPOptimizer``: distributed data parallel."""

from __future__ import annotations

from typing import Any

from ..config import ShardingConfiguration
from ..parallel import DDPCore
from ..protocols import Model, Optimizer
from .base import Strategy

__all__ = ["DDPOptimizer"]


class DDPOptimizer(Strategy):
    """Distributed data parallel: every rank holds the whole model and optimizer
    state; gradients are summed with ``Allreduce`` in buckets, during the backward
    or after it (``overlap="auto"``, the default: whichever measured faster at
    attach) ([`DDPCore`][mpishard.parallel.DDPCore]).

    Args:
        optimizer: the update rule ([`mpishard.optim`][mpishard.optim]).
        config: the layout (``ShardingConfiguration()`` over ``MPI.COMM_WORLD``
            when None); data parallel over ``config.groups.dp``.
        model: attach at once (otherwise [`attach`][mpishard.strategies.base.Strategy.attach] or
            [`optimize`][mpishard.strategies.base.Strategy.optimize] does).
        **options: [`DataParallelOptions`][mpishard.parallel.DataParallelOptions]
            (``bucket_mb``, ``accumulation_steps``, ``max_grad_norm``,
            ``schedule``, ``overlap``, ``nonfinite``).

    Building it is collective over ``config.world`` (with ``model``, attaching
    over ``groups.dp``).

    Example::

        ddp = DDPOptimizer(Adam(lr=1e-3), ShardingConfiguration(comm))
        result = ddp.optimize(model, (x, y), epochs=3, batch_size=256)
    """

    def __init__(self, optimizer: Optimizer, config: ShardingConfiguration | None = None, *,
                 model: Model | None = None, **options: Any) -> None:
        super().__init__(DDPCore(optimizer, config, model=model, **options))
