"""3D parallelism: the hybrid strategy cores, data parallelism over the data group of a
[`HybridShardedModel`][mpishard.nn.hybrid.HybridShardedModel].

The model itself (its stages and tensor slices) lives in the models' layer,
[`mpishard.nn`][mpishard.nn]; it is re-exported here as a plain name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..comm import FlatComm
from ..comm.buckets import GradientBuckets
from ..config import ShardingConfiguration
from ..flat import Range, bucket_ranges
from ..nn.hybrid import HybridShardedModel as HybridShardedModel  # re-export
from ..nn.shards import owned_ranges, tensor_shards
from ..protocols import BACKWARD, BucketedModel
from .attach import own_gradient
from .ddp import DDPCore
from .options import ZeRO3Options
from .reduction import ReducedToShards
from .zero2 import ZeRO2Core
from .zero3 import ZeRO3Core

__all__ = ["STAGE_GRADIENTS", "HybridCore", "HybridDDPCore", "HybridZeRO2Core",
           "HybridZeRO3Core", "HybridZeRO3Options", "StageShardedReduction"]

#: What ``stage_gradient=`` accepts (hybrid ZeRO-3).
STAGE_GRADIENTS = ("sharded", "whole")


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


@dataclass(frozen=True)
class HybridZeRO3Options(ZeRO3Options):
    """[`ZeRO3Options`][mpishard.parallel.options.ZeRO3Options] and hybrid ZeRO-3's own.

    Attributes:
        stage_gradient: ``"sharded"`` (default): each micro-batch's gradient is
            reduced to the data group's shards bucket by bucket as the stage's
            backward produces it (``Ireduce_scatter``, as DeepSpeed does under
            gradient accumulation) and added to the rank's gradient shard: no
            rank holds its stage's whole gradient, only two bucket buffers and
            two scratch pieces, at ``micro_batches`` times the data group's
            gradient traffic of ``"whole"``. ``"whole"``: the pipeline sums its
            micro-batches in the stage's whole gradient vector and the buckets
            are reduced once, after the schedule (one reduction a step, a whole
            stage gradient a rank). Reproducible mode always sums whole (its
            binned sums are of each unit's whole gradient).
    """

    stage_gradient: str = "sharded"

    def problem(self) -> str | None:
        if self.stage_gradient not in STAGE_GRADIENTS:
            return (f"stage_gradient must be one of {', '.join(map(repr, STAGE_GRADIENTS))}, "
                    f"got {self.stage_gradient!r}")
        return super().problem()


class StageShardedReduction(ReducedToShards):
    """[`ReducedToShards`][mpishard.parallel.reduction.ReducedToShards] of a
    pipeline stage, one micro-batch at a time (``stage_gradient="sharded"``).

    The stage model's gradients are bound to the two bucket buffers and its
    backward hooks launch each bucket's reduction to the shards as its layers'
    gradients are written; the
    [`HybridShardedModel`][mpishard.nn.hybrid.HybridShardedModel]'s micro-batch
    hooks start each micro-batch's buckets (the step's first writes the shard,
    the others add to it). With ``per_micro_batch`` False (``"whole"``, or
    reproducible mode) it is ``ReducedToShards`` as it is. Collective over
    ``groups.dp``, as its parent.
    """

    #: Each micro-batch's gradient is reduced to the shards during its backward.
    per_micro_batch = False

    def plan_buckets(self, model: Any, xp: Any, options: Any, scales_loss: bool,
                     step_group: FlatComm, record: dict[str, Any], *,
                     dtype: Any) -> GradientBuckets:
        """As [`ReducedToShards`][mpishard.parallel.reduction.ReducedToShards]';
        per micro-batch, always reduced during the backward (nothing measured:
        the point is the memory). Local then."""
        if not self.per_micro_batch:
            return super().plan_buckets(model, xp, options, scales_loss, step_group, record,
                                        dtype=dtype)
        self.bucket_elements = options.bucket_elements(model.layout.size, dtype.itemsize,
                                                       self.dp.size)
        self.bucketed = True
        record.update(choice=True, reason="stage_gradient='sharded': each micro-batch's "
                      "buckets are reduced to the shards during its backward")
        return GradientBuckets(bucket_ranges(model.layout, self.bucket_elements),
                               self.reduce_bucket, slots=self.slots)

    def attach(self, model: Any, xp: Any, buckets: GradientBuckets, bucketed: bool,
               accumulates: bool, check: Callable[[Any], None], dtype: Any = None) -> None:
        """As the parent's, over the stage model (``model.stage_model``), and the
        micro-batch hooks on ``model``. Collective over the training group."""
        if not self.per_micro_batch:
            super().attach(model, xp, buckets, bucketed, accumulates, check, dtype)
            return
        self.hybrid = model
        super().attach(model.stage_model, xp, buckets, bucketed, accumulates, check, dtype)
        model.set_micro_batch_hooks(self.before_micro_batch, self.after_micro_batch)

    def release(self) -> None:
        hybrid = getattr(self, "hybrid", None)
        if hybrid is not None:
            hybrid.set_micro_batch_hooks(None, None)
        super().release()

    def shed(self) -> None:
        super().shed()
        self.hybrid = None

    def _begin(self, micro: int, no_sync: bool) -> None:
        super()._begin(micro, no_sync)
        self._step_micro = micro

    def before_micro_batch(self, i: int) -> None:
        """Hook: micro-batch ``i`` of the pass starts its backward: its buckets go
        to the shards, the step's first micro-batch writing them. Local."""
        self._micro = self._step_micro + i
        self.buckets.begin(True)

    def after_micro_batch(self, i: int) -> None:
        """Hook: micro-batch ``i``'s backward is done: reduce any bucket its hooks
        did not launch (none, for a library stage). Collective over ``groups.dp``."""
        self.buckets.flush()


