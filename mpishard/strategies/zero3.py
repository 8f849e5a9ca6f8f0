"""``ZeRO3Optimizer``: parameters, gradients and optimizer state sharded over the data group."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from ..config import ShardingConfiguration
from ..parallel import ZeRO3Core
from ..protocols import Model, Optimizer
from .base import Strategy

__all__ = ["ZeRO3Optimizer"]

M = TypeVar("M")


class ZeRO3Optimizer(Strategy):
    """ZeRO stage 3: each data-parallel rank keeps ``1/N`` of the parameters, of
    the reduced gradient and of the optimizer state; a layer's parameters are
    gathered (``Iallgatherv``, a bucket at a time, the next one prefetched) just
    before it runs in the forward and again in the backward, and the update
    leaves them sharded ([`ZeRO3Core`][mpishard.parallel.ZeRO3Core]).

    The library's models ([`mpishard.nn`][mpishard.nn], and
    [`HybridShardedModel`][mpishard.nn.hybrid.HybridShardedModel] through
    ``HybridShardedOptimizer(data_parallel="zero3")``) read their parameters
    through hooks the strategy sets; a model without them (a
    [`FunctionModel`][mpishard.nn.FunctionModel], your own) keeps its whole vector and is
    trained as ZeRO-2 trains it. A library model can be built in shards,
    never whole on any rank: [`build`][mpishard.strategies.zero3.ZeRO3Optimizer.build].
    While attached, a library model's ``params`` is
    None and its ``forward`` is collective over ``groups.dp``: use
    [`gathered_parameters`][mpishard.strategies.base.Strategy.gathered_parameters] or
    [`unshard`][mpishard.strategies.zero3.ZeRO3Optimizer.unshard] to read it on one rank.

    Args:
        optimizer: the update rule ([`mpishard.optim`][mpishard.optim]).
        config: the layout (``ShardingConfiguration()`` when None); data parallel
            over ``config.groups.dp``.
        model: attach at once (otherwise [`attach`][mpishard.strategies.base.Strategy.attach] or
            [`optimize`][mpishard.strategies.base.Strategy.optimize] does).
        **options: [`ZeRO3Options`][mpishard.parallel.ZeRO3Options] (those of ZeRO-2, and
            ``prefetch``, ``keep_gathered``, ``gather_mb``).

    Building it is collective over ``config.world``.
    """

    def __init__(self, optimizer: Optimizer, config: ShardingConfiguration | None = None, *,
                 model: Model | None = None, **options: Any) -> None:
        super().__init__(ZeRO3Core(optimizer, config, model=model, **options))

    def build(self, model_class: Callable[..., M], *args: Any, **kwargs: Any) -> M:
        """Build ``model_class(*args, **kwargs)`` in shards and attach it: each rank
        allocates and initialises only its shard of the parameters, bit for bit
        the shard of the whole model built with the same arguments, at any
        number of ranks; its peak is the shard and about one layer. For
        [`MLP`][mpishard.nn.MLP], [`GPT`][mpishard.nn.GPT],
        [`Sequential`][mpishard.nn.Sequential] and any
        [`LayerStack`][mpishard.nn.LayerStack] (a class that passes ``shard=`` on
        to it). Collective over ``groups.dp``.

        ```python
        zero3 = ZeRO3Optimizer(AdamW(lr=3e-4), config)
        model = zero3.build(GPT, 50257, 1024, 768, 12, 12, dtype=np.float32, seed=1)
        ```

        Raises:
            TypeError: ``model_class`` takes no ``shard=`` (a model that brings
                its own vector: build it whole and ``attach`` it).
        """
        return self.core.build(model_class, *args, **kwargs)

    def unshard(self, params: Any = None) -> None:
        """Give the model its whole parameter vector back for good (``params``, or
        gathered: collective over ``groups.dp``); training goes on as ZeRO-2."""
        self.core.unshard(params)
