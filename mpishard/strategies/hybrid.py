"""``HybridShardedOptimizer``: the data-parallel side of 3D (tensor, pipeline, data)
parallelism, on a :class:`~mpishard.parallel.HybridShardedModel`."""

from __future__ import annotations

from typing import Any

from ..config import ShardingConfiguration
from ..parallel import HYBRID_CORES, HybridShardedModel
from ..protocols import Optimizer
from .base import Strategy

__all__ = ["HybridShardedModel", "HybridShardedOptimizer"]


class HybridShardedOptimizer(Strategy):
    """DDP or ZeRO-2 over the data-parallel group of a
    :class:`~mpishard.parallel.HybridShardedModel` (its tensor and pipeline
    groups do the rest): :class:`~mpishard.parallel.HybridDDPCore` or
    :class:`~mpishard.parallel.HybridZeRO2Core`.

    Args:
        optimizer: the update rule (:mod:`mpishard.optim`).
        config: the layout (the model's when None).
        data_parallel: ``"ddp"`` or ``"zero2"``.
        model: the :class:`~mpishard.parallel.HybridShardedModel` to attach.
        **options: the options of the chosen data-parallel strategy
            (:class:`~mpishard.parallel.DataParallelOptions`, and for ZeRO-2
            :class:`~mpishard.parallel.ZeRO2Options`).

    The global gradient norm counts every logical parameter once, and the step's
    totals are reduced over the world. Building it is collective over
    ``config.world``.

    Raises:
        ValueError: an unknown ``data_parallel`` (on every rank).
    """

    def __init__(self, optimizer: Optimizer, config: ShardingConfiguration | None = None, *,
                 data_parallel: str = "ddp", model: HybridShardedModel | None = None,
                 **options: Any) -> None:
        if data_parallel not in HYBRID_CORES:
            raise ValueError(f"data_parallel must be one of {', '.join(HYBRID_CORES)}, "
                             f"got {data_parallel!r}")
        #: ``"ddp"`` or ``"zero2"``.
        self.data_parallel = data_parallel
        super().__init__(HYBRID_CORES[data_parallel](optimizer, config, model=model, **options))
