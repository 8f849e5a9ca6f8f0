"""``DDPCore``: every replica holds everything; gradients are averaged."""

from __future__ import annotations

from typing import Any

from ..protocols import Model
from .base import DataParallelCore
from .placement import Replicated
from .reduction import Allreduced

__all__ = ["DDPCore"]


class DDPCore(DataParallelCore):
    """Distributed data parallel: an [`Allreduced`][mpishard.parallel.reduction.Allreduced]
    gradient and [`Replicated`][mpishard.parallel.placement.Replicated] parameters.

    Every data-parallel rank holds the full parameters, gradients and optimizer
    state and applies the same update, so the replicas stay identical. The
    gradient vector is cut into buckets of whole layers (``bucket_mb`` MiB) in
    backward order; with the library's models and ``overlap=True`` each bucket's
    non-blocking ``Iallreduce`` starts as soon as the backward pass has written it
    (``GradientBuckets`` (``mpishard.comm.buckets``)), so communication
    overlaps the rest of the backward (``overlap="auto"``, the default, does so
    where a stand-in backward measured it faster at attach; otherwise the buckets
    are reduced after the backward). Each rank's gradient is weighted by its
    rows, and averaging (1/rows of the global batch) and any clipping are folded
    into the optimizer's update, so they cost no extra pass.

    Args and options: [`DataParallelCore`][mpishard.parallel.base.DataParallelCore]'s
    ([`DataParallelOptions`][mpishard.parallel.base.DataParallelOptions]).

    Example::

        ddp = DDPOptimizer(Adam(lr=1e-3), ShardingConfiguration(comm))
        result = ddp.optimize(model, (x, y), epochs=3, batch_size=256)
    """

    strategy = "ddp"
    public = "DDPOptimizer"

    def _new_reduction(self) -> Allreduced:
        return Allreduced(self.config, self.accumulation_steps)

    def _new_placement(self, model: Model, shard: Any = None) -> Replicated:
        return Replicated(model, self.dp, self.xp, self.optimizer)
