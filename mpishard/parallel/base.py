"""The data-parallel core: a gradient reduction and a parameter placement, composed.

[`DataParallelCore`][mpishard.parallel.base.DataParallelCore] runs the loop
(checks at attach, micro-batches, the step's totals, clipping, the non-finite
policy, the learning-rate schedule); its two parts do the rest: a
[gradient reduction][mpishard.parallel.reduction] (allreduce, or reduce to
shards) and a [parameter placement][mpishard.parallel.placement] (replicated;
sharded and gathered after the step; sharded and gathered before use). DDP,
ZeRO-2 and ZeRO-3 ([`DDPCore`][mpishard.parallel.ddp.DDPCore],
[`ZeRO2Core`][mpishard.parallel.zero2.ZeRO2Core],
[`ZeRO3Core`][mpishard.parallel.zero3.ZeRO3Core]) each name their two parts.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ..backend import array_namespace
from ..comm import FlatComm, stuck
from ..comm.buckets import GradientBuckets
from ..config import ShardingConfiguration
from ..errors import CommunicationError, MpiShardError, TopologyError
from ..flat import Range, bucket_ranges
from ..optim.clip import clip_coefficient
from ..protocols import BACKWARD, FORWARD, BucketedModel, Model, Optimizer
from .memory import PhaseMemory
from .options import NONFINITE_POLICIES, DataParallelOptions, OptionsHome
from .overlap import decide_overlap
from .placement import Placement
from .progress import Progress
from .reduction import GradientReduction
from .repro import ReproducibleStep
from .totals import StepTotals

__all__ = ["NONFINITE_POLICIES", "DataParallelCore", "DataParallelOptions"]

_FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


class DataParallelCore(OptionsHome, Progress):
    """Base of the data-parallel strategy cores; not used directly.

    A subclass names its two parts (``_new_reduction``: a
    [gradient reduction][mpishard.parallel.reduction]; ``_new_placement``: a
    [parameter placement][mpishard.parallel.placement]);
    this class owns the checks, the micro-batch bookkeeping
    ([`StepTotals`][mpishard.parallel.totals.StepTotals]), learning-rate
    schedule, clipping and the non-finite policy. The public classes of
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
        self.last_grad_norm = float("nan")
        self.timings = {"forward_backward": 0.0, "communication": 0.0,
                        "optimizer": 0.0, "gather": 0.0}
        self._peak_bytes = 0
        #: The peaks of each phase (attach, step, save, ...: ``memory_report``).
        #: (Through a weak reference: a cycle would keep a dropped core's arrays
        #: until the garbage collector runs, in another core's step loop.)
        self.memory_phases = PhaseMemory(functools.partial(_held_bytes, weakref.ref(self)))
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

    def rebuild(self, config: ShardingConfiguration) -> None:
        """Set this core up again over ``config``'s groups (after a lost rank: the
        survivors'), keeping the optimizer, every option and the attached model; a
        model whose parameters are gathered before use gets its whole vector back
        first (gathered over the old ``groups.dp``: unshard it with the values
        where that group is broken). The optimizer state starts from zero (the
        caller puts it back), the step count and data position stay. Collective
        over ``config.world`` (and the old ``groups.dp``)."""
        model = self.model
        opened = self.memory_phases.enter("recovery")
        if model is not None and model.params is None:   # gathered before use
            self.placement = self.placement.unshard()
        self._release()
        self._over(config)
        self.model = None
        if model is not None:
            self.attach(model)
        self.memory_phases.leave(opened)

    def _release(self) -> None:
        """Free what the parts made on the old groups."""
        for part in (self.reduction, self.placement):
            if part is not None:
                part.release()

    def communicators(self) -> list[FlatComm]:
        """Every communicator this core and its model wait on: the world, the data,
        tensor and pipeline groups, the step's group and the parts' own (a
        two-level or ring reduction's, ZeRO-3's gathers'). For a recovery to
        revoke. Local."""
        groups = self.config.groups
        found = [groups.world, groups.dp, groups.tp, groups.pp]
        if self.totals.group is not None:
            found.append(self.totals.group)
        for part in (self.reduction, self.placement):
            if part is not None:
                found.extend(part.communicators())
        unique: list[FlatComm] = []
        for comm in found:
            if all(comm is not seen for seen in unique):
                unique.append(comm)
        return unique

    # --- after a lost rank: what a recovery asks ------------------------------------
    #: A lost rank takes its whole model replica with it (a 3D layout): the
    #: recovery drops replicas ([`mpishard.recovery.replicas`][mpishard.recovery.replicas])
    #: instead of rebuilding over every survivor.
    drops_replicas = False

    def recovery_problem(self) -> str | None:
        """Why this core cannot be rebuilt over the survivors of a lost rank, or None.
        Local."""
        topo = self.config.topology
        if topo.tp * topo.pp != 1:
            return (f"the layout has tensor_parallel_size={topo.tp} and "
                    f"pipeline_parallel_size={topo.pp}: the lost rank held a piece of the "
                    f"model that no survivor has")
        if self.model is None:
            return f"in-place recovery needs an attached model, {self.public} has none"
        return None

    def whole_parameters(self, params: Any) -> None:
        """Give the model the whole vector ``params`` (the same on every rank: what
        the survivors put together), without gathering over the possibly broken
        ``groups.dp``; sharded parameters are sharded again by ``rebuild``. Local."""
        self.placement = self.placement.unshard(params)

    # --- setting up --------------------------------------------------------
    def _new_reduction(self) -> GradientReduction:
        """This core's gradient reduction (made at attach)."""
        raise NotImplementedError

    def _new_placement(self, model: Model) -> Placement:
        """This core's parameter placement for ``model`` (made at attach, after the
        reduction, every replica holding rank 0's parameters)."""
        raise NotImplementedError

    def attach(self, model: Model) -> None:
        """Check ``model``, make every replica start from rank 0's parameters and
        set up the two parts. Collective over ``groups.dp`` (the world for a 3D
        layout).

        Raises:
            TypeError: not a model, or parameters that are not float32/float64
                1-D arrays (on every rank).
            MpiShardError: the parameter count or dtype differs between ranks.
        """
        started = time.perf_counter()
        opened = self.memory_phases.enter("attach")
        self.dp.agree(_model_problem(model), TypeError)
        n, dtype = model.params.size, model.params.dtype.str
        every = self.dp.allgather((n, dtype))
        if len(set(every)) > 1:
            detail = ", ".join(f"rank {r} has {c} {np.dtype(d).name}"
                               for r, (c, d) in enumerate(every))
            raise MpiShardError(f"parameters differ between data-parallel ranks: {detail}")
        self._release()   # attached before
        self.model = model
        self.xp = array_namespace(model.params)
        self.dtype = model.params.dtype
        self.layout = model.layout
        self._accumulates = _accepts_keyword(model.forward_backward, "accumulate")
        self._scales_loss = _accepts_keyword(model.forward_backward, "loss_scale")
        #: The model takes ``set_batch_context`` (dropout's rows of the global batch).
        self.sets_batch_context = hasattr(model, "set_batch_context")
        reduction = self._new_reduction()
        self.buckets = self._buckets(model, reduction)
        self.dp.Bcast(model.params, root=0)
        if model.grads is None and isinstance(model, BucketedModel):
            _own_gradient(model, self.xp)
        reduction.attach(model, self.xp, self.buckets, self.bucketed, self._accumulates,
                         self.totals.check_local)
        self.reduction = reduction
        self._setup()
        self._repro = ReproducibleStep(self) if self.config.reproducible else None
        #: What sums the step: the reduction, or reproducible mode's binned sums.
        self._sums: GradientReduction | ReproducibleStep = (
            self._repro if self._repro is not None else reduction)
        extra = self._repro.extra if self._repro is not None else 0
        self.totals.setup(self._step_group(), self.dp,
                          reduction.norm_pieces(self._owned_ranges()), reduction.norm_vector,
                          self.xp, self._counts_rows, extra)
        self.placement = self._new_placement(model)
        # A placement that shards the parameters dropped the whole vector the model
        # came with: the peak counts from here.
        current = self._current_bytes()
        self._peak_bytes = current if model.params is None else max(self._peak_bytes, current)
        self.memory_phases.leave(opened)
        #: Seconds the last attach took on this rank (the run header prints it).
        self.attach_seconds = time.perf_counter() - started

    def _buckets(self, model: Model, reduction: GradientReduction) -> GradientBuckets:
        """The gradient buckets, reduced during the backward (``bucketed``) or
        after it as ``overlap`` says. Collective over ``groups.dp`` (a measurement)."""
        # Buckets reduced during the backward must already hold the row-weighted
        # gradient: a model that cannot scale its loss is reduced after it.
        # Reproducible mode reduces binned sums at step(), not buckets during the backward.
        can_overlap = (isinstance(model, BucketedModel) and self._scales_loss
                       and not self.config.reproducible)
        #: The gradient bucket size in elements (``bucket_mb`` resolved).
        self.bucket_elements = self.options.bucket_elements(
            model.params.size, model.params.itemsize, self.dp.size)
        ranges = bucket_ranges(model.layout, self.bucket_elements)
        #: overlap="auto" or "measure": how it was decided (.overlap.decide_overlap).
        self.overlap_timings: dict[str, Any] = {}
        if isinstance(self.overlap, str) and can_overlap:   # "auto" or "measure"
            #: The buckets are reduced during the backward (``overlap`` resolved).
            self.bucketed = decide_overlap(self.dp, self._step_group(), ranges,
                                           model.params.dtype, self.xp, reduction.probe_kind(),
                                           reduction.slots, self.overlap_timings,
                                           nodes=self.config.groups.nodes,
                                           measure=self.overlap == "measure")
        else:
            self.bucketed = can_overlap and self.overlap is True
            if isinstance(self.overlap, str):
                self.overlap_timings.update(choice=False, reason=(
                    "reproducible mode" if self.config.reproducible else
                    "the model has no backward hooks or no loss_scale"))
        reduction.bucketed = self.bucketed
        return GradientBuckets(ranges, reduction.reduce_bucket, slots=reduction.slots)

    def _setup(self) -> None:
        """After the reduction is set up (a hybrid core's pipeline factors)."""

    def _require_model(self) -> Model:
        if self.model is None:
            raise RuntimeError(f"{self.public} has no model: pass model= when "
                               f"you make it ({self.public}(optimizer, config, "
                               f"model=model)), or call attach(model) or optimize(model, "
                               f"...) first")
        return self.model

    # --- the parts, for readers of 0.5's attributes -------------------------------------
    @property
    def reducer(self) -> Any:
        """The gradient reduction's [`Reducer`][mpishard.comm.reducer.Reducer]."""
        return self.reduction.reducer if self.reduction is not None else None

    @property
    def reduction_timings(self) -> dict[str, Any]:
        """What the reducer's measurement at attach found."""
        return self.reduction.timings if self.reduction is not None else {}

    @property
    def state(self) -> dict[str, Any]:
        """The optimizer state this rank holds (whole, or its shard), by name."""
        return self.placement.state

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
                self._set_batch_context(model, micro, rows, batch_start, global_rows)
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

    def _set_batch_context(self, model: Any, micro: int, rows: int, batch_start: int | None,
                           global_rows: int | None) -> None:
        if batch_start is not None:
            model.set_batch_context(self.step_count, batch_start, global_rows)
        elif micro < self.accumulation_steps:
            # Only known for an even accumulation_steps split; extra no_sync()
            # micro-batches of a hand-written loop leave the model to its own counter.
            per_rank = rows * self.accumulation_steps
            model.set_batch_context(self.step_count, self.dp.rank * per_rank + micro * rows,
                                    per_rank * self.dp.size)

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
        totals, sums = self.totals, self._sums
        if totals.micro == 0:
            raise RuntimeError("step() called before backward(): there are no gradients")
        clipping = self.max_grad_norm is not None
        t0 = time.perf_counter()
        converted = sums.reduce_step()     # seconds converting (reproducible mode)
        t1 = time.perf_counter()
        sums.fill_totals(totals, clipping)
        t2 = time.perf_counter()
        totals.reduce()
        t3 = time.perf_counter()
        sums.read_totals(totals, clipping)
        self.timings["communication"] += (t1 - t0 - converted) + (t3 - t2)
        loss_sum, rows, squares = totals.read()
        if rows == 0:
            raise ValueError("step(): the global batch has no rows (every rank called "
                             "backward() with an empty batch since the last step)")
        loss, scale = loss_sum / rows, self._gradient_factor / rows
        norm = math.sqrt(squares) * scale if squares >= 0 else float("nan")
        if clipping:
            self.last_grad_norm = norm
        if not (math.isfinite(loss) and math.isfinite(norm)):
            self._refuse(loss, norm)       # raises, or counts the skip
            self.timings["optimizer"] += (t2 - t1) + (time.perf_counter() - t3)
            return loss
        # Not min(1, ...): the norm is finite here, and clip_coefficient never hides NaN.
        coefficient = clip_coefficient(norm, self.max_grad_norm) if clipping else 1.0
        self._step_count += 1
        placement = self.placement
        placement.update(self.optimizer, self.reduction.gradient(placement.owned()),
                         self._step_count, self.current_lr(), scale * coefficient)
        t4 = time.perf_counter()
        self.timings["optimizer"] += (t2 - t1) + (t4 - t3)
        placement.after_step()
        self.timings["gather"] += time.perf_counter() - t4
        return loss

    def _refuse(self, loss: float, norm: float) -> None:
        """A non-finite step: raise (the default) or count it as skipped. Every
        rank holds the same reduced totals, so every rank takes the same branch."""
        if self.nonfinite == "skip":
            self._skipped_steps += 1
            return
        raise self.totals.refusal(self.step_count + 1, loss, norm)

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
        (the mean loss's gradient times the rows: the sum over them).

        Library models scale d(loss)/d(output) inside their backward
        (``loss_scale``), which costs nothing. Any other model's gradient is
        multiplied afterwards (one pass; with ``accumulate`` the sum so far is
        divided by ``rows`` first and multiplied back with the new term).
        """
        if self._scales_loss:
            if accumulate:
                return float(model.forward_backward(x, y, accumulate=True, loss_scale=rows))
            return float(model.forward_backward(x, y, loss_scale=rows))
        grads = model.grads
        if accumulate:
            grads *= 1.0 / rows
            loss = model.forward_backward(x, y, accumulate=True)
        else:
            loss = model.forward_backward(x, y)
        grads *= rows
        return float(loss)

    # --- parameters and state ---------------------------------------------------
    @contextlib.contextmanager
    def gathered_parameters(self) -> Iterator[Any]:
        """The whole parameter vector, ``model.params``, for the ``with`` block (the
        model's own; ZeRO-3 gathers it: collective over ``groups.dp``)."""
        self._require_model()
        with self.placement.gathered_parameters() as params:
            yield params

    def parameter_shard(self) -> tuple[Range, Any]:
        """The world range of the parameters this rank holds, and them (the whole
        vector, or ZeRO-3's shard: writes to it are read by the next forward). Local."""
        self._require_model()
        return self.placement.parameter_shard()

    def optimizer_state_shard(self) -> tuple[Range, dict[str, Any]]:
        """The world range of the optimizer state this rank holds, and the state."""
        return self.placement.optimizer_state_shard()

    def synchronize_optimizer_state(self) -> dict[str, Any]:
        """The whole optimizer state on every rank, by name (allocated where it is
        sharded: counted in the peak of ``memory_report``). Collective over
        ``groups.dp``."""
        return self.placement.synchronize_optimizer_state(self.note_peak)

    # --- checks and reports -----------------------------------------------
    def verify_in_sync(self) -> None:
        """Check that every data-parallel rank is at the same step and holds the
        same parameters (a hash of each replica's vector; ZeRO-3: of the whole
        vector as gathered). Collective over ``groups.dp``.

        Raises:
            CommunicationError: on every rank, naming the ranks that differ.
        """
        self._require_model()
        digest, who, what = self.placement.digest()
        every = self.dp.allgather((digest, self.step_count))
        if len(set(every)) > 1:
            odd = [r for r, d in enumerate(every) if d != every[0]]
            raise CommunicationError(
                f"{who} out of sync: data-parallel rank(s) {odd} differ from rank 0 "
                f"({what}, step) = {every[0]}")

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds for parameters, gradients, optimizer state and
        communication buffers, with the total now and the peak since attach
        (ZeRO-3 adds ``gathered`` and ``gathered_peak``), and the peaks of each
        phase so far ([`PhaseMemory.report`][mpishard.parallel.memory.PhaseMemory.report]).
        Local."""
        report = self._memory()
        if self._repro is not None:
            report["buffers"] += self._repro.nbytes()
        report["total"] = sum(report.values())
        self._peak_bytes = max(self._peak_bytes, report["total"])
        report["peak"] = self._peak_bytes
        report.update(self.placement.report())
        report.update(self.memory_phases.report())
        return report

    def memory_phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Count the ``with`` block's memory as phase ``name`` of ``memory_report``
        (``"save"``, ``"load"``, ``"recovery"``, ...). Local."""
        return self.memory_phases.phase(name)

    def note_peak(self, extra: int = 0) -> None:
        """Count what is held now, and ``extra`` bytes more held for a while, in the peak."""
        held = self._current_bytes() + extra
        self._peak_bytes = max(self._peak_bytes, held)
        self.memory_phases.note(held)

    def reset_timings(self) -> None:
        for key in self.timings:
            self.timings[key] = 0.0

    def _current_bytes(self) -> int:
        return sum(self._memory().values())

    def _memory(self) -> dict[str, int]:
        placed, reduced = self.placement.memory(), self.reduction.memory()
        report = {"parameters": placed["parameters"]}
        if "gathered" in placed:
            report["gathered"] = placed["gathered"]
        report.update(gradients=reduced["gradients"], optimizer_state=placed["optimizer_state"],
                      buffers=placed["buffers"] + reduced["buffers"])
        return report

    # --- how the norm's share is cut (hybrid cores count each tensor slice once) ------
    def _step_group(self) -> FlatComm:
        """The group the step's totals are reduced over."""
        return self.dp

    def _owned_ranges(self) -> list[Range]:
        """World ranges of the model's vector whose squares this rank's replica
        counts in the norm (all of it; a tensor-parallel rank owns less)."""
        return [Range(0, self.layout.size)]


def _held_bytes(core: Callable[[], DataParallelCore | None]) -> int:
    """The bytes ``core()`` holds now (0 before attach or once it is gone)."""
    found = core()
    return found._current_bytes() if found is not None and found.placement is not None else 0


def _own_gradient(model: Any, xp: Any) -> None:
    """Give ``model`` one full gradient vector again: a strategy it was attached to
    before (ZeRO-2) bound its gradients to that strategy's bucket buffers, and
    ``grads`` was None. Made once, at attach."""
    grads = xp.zeros(model.params.size, dtype=model.params.dtype)
    layout = model.layout

    def view(name: str) -> Any:
        spec = layout[name]
        return grads[spec.offset:spec.offset + spec.size].reshape(spec.shape)

    model.bind_gradients(view)
    model.grads = grads


def _model_problem(model: Any) -> str | None:
    """Why ``model`` cannot be trained, or None."""
    if not isinstance(model, Model):
        return (f"expecting a model with params, grads, layout, forward() and "
                f"forward_backward(), got {type(model).__name__}")
    params = model.params
    if params is None:
        return ("model.params is None: the parameters are sharded by the ZeRO-3 strategy "
                "the model is attached to; call its unshard() first")
    if getattr(params, "ndim", None) != 1:
        return f"model.params must be a 1-D array, got shape {getattr(params, 'shape', None)}"
    if params.dtype not in _FLOAT_DTYPES:
        return f"model.params must be float32 or float64, got {params.dtype}"
    if params.size != model.layout.size:
        return f"model.params has {params.size} elements but its layout has {model.layout.size}"
    grads = model.grads
    if grads is not None and (grads.shape != params.shape or grads.dtype != params.dtype):
        return (f"model.grads must match params ({params.shape}, {params.dtype}), "
                f"got ({grads.shape}, {grads.dtype})")
    return None


def _accepts_keyword(fn: Callable, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
