"""What DDP and ZeRO-2 share: checks at attach, micro-batches, stepping."""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import math
import numbers
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from ..backend import array_namespace, to_numpy
from ..comm import FlatComm, Handle, stuck, world_rank
from ..comm.buckets import GradientBuckets
from ..comm.hierarchical import choose as choose_reduction
from ..config import ShardingConfiguration
from ..errors import CommunicationError, MpiShardError, NonFiniteError, TopologyError
from ..flat import Range, bucket_ranges
from ..optim.base import CHUNK_ELEMENTS, DEVICE_CHUNK_ELEMENTS
from ..optim.clip import all_finite, clip_coefficient, sum_of_squares
from ..protocols import BucketedModel, Model, Optimizer
from .overlap import OVERLAP_CHOICES, decide_overlap
from .repro import ReproducibleStep

__all__ = ["NONFINITE_POLICIES", "DataParallelCore", "DataParallelOptions"]

_FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))

#: What ``nonfinite=`` accepts.
NONFINITE_POLICIES = ("error", "skip")

# The one small vector every step reduces (float64): the row-weighted loss sum,
# the row count, this rank's share of the gradient's sum of squares (with
# clipping; without it 0 or infinity: whether that share is finite), then one
# flag per rank of the step group (a non-finite local loss or gradient).
_LOSS, _ROWS, _SQUARES, _FLAGS = 0, 1, 2, 3


@dataclass(frozen=True)
class DataParallelOptions:
    """The options every data-parallel core takes (keyword arguments of its
    constructor), kept whole by :meth:`DataParallelCore.rebuild`.

    Attributes:
        bucket_mb: gradient bucket size in MiB.
        accumulation_steps: micro-batches per step; only the last communicates (DDP).
        max_grad_norm: clip by the global gradient norm (None: no clipping).
        schedule: ``step -> factor`` of the learning rate.
        overlap: ``"auto"`` (DDP's default): reduce gradient buckets during
            the backward or after it, as recorded for the layout, modelled, or
            measured by a stand-in backward within a budget at attach
            (:mod:`mpishard.parallel.overlap`; ``overlap_timings``,
            ``bucketed``); ``"measure"``: always the stand-in, unbounded; True
            (ZeRO's default, see :class:`~mpishard.parallel.zero2.ZeRO2Options`):
            during it (library models only); False: after it. The two ways may
            add in a different order on 3 or more ranks: pin one where two runs
            must agree bit for bit, or train with
            ``ShardingConfiguration(reproducible=True)``.
        nonfinite: ``"error"`` (a NaN or infinite loss or gradient norm raises
            :class:`~mpishard.errors.NonFiniteError` on every rank) or ``"skip"``
            (no update on any rank; counted in ``skipped_steps``).
    """

    bucket_mb: float = 25.0
    accumulation_steps: int = 1
    max_grad_norm: float | None = None
    schedule: Callable[[int], float] | None = None
    overlap: bool | str = "auto"
    nonfinite: str = "error"

    def __post_init__(self) -> None:
        steps = self.accumulation_steps
        if isinstance(steps, numbers.Integral) and not isinstance(steps, bool):
            object.__setattr__(self, "accumulation_steps", int(steps))   # np.int64(2) -> 2

    def problem(self) -> str | None:
        """Why these options cannot be used, or None. Pure."""
        steps = self.accumulation_steps
        if not isinstance(steps, numbers.Integral) or isinstance(steps, bool) or steps < 1:
            return f"accumulation_steps must be a positive integer, got {steps!r}"
        if not (self.bucket_mb > 0):
            return f"bucket_mb must be positive, got {self.bucket_mb!r}"
        if self.max_grad_norm is not None and not (self.max_grad_norm > 0):
            return f"max_grad_norm must be positive or None, got {self.max_grad_norm!r}"
        if self.nonfinite not in NONFINITE_POLICIES:
            return f"nonfinite must be one of {NONFINITE_POLICIES}, got {self.nonfinite!r}"
        if not any(self.overlap is c for c in OVERLAP_CHOICES):
            return f"overlap must be True, False, 'auto' or 'measure', got {self.overlap!r}"
        return None


