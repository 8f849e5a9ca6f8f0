"""``ZeRO2Optimizer``: gradients and optimizer state sharded over the data group."""

from __future__ import annotations

from typing import Any

from ..config import ShardingConfiguration
from ..parallel import ZeRO2Core
from ..protocols import Model, Optimizer
from .base import Strategy

__all__ = ["ZeRO2Optimizer"]


class ZeRO2Optimizer(Strategy):
    """ZeRO stage 2: each data-parallel rank keeps ``1/N`` of the reduced gradient
    and of the optimizer state, updates its shard of the parameters and
    ``Allgatherv``-s them back ([`ZeRO2Core`][mpishard.parallel.ZeRO2Core]).

    Args:
        optimizer: the update rule ([`mpishard.optim`][mpishard.optim]).
        config: the layout (``ShardingConfiguration()`` when None); data parallel
            over ``config.groups.dp``.
        model: attach at once (otherwise [`attach`][mpishard.strategies.base.Strategy.attach] or
            [`optimize`][mpishard.strategies.base.Strategy.optimize] does).
        **options: [`ZeRO2Options`][mpishard.parallel.ZeRO2Options] (those of DDP, and
            ``reduce_method``, ``buddy_copies``).

    Building it is collective over ``config.world``.
    """

    def __init__(self, optimizer: Optimizer, config: ShardingConfiguration | None = None, *,
                 model: Model | None = None, **options: Any) -> None:
        super().__init__(ZeRO2Core(optimizer, config, model=model, **options))
