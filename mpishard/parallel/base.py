"""The data-parallel core: a gradient reduction and a parameter placement, composed.

[`DataParallelCore`][mpishard.parallel.base.DataParallelCore] runs the loop
(attach, micro-batches, the step's totals, clipping, the non-finite policy, the
learning-rate schedule); its two parts do the rest: a
[gradient reduction][mpishard.parallel.reduction] (allreduce, or reduce to
shards) and a [parameter placement][mpishard.parallel.placement] (replicated;
sharded and gathered after the step; sharded and gathered before use). DDP,
ZeRO-2 and ZeRO-3 ([`DDPCore`][mpishard.parallel.ddp.DDPCore],
[`ZeRO2Core`][mpishard.parallel.zero2.ZeRO2Core],
[`ZeRO3Core`][mpishard.parallel.zero3.ZeRO3Core]) each name their two parts.

The rest of the core lives beside it: the step's totals
([`totals`][mpishard.parallel.totals]), reproducible mode's sums
(``parallel/repro.py``), the options ([`options`][mpishard.parallel.options]),
where training is ([`progress`][mpishard.parallel.progress]), the checks and calls
of the model ([`attach`][mpishard.parallel.attach]), the parts' state read
through the core ([`reads`][mpishard.parallel.reads]), time and memory
([`accounting`][mpishard.parallel.accounting]) and the answers to a recovery
([`answers`][mpishard.parallel.answers]).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from typing import Any

from ..backend import array_namespace
from ..comm import FlatComm, stuck
from ..config import ShardingConfiguration
from ..errors import TopologyError
from ..flat import Range, shard_ranges
from ..optim.clip import clip_coefficient
from ..protocols import BACKWARD, FORWARD, BucketedModel, Model, Optimizer, built_shard_of
from .accounting import Accounting
from .answers import RecoveryAnswers
from .attach import ModelCalls, check_model, own_gradient
from .options import NONFINITE_POLICIES, DataParallelOptions, OptionsHome
from .placement import Placement
from .progress import Progress
from .reads import PartReads
from .reduction import GradientReduction
from .repro import ReproducibleStep
from .totals import StepSums, StepTotals

__all__ = ["NONFINITE_POLICIES", "DataParallelCore", "DataParallelOptions"]


class DataParallelCore(OptionsHome, Progress, PartReads, Accounting, RecoveryAnswers):
    """Base of the data-parallel strategy cores; not used directly.

    A subclass names its two parts (``_new_reduction``: a
    [gradient reduction][mpishard.parallel.reduction]; ``_new_placement``: a
    [parameter placement][mpishard.parallel.placement]); this class runs the
    micro-batches and the step over them and the step's
    [`StepTotals`][mpishard.parallel.totals.StepTotals]. The public classes of
    ``mpishard.strategies`` add the training loop.

    The mean is over rows, not ranks: each micro-batch's gradient is weighted
    by its row count (through the model's ``loss_scale``), and ``step()``
    divides by the global row count, so ranks and micro-batches of any sizes,
    zero included, give exactly the gradient of the global batch's mean loss.

    Args:
        optimizer: the update rule ([`mpishard.optim`][mpishard.optim]).
        config: the layout (``ShardingConfiguration()`` over ``MPI.COMM_WORLD``
            when None).
        model: attach at once (otherwise ``attach`` or ``optimize`` does).
        **options: the fields of ``Options`` (their one home: ``options``,
            [`OptionsHome`][mpishard.parallel.options.OptionsHome])
            ([`DataParallelOptions`][mpishard.parallel.base.DataParallelOptions]
            and the subclass's own).

    Raises:
        TypeError: not an optimizer, or an unknown option (on every rank).
        ValueError: an option out of range (on every rank).
        TopologyError: a layout with tensor or pipeline parallelism (use the
            hybrid strategy).
    """

    #: Human-readable name, written into checkpoints and reports.
    strategy = "data-parallel"
    #: The public class (``mpishard.strategies``) built on this core.
    public = "DataParallelCore"
    #: The options dataclass of this core.
    Options: type[DataParallelOptions] = DataParallelOptions
    #: Subclasses that hold a tensor/pipeline shard of the model set this.
    _model_parallel = False
    #: Extra factor on the summed gradient (a pipeline's 1 / micro-batches).
    _gradient_factor = 1.0
    #: This rank adds its rows and loss to the step's totals (one rank per model replica).
    _counts_rows = True
    #: Attaches a model built in shards ([`BuiltInShards`][mpishard.protocols.BuiltInShards]):
    #: its parameters stay sharded (ZeRO-3).
    takes_built_shards = False

    def __init__(self, optimizer: Optimizer, config: ShardingConfiguration | None = None, *,
                 model: Model | None = None, **options: Any) -> None:
        config = config if config is not None else ShardingConfiguration()
        world = config.world
        world.agree(None if isinstance(optimizer, Optimizer) else
                    f"expecting a gradient optimizer with init_state() and update() "
                    f"(mpishard.optim.SGD, Adam, AdamW), got {type(optimizer).__name__}",
                    TypeError)
        self._take_options(world, self.public, options)
        self.optimizer = optimizer
        self._start_progress()
        self._start_accounting()
        self.last_grad_norm = float("nan")
        self.model: Model | None = None
        #: The parameters' dtype (None before attach).
        self.dtype: Any = None
        #: The two parts (None before attach).
        self.reduction: GradientReduction | None = None
        self.placement: Placement | None = None
        self._over(config)
        if model is not None:
            self.attach(model)

    # --- groups ----------------------------------------------------------------------
    def _over(self, config: ShardingConfiguration) -> None:
        """Take ``config``'s groups, with no model attached and no step in progress."""
        topo = config.topology
        if topo.tp * topo.pp != 1 and not self._model_parallel:
            config.world.agree(
                f"{self.public} runs every layer whole on every rank, but the layout has "
                f"tensor_parallel_size={topo.tp} and pipeline_parallel_size={topo.pp}; "
                f"use HybridShardedOptimizer for tensor or pipeline parallelism",
                TopologyError)
        self.config = config
        self.dp = config.groups.dp
        #: This step's micro-batches so far, and the step's reduction of them.
        self.totals = StepTotals()
        self._no_sync = False
        # Reproducible mode's units and binned sums (config.reproducible), made at attach.
        self._repro: ReproducibleStep | None = None

    # --- setting up: the two parts ---------------------------------------------------
    def _new_reduction(self) -> GradientReduction:
        """This core's gradient reduction (made at attach)."""
        raise NotImplementedError

    def _new_placement(self, model: Model, shard: Any = None) -> Placement:
        """This core's parameter placement for ``model`` (made at attach, after the
        reduction, every replica holding rank 0's parameters); ``shard``: this
        rank's shard where the parameters stay sharded (ZeRO-3: built in shards,
        or moved there by a recovery), kept as its store."""
        raise NotImplementedError

    def attach(self, model: Model) -> None:
        """Check ``model``, make every replica start from rank 0's parameters and
        set up the two parts. A model built in shards
        ([`BuiltInShards`][mpishard.protocols.BuiltInShards], ZeRO-3 only) starts
        from the shards it holds. Collective over ``groups.dp`` (the world for a
        3D layout).

        Raises:
            TypeError: not a model, or parameters that are not float32/float64
                1-D arrays (on every rank).
            ValueError: built in shards for a core that needs the whole vector,
                or with another rank's shard (on every rank).
            MpiShardError: the parameter count or dtype differs between ranks.
        """
        if self.config.is_spare:   # a waiting spare: attached when it is promoted
            self.model = model
            return
        self._attach(model, None)

    def _attach(self, model: Model, shard: Any, agreed: bool = False) -> None:
        """``attach``; a model gathered before use whose ``params`` is None keeps
        ``shard`` (this rank's shard, ``rebuild``'s after a recovery): nothing is
        whole. ``agreed``: the ranks hold the same parameters (no ``Bcast``)."""
        started = time.perf_counter()
        built = built_shard_of(model)   # (range, values): built in shards, nothing whole
        if shard is not None:           # a recovery's: this rank's shard under config
            built = (shard_ranges(model.layout.size, self.dp.size)[self.dp.rank], shard)
        opened = self.memory_phases.enter("attach")
        values = check_model(self.dp, model, built)
        self.dp.agree(self._built_problem(model, built), ValueError)
        self._release()   # attached before
        self.model, self.xp = model, array_namespace(values)
        self.dtype, self.layout = values.dtype, model.layout
        self._calls = calls = ModelCalls(model)
        #: The model takes ``set_batch_context`` (dropout's rows of the global batch).
        self.sets_batch_context = calls.sets_batch_context
        reduction = self._new_reduction()
        #: overlap="auto" or "measure": how it was decided (.overlap.decide_overlap).
        self.overlap_timings: dict[str, Any] = {}
        self.buckets = reduction.plan_buckets(model, self.xp, self.options, calls.scales_loss,
                                              self._step_group(), self.overlap_timings,
                                              dtype=self.dtype)
        #: The buckets are reduced during the backward (``overlap`` resolved).
        self.bucketed = reduction.bucketed
        #: The gradient bucket size in elements (``bucket_mb`` resolved).
        self.bucket_elements = reduction.bucket_elements
        if built is None and not agreed:   # built in shards: the seed's already
            self.dp.Bcast(model.params, root=0)
        # A reduction whose buckets are slots binds the model's gradient to them.
        binds = self.bucketed and reduction.slots > 0
        if model.grads is None and isinstance(model, BucketedModel) and not binds:
            own_gradient(model, self.xp, self.dtype)
        reduction.attach(model, self.xp, self.buckets, self.bucketed, calls.accumulates,
                         self.totals.check_local, dtype=self.dtype)
        self.reduction = reduction
        self._setup()
        self._repro = ReproducibleStep(self) if self.config.reproducible else None
        #: What sums the step: the reduction, or reproducible mode's binned sums.
        self._sums: StepSums = self._repro if self._repro is not None else reduction
        self.totals.setup(self._step_group(), self.dp,
                          reduction.norm_pieces(self._owned_ranges()), reduction.norm_vector,
                          self.xp, self._counts_rows,
                          self._repro.extra if self._repro is not None else 0)
        self.placement = self._new_placement(model, None if built is None else built[1])
        self._attached(whole=model.params is not None)
        self.memory_phases.leave(opened)
        #: Seconds the last attach took on this rank (the run header prints it).
        self.attach_seconds = time.perf_counter() - started

    def _setup(self) -> None:
        """After the reduction is set up (a hybrid core's pipeline factors)."""

    def _built_problem(self, model: Model, built: tuple[Range, Any] | None) -> str | None:
        """Why this core cannot take ``model``, built in shards, or None."""
        if built is None:
            return None
        if not self.takes_built_shards:
            return (f"the model was built in ZeRO-3 shards (it holds elements "
                    f"[{built[0].start}, {built[0].stop}) of {model.layout.size}); "
                    f"{self.public} needs the whole vector: build it without shard=")
        mine = shard_ranges(model.layout.size, self.dp.size)[self.dp.rank]
        if built[0] != mine:
            return (f"the model was built with the shard [{built[0].start}, {built[0].stop}) "
                    f"of its {model.layout.size} parameters, but data-parallel rank "
                    f"{self.dp.rank} of {self.dp.size} holds [{mine.start}, {mine.stop}): "
                    f"build it with shard=ParameterShard({self.dp.rank}, {self.dp.size})")
        return None

    # --- one step ----------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients of the ``backward`` calls inside without communicating."""
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = False

    def backward(self, x: Any, y: Any, *, batch_start: int | None = None,
                 global_rows: int | None = None) -> float:
        """Forward and backward on this rank's micro-batch; returns its local mean
        loss. Gradients accumulate until ``step``, each weighted by its rows
        (ranks and micro-batches of any sizes, zero included, give the mean over
        the global batch). ``batch_start`` and ``global_rows`` (both or neither)
        place the rows in the global batch for random layers (without them:
        every rank and micro-batch is taken to have ``len(x)`` rows). Collective
        over ``groups.dp`` (every rank calls it the same number of times).

        Raises:
            ValueError: only one of ``batch_start`` and ``global_rows`` is given.
        """
        model = self._require_model()
        if self.totals.micro == 0:   # this rank makes progress: its watchdog starts again
            stuck.watch(self.dp.timeout)
            self.memory_phases.begin("step")
        if (batch_start is None) != (global_rows is None):
            raise ValueError(f"give both batch_start and global_rows or neither, got "
                             f"batch_start={batch_start!r}, global_rows={global_rows!r}")
        waited = self.placement.waited()
        if self._repro is not None:
            loss = self._repro.backward(x, y, batch_start, global_rows,
                                        self._replay if self.placement.lockstep else None)
        else:
            loss = self._backward(model, x, y, batch_start, global_rows)
        # Waiting for parameter gathers is communication, not the model's compute
        # (counted in forward_backward so far).
        waited = self.placement.waited() - waited
        self.timings["gather"] += waited
        self.timings["forward_backward"] -= waited
        return loss

    def _backward(self, model: Model, x: Any, y: Any, batch_start: int | None,
                  global_rows: int | None) -> float:
        """One micro-batch through the reduction (the default mode)."""
        micro, rows = self.totals.micro, len(x)
        self.buckets.seconds = 0.0
        t0 = time.perf_counter()
        if rows:
            if self.sets_batch_context:
                self._calls.batch_context(model, self.step_count, micro, rows, batch_start,
                                          global_rows, self.dp, self.accumulation_steps)
            loss = self.reduction.backward(
                micro, lambda accumulate: self.run_model(model, x, y, accumulate, rows),
                self._no_sync)
        else:
            loss = 0.0
            self.reduction.skip(micro, self._replay if self.placement.lockstep else None,
                                self._no_sync)
        comm = self.buckets.seconds
        self.timings["forward_backward"] += time.perf_counter() - t0 - comm
        self.timings["communication"] += comm
        self.totals.add(rows, loss)
        return loss

    def _replay(self) -> None:
        """The parameter placement's hook calls of the model's passes, without a model."""
        self.placement.replay(self._passes(), self.buckets if self.bucketed else None)

    def _passes(self) -> list[str]:
        """The phases of the parameter passes of one ``forward_backward``."""
        return [FORWARD, BACKWARD]

    def step(self) -> float:
        """Reduce what is left, check, clip, update; return the global mean loss
        over every row of the micro-batches since the last step. One small
        ``Allreduce`` carries the totals
        ([`StepTotals`][mpishard.parallel.totals.StepTotals]: loss, rows, the
        sum of squares, non-finite flags); a non-finite loss or norm updates
        nothing (``nonfinite``). Collective over ``groups.dp`` (the world for
        hybrid layouts).

        Raises:
            NonFiniteError: (``nonfinite="error"``) on every rank, naming the step
                and the first rank where a non-finite local loss or gradient
                appeared; parameters and optimizer state are left unchanged.
            ValueError: no rank had any rows since the last step (on every rank).
        """
        totals = self.totals
        if totals.micro == 0:
            raise RuntimeError("step() called before backward(): there are no gradients")
        clipping = self.max_grad_norm is not None
        communicated, local = totals.reduce_with(self._sums, clipping)
        self.timings["communication"] += communicated
        t0 = time.perf_counter()
        loss, norm, scale = totals.mean(self._gradient_factor)
        if clipping:
            self.last_grad_norm = norm
        if not (math.isfinite(loss) and math.isfinite(norm)):
            # Every rank holds the same reduced totals: every rank takes this branch.
            if self.nonfinite != "skip":
                raise totals.refusal(self.step_count + 1, loss, norm)
            self.set_progress(skipped_steps=self.skipped_steps + 1)
            self.timings["optimizer"] += local + (time.perf_counter() - t0)
            return loss
        # Not min(1, ...): the norm is finite here, and clip_coefficient never hides NaN.
        coefficient = clip_coefficient(norm, self.max_grad_norm) if clipping else 1.0
        self._step_count += 1
        placement = self.placement
        placement.update(self.optimizer, self.reduction.gradient(placement.owned()),
                         self._step_count, self.current_lr(), scale * coefficient)
        t1 = time.perf_counter()
        self.timings["optimizer"] += local + (t1 - t0)
        placement.after_step()
        self.timings["gather"] += time.perf_counter() - t1
        return loss

    def train_step(self, x: Any, y: Any) -> float:
        """One optimizer step on this rank's local batch, split into
        ``accumulation_steps`` micro-batches (as evenly as the rows allow; a
        batch may have any number of rows, zero included). Returns the global
        mean loss. Collective over ``groups.dp``.
        """
        m, n = self.accumulation_steps, len(x)
        for k in range(m):
            lo, hi = k * n // m, (k + 1) * n // m
            self.backward(x[lo:hi], y[lo:hi])
        return self.step()

    def current_lr(self) -> float:
        """The learning rate of the current step, schedule applied."""
        factor = self.schedule(max(self.step_count, 1)) if self.schedule is not None else 1.0
        return self.optimizer.lr * factor

    def run_model(self, model: Model, x: Any, y: Any, accumulate: bool, rows: int) -> float:
        """The model's forward and backward, its gradient weighted by ``rows``
        ([`ModelCalls.run`][mpishard.parallel.attach.ModelCalls.run])."""
        return self._calls.run(model, x, y, accumulate, rows)

    # --- how the norm's share is cut (hybrid cores count each tensor slice once) ------
    def _step_group(self) -> FlatComm:
        """The group the step's totals are reduced over."""
        return self.dp

    def _owned_ranges(self) -> list[Range]:
        """World ranges of the model's vector whose squares this rank's replica
        counts in the norm (all of it; a tensor-parallel rank owns less)."""
        return [Range(0, self.layout.size)]