class DataParallelCore:
    """Base of the data-parallel strategy cores; not used directly.

    Subclasses say only how one bucket of gradients is reduced and where
    gradients and state live (:class:`~mpishard.parallel.DDPCore`,
    :class:`~mpishard.parallel.ZeRO2Core`); the buckets, their readiness and
    launching are :class:`~mpishard.comm.buckets.GradientBuckets`'. This class
    owns the checks, the micro-batch bookkeeping, learning-rate schedule,
    clipping and the non-finite policy. The public classes of
    :mod:`mpishard.strategies` add the training loop (``optimize()``).

    The mean is over rows, not ranks: each micro-batch's gradient is weighted
    by its row count (through the model's ``loss_scale``), and ``step()``
    divides by the global row count, so ranks and micro-batches of any sizes,
    zero included, give exactly the gradient of the global batch's mean loss.

    Args:
        optimizer: the update rule (:mod:`mpishard.optim`).
        config: the layout (``ShardingConfiguration()`` over ``MPI.COMM_WORLD``
            when None).
        model: attach at once (otherwise :meth:`attach` or ``optimize`` does).
        **options: the fields of :attr:`Options` (:class:`DataParallelOptions`
            and the subclass's own).

    Raises:
        TypeError: not an optimizer, or an unknown option (on every rank).
        ValueError: an option out of range (on every rank).
        TopologyError: a layout with tensor or pipeline parallelism (use the
            hybrid strategy).
    """

    #: Human-readable name, written into checkpoints and reports.
    strategy = "data-parallel"
    #: The public class (:mod:`mpishard.strategies`) built on this core, for messages.
    public = "DataParallelCore"
    #: The options dataclass of this core.
    Options: type[DataParallelOptions] = DataParallelOptions
    #: Subclasses that hold a tensor/pipeline shard of the model set this.
    _model_parallel = False
    #: Extra factor on the summed gradient (a pipeline's 1 / micro-batches).
    _gradient_factor = 1.0
    #: Buffers the gradient buckets rotate through (ZeRO-2: 2; DDP: none).
    _slots = 0
    #: This rank adds its rows and loss to the step's totals (one rank per model replica).
    _counts_rows = True
    #: The model's passes communicate over ``groups.dp`` (ZeRO-3's parameter gathers):
    #: reproducible mode then runs the same passes on every rank (see .repro).
    _lockstep_passes = False

    def __init__(self, optimizer: Optimizer, config: ShardingConfiguration | None = None, *,
                 model: Model | None = None, **options: Any) -> None:
        config = config if config is not None else ShardingConfiguration()
        world = config.world
        world.agree(None if isinstance(optimizer, Optimizer) else
                    f"expecting a gradient optimizer with init_state() and update() "
                    f"(mpishard.optim.SGD, Adam, AdamW), got {type(optimizer).__name__}",
                    TypeError)
        unknown = sorted(set(options) - {f.name for f in fields(self.Options)})
        world.agree(f"{self.public} got unknown option(s) {unknown}; expecting "
                    f"{[f.name for f in fields(self.Options)]}" if unknown else None, TypeError)
        #: The constructor's options, as given (:attr:`Options`); :meth:`rebuild` keeps them.
        self.options = self.Options(**options)
        world.agree(self.options.problem(), ValueError)
        self.optimizer = optimizer
        for f in fields(self.options):   # read as attributes: strategy.bucket_mb, ...
            setattr(self, f.name, getattr(self.options, f.name))
        self.step_count = 0
        #: Steps refused for a non-finite loss or gradient norm (``nonfinite="skip"``);
        #: they do not count in ``step_count``.
        self.skipped_steps = 0
        self.last_grad_norm = float("nan")
        # Where the training loop is in the data (epoch, samples_consumed, seed,
        # batch_size, num_samples, shuffle: ints); kept current by mpishard.train
        # and saved and restored with checkpoints. None: not trained yet.
        self.data_position: dict[str, int] | None = None
        self.timings = {"forward_backward": 0.0, "communication": 0.0,
                        "optimizer": 0.0, "gather": 0.0}
        self._peak_bytes = 0
        self.model: Model | None = None
        #: The parameters' dtype (None before attach).
        self.dtype: Any = None
        self._over(config)
        if model is not None:
            self.attach(model)

    def _over(self, config: ShardingConfiguration) -> None:
        """Take ``config``'s groups, with no model attached and no step in progress."""
        topo = config.topology
        if topo.tp * topo.pp != 1 and not self._model_parallel:
            config.world.agree(
                f"{self.public} replicates the whole model, but the layout has "
                f"tensor_parallel_size={topo.tp} and pipeline_parallel_size={topo.pp}; "
                f"use HybridShardedOptimizer for tensor or pipeline parallelism",
                TopologyError)
        self.config = config
        self.dp = config.groups.dp
        self._pending_micro = 0
        self._loss_sum = 0.0       # sum over this step's micro-batches of rows * mean loss
        self._rows = 0             # rows of this step's micro-batches on this rank
        self._local_bad = False    # a non-finite local loss or gradient this step
        self._no_sync = False
        # Reproducible mode's units and binned sums (config.reproducible), made at attach.
        self._repro: ReproducibleStep | None = None

    def rebuild(self, config: ShardingConfiguration) -> None:
        """Set this core up again over ``config``'s groups (after a lost rank: the
        survivors'), keeping the optimizer, every constructor option
        (:attr:`options`) and the attached model; the optimizer state starts from
        zero (the caller puts it back), the step count and data position stay.
        Collective over ``config.world``."""
        model = self.model
        self._release()
        self._over(config)
        self.model = None
        if model is not None:
            self.attach(model)

    def _release(self) -> None:
        """Free what the core holds on its old groups (a two-level reducer)."""
        reducer = getattr(self, "reducer", None)
        if reducer is not None and reducer is not self.dp:
            reducer.free()
        self.reducer = None

    def _measured_reducer(self, largest: int, dtype: Any, kind: str, ring: bool) -> Any:
        """The data group's reduction for buckets of ``largest`` elements: the group,
        its two levels across nodes or its ring, whichever measured fastest
        (:func:`~mpishard.comm.hierarchical.choose`, into ``reduction_timings``).
        In a 3D layout (the data group smaller than the job) the choice is made
        alike over the job, a stage without buckets taking part, and the ring is
        not tried: the data groups hold copies of the replicated tensors, which
        another order of addition in one group would let drift. Collective over
        the training group (the data group where it is the whole job)."""
        groups = self.config.groups
        whole = groups.dp.size == groups.world.size
        if whole and not largest:
            return self.dp
        return choose_reduction(self.dp, largest, dtype, self.xp, kind=kind,
                                blocking=not self.bucketed, nodes=groups.nodes,
                                record=self.reduction_timings, ring=ring and whole,
                                agree=None if whole else groups.world)

    # --- setting up --------------------------------------------------------
    def attach(self, model: Model) -> None:
        """Check ``model``, make every replica start from rank 0's parameters and
        set up gradient buckets and optimizer state. Collective over ``groups.dp``.

        Raises:
            TypeError: not a model, or parameters that are not float32/float64
                1-D arrays (on every rank).
            MpiShardError: the parameter count or dtype differs between ranks.
        """
        started = time.perf_counter()
        self.dp.agree(_model_problem(model), TypeError)
        n, dtype = model.params.size, model.params.dtype.str
        every = self.dp.allgather((n, dtype))
        if len(set(every)) > 1:
            detail = ", ".join(f"rank {r} has {c} {np.dtype(d).name}"
                               for r, (c, d) in enumerate(every))
            raise MpiShardError(f"parameters differ between data-parallel ranks: {detail}")
        self.model = model
        self.xp = array_namespace(model.params)
        self.dtype = model.params.dtype
        self.layout = model.layout
        self._accumulates = _accepts_keyword(model.forward_backward, "accumulate")
        self._scales_loss = _accepts_keyword(model.forward_backward, "loss_scale")
        # Buckets reduced during the backward must already hold the row-weighted
        # gradient: a model that cannot scale its loss is reduced after it.
        # Reproducible mode reduces binned sums at step(), not buckets during the backward.
        can_overlap = (isinstance(model, BucketedModel) and self._scales_loss
                       and not self.config.reproducible)
        self._batch_context = hasattr(model, "set_batch_context")
        bucket_elements = max(1, int(self.bucket_mb * 2**20) // model.params.itemsize)
        ranges = bucket_ranges(model.layout, bucket_elements)
        #: overlap="auto" or "measure": how it was decided (.overlap.decide_overlap).
        self.overlap_timings: dict[str, Any] = {}
        if isinstance(self.overlap, str) and can_overlap:   # "auto" or "measure"
            self.bucketed = decide_overlap(self.dp, self._step_group(), ranges,
                                           model.params.dtype, self.xp, self._probe_kind(),
                                           self._slots, self.overlap_timings,
                                           nodes=self.config.groups.nodes,
                                           measure=self.overlap == "measure")
        else:
            self.bucketed = can_overlap and self.overlap is True
            if isinstance(self.overlap, str):
                self.overlap_timings.update(choice=False, reason=(
                    "reproducible mode" if self.config.reproducible else
                    "the model has no backward hooks or no loss_scale"))
        self.buckets = GradientBuckets(ranges, self._reduce, slots=self._slots)
        self.dp.Bcast(model.params, root=0)
        if model.grads is None and isinstance(model, BucketedModel):
            _own_gradient(model, self.xp)
        self._setup()
        self._repro = ReproducibleStep(self) if self.config.reproducible else None
        self._setup_step()
        self._peak_bytes = max(self._peak_bytes, self._current_bytes())
        #: Seconds the last attach took on this rank (the run header prints it).
        self.attach_seconds = time.perf_counter() - started

    def _setup_step(self) -> None:
        """The step's reduction buffer, who is who in it, and the norm's ranges."""
        group = self._step_group()
        self._stepper = group
        # Reproducible mode appends the words of the loss and of the sum of squares.
        extra = self._repro.extra if self._repro is not None else 0
        self._step_buffer = np.zeros(_FLAGS + group.size + extra, dtype=np.float64)
        # (data-parallel rank, world rank) of each rank of the step group, to name
        # the rank where a non-finite value appeared; gathered once, here.
        self._who = group.allgather((self.dp.rank, world_rank()))
        self._norm_ranges = [r for r in self._norm_pieces(self._owned_ranges()) if len(r)]
        longest = max((len(r) for r in self._norm_ranges), default=1)
        limit = CHUNK_ELEMENTS if self.xp is np else DEVICE_CHUNK_ELEMENTS
        self._norm_scratch = self.xp.empty(max(1, min(limit, longest)), dtype=np.float64)

    def _require_model(self) -> Model:
        if self.model is None:
            raise RuntimeError(f"{self.public} has no model: pass model= when "
                               f"you make it ({self.public}(optimizer, config, "
                               f"model=model)), or call attach(model) or optimize(model, "
                               f"...) first")
        return self.model

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
        """Forward and backward on this rank's micro-batch; returns its local mean loss.

        Gradients of successive calls accumulate until :meth:`step`, each
        weighted by its row count, so that ranks and micro-batches of unequal
        sizes give exactly the mean over every row of the global batch. A batch
        of no rows calls no model: this rank then adds nothing (its loss is 0.0)
        but still takes part in every reduction. Reductions start during the
        backward pass where the strategy can. Collective over ``groups.dp``
        (every rank calls it the same number of times).

        ``batch_start`` and ``global_rows`` (give both or neither) say that these
        rows are rows ``[batch_start, batch_start + len(x))`` of a global batch of
        ``global_rows``: random layers (dropout) draw their masks for the global
        batch, so any split of it trains the same. Without them, the position
        is worked out assuming every rank and micro-batch has ``len(x)`` rows.

        Raises:
            ValueError: only one of ``batch_start`` and ``global_rows`` is given.
        """
        model = self._require_model()
        micro = self._pending_micro
        rows = len(x)
        if micro == 0:   # this rank makes progress: its watchdog starts again
            stuck.watch(self.dp.timeout)
        if (batch_start is None) != (global_rows is None):
            raise ValueError(f"give both batch_start and global_rows or neither, got "
                             f"batch_start={batch_start!r}, global_rows={global_rows!r}")
        if self._repro is not None:
            return self._repro.backward(x, y, batch_start, global_rows)
        self.buckets.seconds = 0.0
        t0 = time.perf_counter()
        if rows:
            if self._batch_context:
                self._set_batch_context(model, micro, rows, batch_start, global_rows)
            loss = self._backward(model, x, y, micro, rows)
            if not math.isfinite(loss):
                self._local_bad = True
            self._loss_sum += rows * loss
        else:
            loss = 0.0
            self._skip(micro)
        comm = self.buckets.seconds
        self.timings["forward_backward"] += time.perf_counter() - t0 - comm
        self.timings["communication"] += comm
        self._pending_micro += 1
        self._rows += rows
        return loss

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
        over every row of the micro-batches since the last step.

        One small ``Allreduce`` carries the step's totals: the row-weighted loss,
        the row count ``N`` (the gradient is averaged as ``1/N`` folded into the
        update), the gradient's sum of squares (each rank summing only its share
        of the reduced gradient; without clipping only whether the share is
        finite, which is cheaper, and :attr:`last_grad_norm` is then not
        computed) and which ranks saw a non-finite value. A NaN or
        infinite global loss or gradient norm updates nothing: with
        ``nonfinite="error"`` it raises, with ``"skip"`` the step is counted in
        :attr:`skipped_steps` (not in :attr:`step_count`) and its loss returned.
        Collective over ``groups.dp`` (over the world for hybrid layouts).

        Raises:
            NonFiniteError: (``nonfinite="error"``) on every rank, naming the step
                and the first rank where a non-finite local loss or gradient
                appeared; parameters and optimizer state are left unchanged.
            ValueError: no rank had any rows since the last step (on every rank).
        """
        if self._pending_micro == 0:
            raise RuntimeError("step() called before backward(): there are no gradients")
        t0 = time.perf_counter()
        repro = self._repro
        converted = 0.0       # reproducible mode: seconds converting words to floats
        if repro is None:
            self._finish_gradients()
        else:
            converted = repro.reduce()
        t1 = time.perf_counter()
        buf = self._step_buffer
        buf.fill(0.0)
        if self._counts_rows:
            buf[_LOSS] = self._loss_sum
            buf[_ROWS] = self._rows
        if self.max_grad_norm is None:
            # No norm is needed, only whether the gradient is finite: a pass that
            # costs a seventh of the float64 sum of squares (optim.clip.all_finite).
            buf[_SQUARES] = 0.0 if self._local_finite() else math.inf
        elif repro is None:
            buf[_SQUARES] = self._local_sum_of_squares()
        buf[_FLAGS + self._stepper.rank] = self._local_bad
        tail = _FLAGS + self._stepper.size
        if repro is not None:
            # Loss and squares as binned words (their bins agreed first, collectively).
            repro.fill_totals(buf, tail, self.max_grad_norm is not None)
        t2 = time.perf_counter()
        self._stepper.Allreduce(buf, slot="step")
        t3 = time.perf_counter()
        if repro is not None:
            loss_sum, squares = repro.read_totals(buf, tail)
            buf[_LOSS] = loss_sum
            if self.max_grad_norm is not None or not math.isfinite(squares):
                buf[_SQUARES] = squares     # NaN: a rank's unit gradient was not finite
        self.timings["communication"] += (t1 - t0 - converted) + (t3 - t2)
        self._pending_micro = 0
        self._loss_sum = 0.0
        self._rows = 0
        self._local_bad = False
        rows = int(buf[_ROWS])
        if rows == 0:
            raise ValueError("step(): the global batch has no rows (every rank called "
                             "backward() with an empty batch since the last step)")
        loss = float(buf[_LOSS]) / rows
        scale = self._gradient_factor / rows
        norm = math.sqrt(buf[_SQUARES]) * scale if buf[_SQUARES] >= 0 else float("nan")
        if self.max_grad_norm is not None:
            self.last_grad_norm = norm
        if not (math.isfinite(loss) and math.isfinite(norm)):
            self._refuse(loss, norm)       # raises, or counts the skip
            self.timings["optimizer"] += (t2 - t1) + (time.perf_counter() - t3)
            return loss
        coefficient = 1.0
        if self.max_grad_norm is not None:
            # Not min(1, ...): the norm is finite here, and clip_coefficient never hides NaN.
            coefficient = clip_coefficient(norm, self.max_grad_norm)
        self.step_count += 1
        lr = self.current_lr()
        self._update(lr, scale * coefficient)
        t4 = time.perf_counter()
        self.timings["optimizer"] += (t2 - t1) + (t4 - t3)
        self._gather_parameters()
        self.timings["gather"] += time.perf_counter() - t4
        return loss

    def _refuse(self, loss: float, norm: float) -> None:
        """A non-finite step: raise (the default) or count it as skipped. Every
        rank holds the same reduced totals, so every rank takes the same branch."""
        flags = self._step_buffer[_FLAGS:_FLAGS + self._stepper.size]
        first = next((i for i, f in enumerate(flags) if f), None)
        if first is None and len(flags) == 1:
            first = 0
        if self.nonfinite == "skip":
            self.skipped_steps += 1
            return
        step = self.step_count + 1
        what = " and ".join(name for name, v in (("loss", loss), ("gradient norm", norm))
                            if not math.isfinite(v))
        if first is None:
            rank = world = None
            where = ("no rank's local loss was non-finite, and the local gradients were "
                     "reduced as the backward produced them (unchecked, to keep the "
                     "check one pass), so the rank cannot be named")
        else:
            rank, world = self._who[first]
            where = (f"it first appeared on data-parallel rank {rank} (world rank {world}), "
                     f"whose local loss or gradient was non-finite")
        raise NonFiniteError(
            f"step {step}: non-finite {what} (global mean loss {loss}, gradient norm "
            f"{norm}); {where}. Parameters and optimizer state are unchanged; pass "
            f"nonfinite='skip' to skip such steps instead", step=step, rank=rank,
            world_rank=world)

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

    # --- checks and reports -----------------------------------------------
    def verify_in_sync(self) -> None:
        """Check that every data-parallel replica holds identical parameters.

        Compares a BLAKE2 hash of the parameter bytes and the step count across
        ``groups.dp``. Collective over ``groups.dp``.

        Raises:
            CommunicationError: on every rank, naming the ranks that differ.
        """
        model = self._require_model()
        digest = hashlib.blake2b(to_numpy(model.params).tobytes(), digest_size=16).hexdigest()
        self._compare_digests(digest, "replicas", "parameter hash")

    def _compare_digests(self, digest: str, who: str, what: str) -> None:
        """Collective over the data-parallel group: every rank's ``(digest, step)``
        against rank 0's; a ``CommunicationError`` on every rank naming those that differ."""
        every = self.dp.allgather((digest, self.step_count))
        if len(set(every)) > 1:
            odd = [r for r, d in enumerate(every) if d != every[0]]
            raise CommunicationError(
                f"{who} out of sync: data-parallel rank(s) {odd} differ from rank 0 "
                f"({what}, step) = {every[0]}")

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds for parameters, gradients, optimizer state and
        communication buffers, with the total now and the peak since attach."""
        report = self._memory()
        if self._repro is not None:
            report["buffers"] += self._repro.nbytes()
        report["total"] = sum(report.values())
        self._peak_bytes = max(self._peak_bytes, report["total"])
        report["peak"] = self._peak_bytes
        return report

    def reset_timings(self) -> None:
        for key in self.timings:
            self.timings[key] = 0.0

    def _current_bytes(self) -> int:
        return sum(self._memory().values())

    # --- for the subclasses ------------------------------------------------
    def _forward_backward(self, model: Model, x: Any, y: Any, accumulate: bool,
                          rows: int) -> float:
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

    def _check_local(self, vector: Any) -> None:
        """Note a non-finite value in this rank's own (unreduced) gradient.

        Only where the whole local gradient exists before a blocking reduction
        (models without backward hooks), so it costs one read and no overlap.
        """
        if self._stepper.size == 1:
            return                 # a single rank is named without looking
        if not all_finite(vector):
            self._local_bad = True

    def _local_finite(self) -> bool:
        """Whether this rank's share of the reduced gradient is all finite."""
        vector = self._norm_vector()
        return all(all_finite(vector[r.start:r.stop]) for r in self._norm_ranges)

    def _local_sum_of_squares(self) -> float:
        """This rank's share of the reduced gradient's sum of squares (one pass
        over the share, into a float64 scratch made at attach)."""
        vector, scratch = self._norm_vector(), self._norm_scratch
        total = 0.0
        for r in self._norm_ranges:
            total += sum_of_squares(vector[r.start:r.stop], scratch)
        return total

    def _step_group(self) -> FlatComm:
        """The group the step's totals are reduced over."""
        return self.dp

    def _probe_kind(self) -> str:
        """How ``overlap="auto"`` reduces its stand-in buckets (ZeRO-2: to shards)."""
        return "allreduce"

    def _owned_ranges(self) -> list[Range]:
        """World ranges of the model's vector whose squares this rank's replica
        counts in the norm (all of it; a tensor-parallel rank owns less)."""
        return [Range(0, self.layout.size)]

    @contextlib.contextmanager
    def gathered_parameters(self) -> Iterator[Any]:
        """The whole parameter vector, ``model.params``, for the ``with`` block (the
        model holds it: local; ZeRO-3 gathers it)."""
        yield self._require_model().params

    def parameter_shard(self) -> tuple[Range, Any]:
        """The world range of the parameters this rank holds, and them: the whole
        vector (a ZeRO-3 rank holds its shard). Local."""
        return Range(0, self.layout.size), self._require_model().params

    # --- what subclasses provide -----------------------------------------
    def _setup(self) -> None:
        raise NotImplementedError

    def _reduce(self, index: int, source: Any, blocking: bool) -> Handle | None:
        """Reduce bucket ``index`` whose unreduced gradient is ``source``."""
        raise NotImplementedError

    def _backward(self, model: Model, x: Any, y: Any, micro: int, rows: int) -> float:
        raise NotImplementedError

    def _skip(self, micro: int) -> None:
        """A micro-batch of no rows: contribute zeros, join every reduction."""
        raise NotImplementedError

    def _finish_gradients(self) -> None:
        raise NotImplementedError

    def _norm_pieces(self, owned: list[Range]) -> list[Range]:
        """The ranges of :meth:`_norm_vector` whose squares this rank sums, from
        the world ranges its replica owns; over the step group each element of
        the reduced gradient is counted once."""
        raise NotImplementedError

    def _norm_vector(self) -> Any:
        raise NotImplementedError

    def _update(self, lr: float, grad_scale: float) -> None:
        raise NotImplementedError

    def _gather_parameters(self) -> None:
        pass

    # --- reproducible mode (see .repro) ------------------------------------------
    def _repro_source(self) -> Any:
        """Where one unit's gradient is, to deposit."""
        return self.model.grads

    def _reduce_words(self, acc: Any) -> None:
        """Sum the binned words of ``acc`` (bins already agreed) over ``groups.dp``."""
        raise NotImplementedError

    def _repro_target(self) -> tuple[Any, int, int]:
        """``(out, start, stop)``: the reduced gradient's world range ``[start, stop)``
        this rank updates from, and the array to write it into."""
        raise NotImplementedError

    def _repro_shards(self) -> list[Range] | None:
        """Every data-parallel rank's range of the reduced gradient, where each
        rank updates from its own part only; None where each holds all of it."""
        return None

    def _memory(self) -> dict[str, int]:
        raise NotImplementedError


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


def _nbytes(arrays: Any) -> int:
    return int(sum(a.nbytes for a in arrays))
