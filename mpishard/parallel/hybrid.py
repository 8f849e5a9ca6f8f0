"""3D parallelism: the hybrid strategy cores, data parallelism over the data group of a
[`HybridShardedModel`][mpishard.nn.hybrid.HybridShardedModel].

The model itself (its stages and tensor slices) lives in the models' layer,
[`mpishard.nn`][mpishard.nn]; it is re-exported here as a plain name.
"""

from __future__ import annotations

from typing import Any

from ..comm import FlatComm
from ..config import ShardingConfiguration
from ..flat import Range
from ..nn.hybrid import HybridShardedModel as HybridShardedModel  # re-export
from ..nn.shards import owned_ranges, tensor_shards
from .attach import own_gradient
from .ddp import DDPCore
from .zero2 import ZeRO2Core
from .zero3 import ZeRO3Core

__all__ = ["HybridCore", "HybridDDPCore", "HybridZeRO2Core", "HybridZeRO3Core"]


class HybridCore:
    """What a data-parallel core needs to run on a shard of a
    [`HybridShardedModel`][mpishard.nn.hybrid.HybridShardedModel] (mixed in before
    [`DDPCore`][mpishard.parallel.DDPCore] or [`ZeRO2Core`][mpishard.parallel.ZeRO2Core]).

    It takes the pipeline's micro-batches into account in the gradient average
    and computes the global gradient norm for clipping over the whole job,
    counting every logical parameter once: split tensors by their slices,
    tensors replicated over the tensor group on tensor rank 0 only, and each
    data-parallel rank its shard of the reduced gradient. The step's totals
    (loss, rows, norm, non-finite flags) are reduced over the world in one small
    ``Allreduce``. ``config`` defaults to the model's.
    """

    _model_parallel = True
    public = "HybridShardedOptimizer"
    drops_replicas = True

    def recovery_problem(self) -> str | None:
        """Why whole replicas cannot go on after a lost rank (one data-parallel
        replica only, or a model that is not a
        [`HybridShardedModel`][mpishard.nn.hybrid.HybridShardedModel]), or None."""
        topo = self.config.topology
        if topo.dp < 2 or not isinstance(self.model, HybridShardedModel):
            return (f"the layout has tensor_parallel_size={topo.tp}, pipeline_parallel_size="
                    f"{topo.pp} and data_parallel_size={topo.dp}: the lost rank held a piece "
                    f"of the only model replica")
        return None

    def __init__(self, optimizer: Any, config: ShardingConfiguration | None = None, *,
                 model: Any = None, **options: Any) -> None:
        if config is None and model is not None:
            config = model.config
        super().__init__(optimizer, config, model=model, **options)

    def _setup(self) -> None:
        super()._setup()
        # The pipeline sums its micro-batches' gradients, each of rows x its mean:
        # 1 / micro_batches makes it the rows' sum. Reproducible mode's units are
        # whole micro-batches, each its rows' sum already.
        self._gradient_factor = 1.0 if self.config.reproducible else \
            1.0 / getattr(self.model, "micro_batches", 1)
        # Every rank of a model replica (its tensor and pipeline ranks) sees the
        # same rows and the same loss: one of them counts them in the step's totals.
        c = self.config.groups.coordinates
        self._counts_rows = c.tp == 0 and c.pp == 0

    def _step_group(self) -> FlatComm:
        # The norm sums over stages and tensor slices as well: the whole job.
        return self.config.groups.world

    def _owned_ranges(self) -> list[Range]:
        # Split tensors by their slices, replicated ones on tensor rank 0 only;
        # the strategy then cuts these by data-parallel shard, so each logical
        # element of the gradient is counted once over the world.
        model = self.model
        return owned_ranges(model.layout, tensor_shards(model),
                            self.config.groups.coordinates.tp)


class HybridDDPCore(HybridCore, DDPCore):
    """DDP over the data group of a
    [`HybridShardedModel`][mpishard.nn.hybrid.HybridShardedModel]."""

    strategy = "hybrid-ddp"


class HybridZeRO2Core(HybridCore, ZeRO2Core):
    """ZeRO-2 over the data group of a
    [`HybridShardedModel`][mpishard.nn.hybrid.HybridShardedModel].

    The pipeline accumulates the micro-batches' gradients in the stage's gradient
    vector, so the stage gradient exists in full (as for any model without
    backward hooks); the reduced gradient and the optimizer state are sharded.
    """

    strategy = "hybrid-zero2"


class HybridZeRO3Core(HybridCore, ZeRO3Core):
    """ZeRO-3 over the data group of a
    [`HybridShardedModel`][mpishard.nn.hybrid.HybridShardedModel].

    Each rank keeps its shard of its stage's (tensor slice of the) parameters;
    every forward and backward of the schedule's micro-batches gathers the
    stage's buckets over the data group. The stage gradient exists in full, as
    with [`HybridZeRO2Core`][mpishard.parallel.hybrid.HybridZeRO2Core] (the pipeline accumulates the
    micro-batches' gradients in it); the reduced gradient and the optimizer state are sharded.
    """

    strategy = "hybrid-zero3"

    def build(self, factory: Any, *, micro_batches: int = 1, schedule: str = "1f1b",
              stages: list | None = None) -> HybridShardedModel:
        """A [`HybridShardedModel`][mpishard.nn.hybrid.HybridShardedModel] of
        ``factory`` over this core's configuration, built in ZeRO-3 shards
        (``shard=parameter_shard_spec()``) and attached: each rank allocates and
        initialises only its shard of its (stage, tensor) slice, bit for bit the
        shard of the whole construction, at any layout. Collective over
        ``config.world``.

        Raises:
            TypeError: a factory that takes no ``shard=`` (or no ``tp_comm=``/``stage_layers=``).
            ValueError, TopologyError: as
                [`HybridShardedModel`][mpishard.nn.hybrid.HybridShardedModel].
        """
        model = HybridShardedModel(factory, self.config, micro_batches=micro_batches,
                                   schedule=schedule, stages=stages,
                                   shard=self.parameter_shard_spec())
        self.attach(model)
        return model

    def _attach(self, model: Any, shard: Any, agreed: bool = False) -> None:
        # A stage built in shards has no gradient: the pipeline sums its
        # micro-batches' gradients in the stage's gradient vector (the reduction
        # shards it after the schedule), so the stage gets it here, once.
        if isinstance(model, HybridShardedModel) and model.grads is None:
            own_gradient(model.stage_model, model.xp, model.dtype)
        super()._attach(model, shard, agreed=agreed)

    def _passes(self) -> list[str]:
        return self.model.passes()
