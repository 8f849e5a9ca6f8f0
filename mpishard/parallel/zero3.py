"""``ZeRO3Core``: parameters, gradients and optimizer state sharded over the data group."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from ..comm import FlatComm
from ..comm.gather import ParameterGather
from ..flat import ParameterShard
from ..protocols import Model, ShardableModel
from .options import ZeRO3Options
from .placement import GatheredAfterStep, GatheredBeforeUse, Placement
from .sharded import ShardedCore

__all__ = ["ZeRO3Core", "ZeRO3Options"]

M = TypeVar("M")


class ZeRO3Core(ShardedCore):
    """ZeRO stage 3: a gradient [`ReducedToShards`][mpishard.parallel.reduction.ReducedToShards]
    and parameters [`GatheredBeforeUse`][mpishard.parallel.placement.GatheredBeforeUse]:
    each data-parallel rank keeps 1/N of the parameters too.

    Gradients and optimizer state are ZeRO-2's (each bucket reduced to the
    shards during the backward, the optimizer on the shard). The parameters live
    only as this rank's shard (``parameter_shard``). A
    [`ShardableModel`][mpishard.protocols.ShardableModel] (the library's models)
    reads its parameters from a few bucket-sized buffers, each gathered from
    every rank's shard just before its layers run (the next one gathering
    meanwhile, ``prefetch``); nothing is gathered after the step.

    A model without those hooks (a [`FunctionModel`][mpishard.nn.FunctionModel],
    a user's model) gets ZeRO-2's placement at attach
    ([`GatheredAfterStep`][mpishard.parallel.placement.GatheredAfterStep]: its
    whole vector, ``Allgatherv``-ed after the update); only its gradients and
    state are sharded. So does a model without parameters (a pipeline stage of
    activations only): its empty vector is all there is.

    While a model is attached, its ``params`` is None and its ``forward`` is
    collective over ``groups.dp`` (every rank gathers each bucket):
    ``gathered_parameters`` gives the whole vector for a while,
    ``unshard`` for good.

    Args and options: [`DataParallelCore`][mpishard.parallel.base.DataParallelCore]'s,
    and [`ZeRO3Options`][mpishard.parallel.options.ZeRO3Options] (ZeRO-2's,
    ``prefetch``, ``keep_gathered``, ``gather_mb``).
    """

    strategy = "zero3"
    public = "ZeRO3Optimizer"
    takes_built_shards = True

    Options = ZeRO3Options

    def parameter_shard_spec(self) -> ParameterShard:
        """This rank's [`ParameterShard`][mpishard.flat.ParameterShard] over
        ``groups.dp``: what a model built in shards for this core is given. Local."""
        return ParameterShard(self.dp.rank, self.dp.size)

    def build(self, model_class: Callable[..., M], *args: Any, **kwargs: Any) -> M:
        """``model_class(*args, shard=parameter_shard_spec(), **kwargs)``, attached:
        each rank allocates and initialises only its shard of the parameters
        (the same bits as the whole model built with the same arguments and
        attached, at any number of ranks). Every rank passes the same arguments.
        Collective over ``groups.dp``.

        Raises:
            TypeError: ``model_class`` takes no ``shard=`` (a model that brings
                its own vector: build it and ``attach`` it), or ``attach``'s.
        """
        model = model_class(*args, shard=self.parameter_shard_spec(), **kwargs)
        self.attach(model)
        return model

    def _new_placement(self, model: Model, shard: Any = None) -> Placement:
        """Gathered before use where the model has parameter hooks and parameters,
        else gathered after the step (ZeRO-2's). Collective over ``groups.dp``."""
        sharded = self._sharded_state()
        if not isinstance(model, ShardableModel) or self.layout.size == 0:
            return GatheredAfterStep(model, self.dp, self.xp, sharded)
        gather = self.options.gather_elements(self.layout.size, self.dtype.itemsize,
                                              self.dp.size)
        return GatheredBeforeUse(model, self.dp, self.xp, sharded, gather_elements=gather,
                                 prefetch=self.prefetch, keep=self.keep_gathered,
                                 shard=shard)

    def attach(self, model: Model) -> None:
        """As [`DataParallelCore.attach`][mpishard.parallel.base.DataParallelCore.attach]
        (the whole vector taken from rank 0), then keep only this rank's shard: a
        [`ShardableModel`][mpishard.protocols.ShardableModel] is bound to the
        gather buffers and its ``params`` becomes None. A model built in shards
        ([`build`][mpishard.parallel.zero3.ZeRO3Core.build]) hands its shard over
        as it is: nothing whole is made. Collective over ``groups.dp``.

        Raises:
            TypeError: not a model (a model whose ``params`` is None is sharded
                by a ZeRO-3 strategy already: ``unshard`` it there), or
                parameters that are not float32/float64 1-D arrays (on every rank).
            MpiShardError: the parameter count or dtype differs between ranks.
        """
        super().attach(model)

    def unshard(self, params: Any = None) -> None:
        """Give the model its whole parameter vector back and stop gathering:
        ``params`` (a whole vector, the same on every rank; local), or gathered
        from the shards (collective over ``groups.dp``). The core then trains the
        model as ZeRO-2 does, until ``attach`` or ``rebuild`` shards it
        again; another strategy may attach it."""
        self._require_model()
        self.placement = self.placement.unshard(params)

    @property
    def gather(self) -> ParameterGather | None:
        """The parameter buckets and their gathers (None: a model without hooks)."""
        return self.placement.gather if self.placement is not None else None

    @property
    def gather_comm(self) -> FlatComm | None:
        """The gathers' communicator: a duplicate of ``groups.dp`` (None: no gathers)."""
        return self.placement.comm if self.placement is not None else None
