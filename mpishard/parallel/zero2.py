"""``ZeRO2Core``: gradients and optimizer state sharded over the data group."""

from __future__ import annotations

from typing import Any

from ..protocols import Model
from .options import REDUCE_METHODS, ZeRO2Options
from .placement import GatheredAfterStep
from .reduction import choose_reduce_method
from .sharded import ShardedCore

__all__ = ["REDUCE_METHODS", "ZeRO2Core", "ZeRO2Options", "choose_reduce_method"]


class ZeRO2Core(ShardedCore):
    """ZeRO stage 2: a gradient [`ReducedToShards`][mpishard.parallel.reduction.ReducedToShards]
    and parameters [`GatheredAfterStep`][mpishard.parallel.placement.GatheredAfterStep]:
    each data-parallel rank keeps 1/N of gradients and state.

    The flat vector is cut into N contiguous shards ([`shard_ranges`][mpishard.flat.shard_ranges];
    shards do not respect tensor boundaries, the last ones may be shorter). With the
    library's models the backward pass writes gradients into two bucket-sized
    buffers in turn; each bucket, once complete, is reduced to its shards while
    the backward goes on, and the rank keeps only the piece of its shard. The full
    reduced gradient never exists; peak gradient memory is two buffers of the
    largest bucket plus the shard. The wrapped optimizer then updates the rank's
    shard of the parameters with state of the shard's length, and an in-place
    ``Allgatherv`` rebuilds the full parameters on every rank.

    A model that is not a [`BucketedModel`][mpishard.protocols.BucketedModel] (for
    example a [`FunctionModel`][mpishard.nn.FunctionModel] returning its whole
    gradient) keeps its full gradient; only the reduced gradient and the state
    are sharded then.

    Gradient accumulation reduces every micro-batch into the shard (as DeepSpeed
    does at stage 2); ``no_sync`` is not available, since skipping the
    reduction would need the full gradient.

    Args and options: [`DataParallelCore`][mpishard.parallel.base.DataParallelCore]'s,
    and [`ZeRO2Options`][mpishard.parallel.options.ZeRO2Options] (``reduce_method``,
    ``buddy_copies``).
    """

    strategy = "zero2"
    public = "ZeRO2Optimizer"

    def _new_placement(self, model: Model, shard: Any = None) -> GatheredAfterStep:
        return GatheredAfterStep(model, self.dp, self.xp, self._sharded_state())
