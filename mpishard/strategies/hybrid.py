"""``HybridShardedOptimizer``: the data-parallel side of 3D (tensor, pipeline, data)
parallelism, on a [`HybridShardedModel`][mpishard.nn.hybrid.HybridShardedModel]."""

from __future__ import annotations

from typing import Any

from ..config import ShardingConfiguration
from ..nn.hybrid import HybridShardedModel as HybridShardedModel  # re-export
from ..protocols import Optimizer
from .base import Strategy
from .registry import strategy_entry

__all__ = ["HybridShardedOptimizer"]


class HybridShardedOptimizer(Strategy):
    """DDP, ZeRO-2 or ZeRO-3 over the data-parallel group of a
    [`HybridShardedModel`][mpishard.nn.hybrid.HybridShardedModel] (its tensor
    and pipeline groups do the rest): the ``hybrid`` core of the strategy's entry in
    [`STRATEGIES`][mpishard.strategies.registry.STRATEGIES]
    ([`HybridDDPCore`][mpishard.parallel.hybrid.HybridDDPCore],
    [`HybridZeRO2Core`][mpishard.parallel.hybrid.HybridZeRO2Core] or
    [`HybridZeRO3Core`][mpishard.parallel.hybrid.HybridZeRO3Core]).

    Args:
        optimizer: the update rule ([`mpishard.optim`][mpishard.optim]).
        config: the layout (the model's when None).
        data_parallel: a name of [`STRATEGIES`][mpishard.strategies.registry.STRATEGIES]:
            ``"ddp"``, ``"zero2"`` or ``"zero3"`` (a stage's parameters sharded
            too, gathered before each forward and backward of the schedule).
        model: the [`HybridShardedModel`][mpishard.nn.hybrid.HybridShardedModel]
            to attach.
        **options: the options of the chosen data-parallel strategy
            ([`DataParallelOptions`][mpishard.parallel.base.DataParallelOptions],
            and for ZeRO-2 [`ZeRO2Options`][mpishard.parallel.zero2.ZeRO2Options],
            for ZeRO-3 [`HybridZeRO3Options`][mpishard.parallel.hybrid.HybridZeRO3Options]:
            ZeRO-3's and ``stage_gradient``).

    The global gradient norm counts every logical parameter once, and the step's
    totals are reduced over the world. Building it is collective over
    ``config.world``.

    Raises:
        ValueError: an unknown ``data_parallel`` (on every rank).
    """

    def __init__(self, optimizer: Optimizer, config: ShardingConfiguration | None = None, *,
                 data_parallel: str = "ddp", model: HybridShardedModel | None = None,
                 **options: Any) -> None:
        core = strategy_entry(data_parallel, "data_parallel").hybrid_class
        #: The data-parallel strategy's name (a key of ``STRATEGIES``).
        self.data_parallel = data_parallel
        super().__init__(core(optimizer, config, model=model, **options))

    def build(self, factory: Any, *, micro_batches: int = 1, schedule: str = "1f1b",
              stages: list | None = None) -> HybridShardedModel:
        """Build the [`HybridShardedModel`][mpishard.nn.hybrid.HybridShardedModel]
        of ``factory`` over this strategy's configuration in ZeRO-3 shards and
        attach it (``data_parallel="zero3"`` only): each rank of a data-parallel
        group allocates and initialises only its shard of its (stage, tensor)
        slice, bit for bit the shard of the whole construction with the same
        seed, at any layout; its peak is the shard and about one layer. With
        ``stage_gradient="sharded"`` (the default) the stage's gradient is never
        whole either (each micro-batch's reduced to the shards during its
        backward); ``"whole"`` makes it whole at attach (the pipeline sums its
        micro-batches there). Collective over ``config.world``.

        ```python
        config = ShardingConfiguration(tensor_parallel_size=2, pipeline_parallel_size=2)
        opt = HybridShardedOptimizer(AdamW(lr=3e-4), config, data_parallel="zero3")
        model = opt.build(partial(GPT, 50257, 1024, 768, 12, 12, dtype=np.float32, seed=1),
                          micro_batches=4)
        ```

        Raises:
            ValueError: ``data_parallel`` is not ``"zero3"`` (on every rank), or
                as [`HybridShardedModel`][mpishard.nn.hybrid.HybridShardedModel].
            TypeError: a factory that takes no ``shard=`` (a model that brings its
                own vector: build the whole ``HybridShardedModel`` and attach it).
        """
        if not hasattr(self.core, "parameter_shard_spec"):
            raise ValueError(f"HybridShardedOptimizer.build builds in ZeRO-3 shards: it needs "
                             f"data_parallel='zero3', got {self.data_parallel!r} (build the "
                             f"HybridShardedModel whole and pass model=)")
        return self.core.build(factory, micro_batches=micro_batches, schedule=schedule,
                               stages=stages)
