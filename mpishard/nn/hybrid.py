"""[`HybridShardedModel`][mpishard.nn.hybrid.HybridShardedModel]: a model cut into
pipeline stages and tensor-parallel slices, for 3D parallelism.

Data, tensor and pipeline parallelism at once, in the ``tp-dp-pp`` rank order of
[`mpishard.topology`][mpishard.topology]. Each rank builds only its pipeline stage's layers, and
of those only its tensor-parallel slice; the data-parallel group then runs DDP,
ZeRO-2 or ZeRO-3 on that shard (the hybrid cores of
[`mpishard.parallel.hybrid`][mpishard.parallel.hybrid]) exactly as it would on a whole model.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
from collections.abc import Callable
from typing import Any

from ..config import ShardingConfiguration
from ..errors import TopologyError
from ..flat import ParameterShard, Range
from ..pipeline.executor import PipelineStage
from ..pipeline.partition import balance_stages, check_boundaries
from ..pipeline.schedules import SCHEDULES
from ..protocols import BACKWARD, FORWARD
from .shards import tensor_shards
from .stack import uninitialised_shards

__all__ = ["HybridShardedModel"]


class HybridShardedModel:
    """A model cut into pipeline stages and tensor-parallel slices.

    Args:
        model: a factory called as ``model(tp_comm=..., stage_layers=(start, stop))``
            that builds top-level layers ``[start, stop)`` of the model, split over
            the tensor group: [`GPT`][mpishard.nn.GPT] or
            [`ParallelMLP`][mpishard.nn.ParallelMLP] with their other arguments bound,
            e.g. ``functools.partial(GPT, 256, 64, 128, 4, 4)``. Every rank
            builds only its own part; nothing is replicated.
        config: the layout; built from the three sizes when not given.
        pipeline_parallel_size, tensor_parallel_size, data_parallel_size: the
            sizes (checked against ``config`` when both are given).
        micro_batches: micro-batches per optimizer step in the pipeline.
        schedule: ``"1f1b"`` (default) or ``"gpipe"``.
        stages: stage boundaries (``[0, 3, 7]`` or ``[(0, 3), (3, 7), (7, 10)]``);
            by default layers are balanced by parameter count.
        shard: build the stage in ZeRO-3 shards: this rank's
            [`ParameterShard`][mpishard.flat.ParameterShard] over the data-parallel
            group, ``ParameterShard(config.groups.dp.rank, config.groups.dp.size)``
            (the factory is given it as ``shard=``). Each rank then allocates and
            initialises only its shard of its (stage, tensor) slice, bit for bit
            that shard of the whole stage, at any layout; ``params`` and ``grads``
            are None until a ZeRO-3 hybrid strategy attaches it
            ([`HybridShardedOptimizer.build`][mpishard.strategies.hybrid.HybridShardedOptimizer.build]
            builds and attaches).

    It is a model (``params``, ``grads``, ``layout`` of this rank's shard;
    ``forward``; ``forward_backward`` runs the whole pipeline schedule and
    returns the step's mean loss on every rank) for the data-parallel group of
    [`HybridShardedOptimizer`][mpishard.strategies.hybrid.HybridShardedOptimizer]. Building is
    collective over ``config.comm``.

    Raises:
        TopologyError: sizes that do not divide the world or disagree with ``config``.
        ValueError: more stages than layers, bad boundaries, an unknown schedule,
            heads or widths not divisible by the tensor size, a ``shard`` that is
            not this rank's data-parallel shard (on every rank).
        TypeError: a factory that takes no ``tp_comm=``/``stage_layers=`` (or no
            ``shard=`` where ``shard`` is given) (on every rank).
    """

    def __init__(self, model: Callable[..., Any], config: ShardingConfiguration | None = None,
                 pipeline_parallel_size: int | None = None,
                 tensor_parallel_size: int | None = None,
                 data_parallel_size: int | None = None, *, micro_batches: int = 1,
                 schedule: str = "1f1b", stages: list | None = None,
                 shard: ParameterShard | None = None) -> None:
        if config is None:
            config = ShardingConfiguration(   # over MPI.COMM_WORLD
                tensor_parallel_size=tensor_parallel_size or 1,
                pipeline_parallel_size=pipeline_parallel_size or 1,
                data_parallel_size=data_parallel_size or -1)
        topo = config.topology
        _check_arguments(config, (pipeline_parallel_size, tensor_parallel_size,
                                  data_parallel_size), schedule, micro_batches, shard)
        self.config = config
        groups = config.groups
        self.tp = groups.tp
        self.pp = groups.pp
        self.micro_batches = int(micro_batches)
        self.schedule = schedule

        config.world.agree(_factory_problem(model, shard is not None), TypeError)
        #: Built in ZeRO-3 shards over the data group (this rank's), or None.
        self.shard = shard
        build = model if shard is None else functools.partial(model, shard=shard)
        # A one-layer probe tells the layer count and sizes without building the
        # model (collective over the tensor group, like every build); in shards,
        # only its shard of layer 0 (and a scratch of the layer).
        probe = build(tp_comm=self.tp, stage_layers=(0, 1))
        costs = [sum(math.prod(shape) for _, shape in layer.param_shapes())
                 for layer in probe.all_layers]
        ranges, problem = None, None
        try:
            ranges = (check_boundaries(stages, len(costs), topo.pp) if stages is not None
                      else balance_stages(costs, topo.pp))
        except ValueError as exc:
            problem = str(exc)
        config.world.agree(problem, ValueError)
        self.stage_ranges = ranges
        mine = ranges[self.pp.rank]
        if mine == (0, 1):
            self.stage_model = probe
        else:
            del probe      # its layer (or shard of it) freed before the stage is built
            self.stage_model = build(tp_comm=self.tp, stage_layers=mine)
        self.runner = PipelineStage(self.stage_model, self.pp, micro_batches, schedule)
        self._context: tuple[int, int, int] | None = None
        self._micro_hooks: tuple[Any, Any] = (None, None)   # set_micro_batch_hooks
        self._factory = model      # for rebuild()

    def rebuild(self, config: ShardingConfiguration) -> None:
        """Build this model again over ``config``, in place, keeping this rank's
        parameters: after a recovery that dropped whole replicas
        ([`mpishard.recovery.replicas.drop_replicas`][mpishard.recovery.replicas.drop_replicas]) the
        kept ranks have new groups but the same tensor and pipeline sizes, and each keeps its tensor
        coordinate and pipeline stage, so its parameters are still its own.
        Gradients start at zero. A stage whose parameters are sharded by ZeRO-3
        (``params`` None) is built again in shards over ``config``'s data group,
        nothing whole: the caller puts this rank's new shard in (the recovery
        moves it shard to shard) when it attaches it again. Collective over
        ``config.comm``.

        Raises:
            TopologyError: ``config`` has other tensor or pipeline sizes, or puts
                this rank at another tensor coordinate or stage (on every rank).
        """
        before = self.config.groups.coordinates
        topo, after = config.topology, config.groups.coordinates
        problem = None
        if (topo.tp, topo.pp) != (self.config.topology.tp, self.config.topology.pp):
            problem = (f"rebuild keeps tensor_parallel_size={self.config.topology.tp} and "
                       f"pipeline_parallel_size={self.config.topology.pp}, got {topo.tp} "
                       f"and {topo.pp}")
        elif (after.tp, after.pp) != (before.tp, before.pp):
            problem = (f"rebuild keeps each rank's tensor coordinate and stage: this rank "
                       f"had (tp, pp) = ({before.tp}, {before.pp}), the new layout gives "
                       f"({after.tp}, {after.pp})")
        config.world.agree(problem, TopologyError)
        # Under ZeRO-3 the stage holds no whole vector (params is None): built again
        # in shards; the caller hands the strategy the new shard.
        params = None if self.params is None else self.params.copy()
        dp = config.groups.dp
        shard = ParameterShard(dp.rank, dp.size) if params is None else None
        # The same stage boundaries (the balance would give them again; this is sure).
        with uninitialised_shards():   # in shards: the recovery moves the values in
            HybridShardedModel.__init__(self, self._factory, config,
                                        micro_batches=self.micro_batches, schedule=self.schedule,
                                        stages=list(self.stage_ranges), shard=shard)
        if params is not None:
            self.params[...] = params

    # -- the model protocol, for the data-parallel group ----------------------------
    @property
    def params(self) -> Any:
        return self.stage_model.params

    @property
    def grads(self) -> Any:
        return self.stage_model.grads

    @property
    def layout(self):
        return self.stage_model.layout

    @property
    def xp(self):
        return self.stage_model.xp

    @property
    def dtype(self) -> Any:
        """The parameters' dtype (the stage model's)."""
        return self.stage_model.dtype

    def built_shard(self) -> tuple[Range, Any] | None:
        """``(r, values)``: built in shards (``shard=``) and not attached yet, this
        rank's shard ``r`` of its stage's (tensor slice of the) vector; else None
        ([`BuiltInShards`][mpishard.protocols.BuiltInShards])."""
        return getattr(self.stage_model, "built_shard", lambda: None)()

    def forward(self, x: Any) -> Any:
        """Predictions for ``x`` on every rank. Collective over the pipeline and
        tensor groups."""
        return self.runner.forward(x)

    def forward_backward(self, x: Any, y: Any, *, accumulate: bool = False,
                         loss_scale: float = 1.0) -> float:
        """One pass of the pipeline schedule over this replica's batch ``(x, y)``;
        the mean loss on every rank. Gradients are the micro-batches' sum (of
        ``loss_scale`` times each one's mean loss: the last stage scales
        d(loss)/d(output)): the optimizer divides by ``micro_batches``.
        Collective over pipeline and tensor groups."""
        context, self._context = self._context, None
        before, after = self._micro_hooks
        return self.runner.run(x, y, accumulate=accumulate, context=context,
                               loss_scale=loss_scale, before_backward=before,
                               after_backward=after)

    def set_micro_batch_hooks(self, before_backward: Callable[[int], None] | None,
                              after_backward: Callable[[int], None] | None) -> None:
        """From now on every ``forward_backward`` calls ``before_backward(i)`` and
        ``after_backward(i)`` around micro-batch ``i``'s backward, and no backward
        accumulates: between the two the stage's gradient (its views) holds
        micro-batch ``i``'s alone. Hybrid ZeRO-3 hands each micro-batch's
        gradient over to its shards so (``stage_gradient="sharded"``). ``None``
        for both: off, the micro-batches summed in the stage's gradient. Local."""
        self._micro_hooks = (before_backward, after_backward)

    def set_batch_context(self, step: int, start: int, global_size: int) -> None:
        self._context = (step, start, global_size)

    def forward_backward_units(self, xs: list[Any], ys: list[Any], losses: Any, *,
                               contexts: list[tuple[int, int, int]] | None = None,
                               loss_scale: float = 1.0,
                               before_backward: Callable[[int], None] | None = None,
                               after_backward: Callable[[int], None] | None = None) -> None:
        """Reproducible mode's units as the micro-batches of one pass of the
        schedule (at most ``micro_batches``), each unit's gradient alone between
        ``after_backward(i)`` and the next ``before_backward``; their mean losses
        into ``losses`` on every rank (a [`UnitPassModel`][mpishard.protocols.UnitPassModel]).
        ``contexts[i]``: unit ``i``'s ``(step, first row, global batch)``.
        Collective over pipeline and tensor groups."""
        self.runner.run_units(xs, ys, losses, contexts=contexts, loss_scale=loss_scale,
                              before_backward=before_backward, after_backward=after_backward)

    # The ShardableModel protocol, the stage model's: ZeRO-3 over the data group
    # gathers the stage's parameters a bucket at a time in every pass of the schedule.
    def bind_parameters(self, view: Callable[[str], Any], params: Any = None) -> None:
        self.stage_model.bind_parameters(view, params)

    def set_parameter_hooks(self, hooks: Any) -> None:
        self.stage_model.set_parameter_hooks(hooks)

    def passes(self) -> list[str]:
        """The phases of the parameter passes one ``forward_backward`` makes on
        this stage, in order (the schedule's forwards and backwards)."""
        return [FORWARD if kind == "F" else BACKWARD for kind, _ in self.runner.actions]

    def tensor_shards(self):
        return tensor_shards(self.stage_model)

    # A DescribedModel, so checkpoints record (and compare on load) the architecture:
    # every stage's model records the whole logical model, the same on every rank.
    def architecture(self) -> dict[str, Any] | None:
        return getattr(self.stage_model, "architecture", lambda: None)()

    def training_metadata(self) -> dict[str, Any] | None:
        return None

    def describe(self) -> dict[str, Any]:
        """Where this rank sits and what it holds."""
        c = self.config.groups.coordinates
        return {"dp_rank": c.dp, "tp_rank": c.tp, "pp_rank": c.pp,
                "stage_layers": list(self.stage_model.stage_layers),
                "stage_ranges": [list(r) for r in self.stage_ranges],
                "parameters": int(self.layout.size), "schedule": self.schedule,
                "micro_batches": self.micro_batches}



