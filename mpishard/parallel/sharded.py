"""``ShardedCore``: what ZeRO-2 and ZeRO-3 share, a gradient reduced to shards."""

from __future__ import annotations

from typing import Any

from ..flat import Range
from .base import DataParallelCore
from .options import ZeRO2Options
from .placement import ShardedState
from .reduction import ReducedToShards

__all__ = ["ShardedCore"]


class ShardedCore(DataParallelCore):
    """A core whose gradient is [`ReducedToShards`][mpishard.parallel.reduction.ReducedToShards]
    and whose optimizer state is sharded alike
    ([`ShardedState`][mpishard.parallel.placement.ShardedState]); its subclasses
    name where the parameters live. Not used directly."""

    Options = ZeRO2Options

    def _new_reduction(self) -> ReducedToShards:
        # A rebuild keeps the method reduce_method="auto" measured at the first attach.
        return ReducedToShards.keeping(self.config, self.reduce_method, self.reduction)

    def _sharded_state(self) -> ShardedState:
        return ShardedState(self.layout.size, self.dtype, self.dp, self.xp, self.optimizer)

    # --- 0.5's attributes, read from the parts ---------------------------------------
    @property
    def shards(self) -> list[Range]:
        """Every data-parallel rank's shard (world ranges of the flat vector)."""
        return self.placement.sharded.shards

    @property
    def shard(self) -> Range:
        """This rank's shard of the gradient, optimizer state (and ZeRO-3's parameters)."""
        return self.placement.sharded.shard

    @property
    def reduce_timings(self) -> dict[str, float]:
        """``reduce_method="auto"``: the times measured at attach, by method."""
        return self.reduction.method_timings if self.reduction is not None else {}

    @property
    def slots(self) -> list[Any]:
        """The bucket buffers the backward writes into (empty without hooks)."""
        return self.buckets.buffers