class HybridZeRO3Core(HybridCore, ZeRO3Core):
    """ZeRO-3 over the data group of a
    [`HybridShardedModel`][mpishard.nn.hybrid.HybridShardedModel].

    Each rank keeps its shard of its stage's (tensor slice of the) parameters;
    every forward and backward of the schedule's micro-batches gathers the
    stage's buckets over the data group. By default (``stage_gradient="sharded"``,
    [`HybridZeRO3Options`][mpishard.parallel.hybrid.HybridZeRO3Options]) the
    gradient is sharded too: each micro-batch's buckets are reduced to the
    shards during its backward and summed there
    ([`StageShardedReduction`][mpishard.parallel.hybrid.StageShardedReduction]),
    so nothing of the stage is whole on any rank, for ``micro_batches`` times
    the gradient traffic. ``stage_gradient="whole"`` (and reproducible mode)
    sums the micro-batches in the stage's whole gradient, as
    [`HybridZeRO2Core`][mpishard.parallel.hybrid.HybridZeRO2Core] does, and
    reduces it once after the schedule.
    """

    strategy = "hybrid-zero3"
    Options = HybridZeRO3Options

    def _sharded_stage(self, model: Any) -> bool:
        """The stage's gradient is reduced per micro-batch (never whole)."""
        return (self.options.stage_gradient == "sharded" and not self.config.reproducible
                and isinstance(model, HybridShardedModel)
                and isinstance(model.stage_model, BucketedModel))

    def _new_reduction(self) -> ReducedToShards:
        reduction = StageShardedReduction.keeping(self.config, self.reduce_method,
                                                  self.reduction)
        reduction.per_micro_batch = self._sharded_stage(self._attaching)
        return reduction

    def _replay(self) -> None:
        """A rank with no rows: the schedule's passes one by one, each backward's
        buckets started as the others' micro-batch hooks start them."""
        reduction = self.reduction
        if not getattr(reduction, "per_micro_batch", False):
            super()._replay()
            return
        backwards = 0
        for phase in self._passes():
            if phase != BACKWARD:
                self.placement.replay([phase], None)
                continue
            reduction.before_micro_batch(backwards)
            self.placement.replay([phase], self.buckets)
            reduction.after_micro_batch(backwards)
            backwards += 1

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
        # stage_gradient="whole": a stage built in shards has no gradient; the
        # pipeline sums its micro-batches' gradients in the stage's gradient
        # vector (the reduction shards it after the schedule), so the stage gets
        # it here, once. "sharded": the reduction binds it to its bucket buffers.
        self._attaching = model      # _new_reduction asks which way
        if isinstance(model, HybridShardedModel) and model.grads is None and \
                not self._sharded_stage(model):
            own_gradient(model.stage_model, model.xp, model.dtype)
        super()._attach(model, shard, agreed=agreed)

    def _passes(self) -> list[str]:
        return self.model.passes()