def _check_arguments(config: ShardingConfiguration, sizes: tuple[Any, Any, Any],
                     schedule: str, micro_batches: Any, shard: ParameterShard | None) -> None:
    """``HybridShardedModel``'s arguments against ``config``: a TopologyError for
    sizes ``(pp, tp, dp)`` that contradict it, a ValueError for a bad schedule,
    micro-batch count or shard; on every rank. Collective over ``config.world``."""
    topo = config.topology
    asked = {"pipeline_parallel_size": (sizes[0], topo.pp),
             "tensor_parallel_size": (sizes[1], topo.tp),
             "data_parallel_size": (sizes[2], topo.dp)}
    clash = [f"{k}={a} but the configuration has {b}" for k, (a, b) in asked.items()
             if a not in (None, -1, b)]
    config.world.agree("; ".join(clash) or None, TopologyError)
    problem = None
    if schedule not in SCHEDULES:
        problem = (f"unknown pipeline schedule {schedule!r}: choose one of "
                   f"{', '.join(SCHEDULES)}")
    elif (not isinstance(micro_batches, numbers.Integral) or isinstance(micro_batches, bool)
          or micro_batches < 1):
        problem = f"micro_batches must be a positive integer, got {micro_batches!r}"
    dp = config.groups.dp
    if problem is None and shard is not None and \
            (shard.rank, shard.ranks) != (dp.rank, dp.size):
        problem = (f"shard=ParameterShard({shard.rank}, {shard.ranks}) but this rank is "
                   f"data-parallel rank {dp.rank} of {dp.size}: pass "
                   f"ParameterShard({dp.rank}, {dp.size})")
    config.world.agree(problem, ValueError)

def _factory_problem(factory: Callable[..., Any], sharded: bool = False) -> str | None:
    """Why ``factory`` cannot build a stage of a tensor group (in ZeRO-3 shards where
    ``sharded``), or None (or when its signature cannot be read)."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    missing = [k for k in ("tp_comm", "stage_layers") + (("shard",) if sharded else ())
               if k not in params]
    if not missing:
        return None
    name = getattr(getattr(factory, "func", factory), "__name__", repr(factory))
    hint = "; for an MLP use ParallelMLP (the same model, split)" if name == "MLP" else ""
    need = "tp_comm=, stage_layers= and shard=" if sharded else "tp_comm= and stage_layers="
    return (f"the model factory must take {need} (GPT or ParallelMLP, "
            f"other arguments bound with functools.partial); {name} takes no "
            f"{' and no '.join(missing)}{hint}")
