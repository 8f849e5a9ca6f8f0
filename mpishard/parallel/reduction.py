"""Gradient reductions: how a core's summed gradient comes about over ``groups.dp``.

One of the two parts of a data-parallel core (the other is its
[parameter placement][mpishard.parallel.placement]):

* [`Allreduced`][mpishard.parallel.reduction.Allreduced]: every rank holds the
  whole summed gradient (DDP), each bucket summed with an ``Allreduce``;
* [`ReducedToShards`][mpishard.parallel.reduction.ReducedToShards]: each rank
  holds only its shard of it (ZeRO-2 and ZeRO-3), each bucket reduced to the
  shards as the backward produces it.

A reduction owns the gradient buckets (planned at attach, reduced during the
backward or after it: [`plan_buckets`][mpishard.parallel.reduction.GradientReduction.plan_buckets])
and their reduce calls, the micro-batches' passes through them, the reducer it
measured ([`Reducer`][mpishard.comm.reducer.Reducer]) and, for reproducible
mode, where the binned words are summed. It names its
communicators ([`communicators`][mpishard.parallel.reduction.GradientReduction.communicators])
for a recovery; it holds no state that outlives a step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from ..comm import FlatComm, Handle
from ..comm.buckets import GradientBuckets
from ..comm.hierarchical import HierarchicalComm
from ..comm.hierarchical import choose as choose_reduction
from ..comm.reducer import OwnedReducer, Reducer
from ..comm.ring import RING_MIN_ELEMENTS, RingComm
from ..comm.timing import agree_on_fastest, reduce_once, time_alternatives
from ..config import ShardingConfiguration
from ..errors import MpiShardError
from ..flat import Range, bucket_ranges, buckets_of, shard_ranges
from ..protocols import BucketedModel
from .options import REDUCE_METHODS
from .overlap import decide_overlap
from .reproexchange import WordShards
from .totals import StepTotals

__all__ = ["REDUCE_METHODS", "Allreduced", "GradientReduction", "ReducedToShards",
           "choose_reduce_method", "known_reducers", "learn_reducers",
           "recalling_reducers"]

#: The reducer each layout measured fastest in this process (its ``choose``
#: record: ``"choice"``, the times), by layout key: a rebuild over the same
#: layout within ``recalling_reducers`` takes it without measuring again.
_CHOSEN: dict[str, dict[str, Any]] = {}
_RECALL = [False]


@contextmanager
def recalling_reducers() -> Iterator[None]:
    """Within it, an attach (a rebuild on every rank of the job: a promotion)
    takes the reducer this process measured before for the same layout, where
    every rank of the training group knows it, instead of measuring again
    (seconds at 25M parameters). Local."""
    _RECALL[0] = True
    try:
        yield
    finally:
        _RECALL[0] = False


def known_reducers() -> dict[str, dict[str, Any]]:
    """This process's measured reducer choices, by layout (to give a newcomer: a
    promoted spare reduces as the survivors, who remember theirs). Local."""
    return dict(_CHOSEN)


def learn_reducers(choices: dict[str, dict[str, Any]]) -> None:
    """Take ``choices`` (another process's ``known_reducers``) as this process's. Local."""
    _CHOSEN.update(choices)


#: ``run(accumulate) -> loss``: the model's forward and backward on the
#: micro-batch, its gradient added to the one there (``accumulate``) or not.
RunModel = Callable[[bool], float]


class GradientReduction:
    """What both reductions share: the data group, the measured reducer and the
    buckets. Subclasses say how one bucket is reduced and where the sum lives.

    Args:
        config: the core's layout (``groups.dp`` reduces; the whole job agrees
            on a measured choice in a 3D layout).
    """

    #: Buffers the gradient buckets rotate through (0: none, a whole vector).
    slots = 0

    def __init__(self, config: ShardingConfiguration) -> None:
        self.config = config
        self.dp = config.groups.dp
        #: The bucket reduction's [`Reducer`][mpishard.comm.reducer.Reducer] (after attach).
        self.reducer: Reducer | None = None
        #: What the reducer's measurement found (``choose``'s record).
        self.timings: dict[str, Any] = {}
        self.buckets: GradientBuckets | None = None
        self.bucketed = False
        self.pieces = False

    def probe_kind(self) -> str:
        """How ``overlap="auto"``'s stand-in buckets are reduced."""
        return "allreduce"

    def shed(self) -> None:
        """Drop the buffers and the model this reduction holds, keeping what it
        chose (a rebuild makes new buffers and may read the choice): after
        ``release``, before the new layout allocates. Local."""
        self.buckets = None
        self.model = None

    def plan_buckets(self, model: Any, xp: Any, options: Any, scales_loss: bool,
                     step_group: FlatComm, record: dict[str, Any], *,
                     dtype: Any) -> GradientBuckets:
        """``model``'s gradient buckets (``options.bucket_mb`` of ``dtype``, the
        parameters'), reduced during the
        backward (sets ``bucketed``) or after it as ``options.overlap`` says; how
        ``"auto"`` or ``"measure"`` decided goes into ``record``
        (``mpishard.parallel.overlap.decide_overlap``). Collective
        over ``groups.dp`` and ``step_group`` (a measurement)."""
        # Buckets reduced during the backward must already hold the row-weighted
        # gradient: a model that cannot scale its loss is reduced after it.
        # Reproducible mode reduces binned sums at step(), not buckets during the backward.
        reproducible = self.config.reproducible
        can_overlap = isinstance(model, BucketedModel) and scales_loss and not reproducible
        #: The gradient bucket size in elements (``bucket_mb`` resolved: ``"auto"``
        #: chooses from the model and the ranks).
        self.bucket_elements = options.bucket_elements(model.layout.size, dtype.itemsize,
                                                       self.dp.size)
        #: The buckets are cut at the model's gradient pieces (a model that hands
        #: its gradients over piece by piece to slot buffers: ``gradient_pieces``).
        self.pieces = bool(self.slots) and hasattr(model, "bind_gradient_pieces")
        ranges = (buckets_of(model.gradient_pieces(self.bucket_elements), self.bucket_elements)
                  if self.pieces else bucket_ranges(model.layout, self.bucket_elements))
        overlap = options.overlap
        if isinstance(overlap, str) and can_overlap:   # "auto" or "measure"
            self.bucketed = decide_overlap(self.dp, step_group, ranges, dtype, xp,
                                           self.probe_kind(), self.slots, record,
                                           nodes=self.config.groups.nodes,
                                           measure=overlap == "measure")
        else:
            self.bucketed = can_overlap and overlap is True
            if isinstance(overlap, str):
                record.update(choice=False, reason=(
                    "reproducible mode" if reproducible else
                    "the model has no backward hooks or no loss_scale"))
        return GradientBuckets(ranges, self.reduce_bucket, slots=self.slots)

    def communicators(self) -> list[FlatComm]:
        """The communicators this reduction waits on: the data group's and its
        reducer's own. Local."""
        own = self.reducer.communicators() if isinstance(self.reducer, OwnedReducer) else []
        return [self.dp, *own]

    def release(self) -> None:
        """Free the reducer's own communicators (collective over the old data
        group, where it is whole)."""
        if isinstance(self.reducer, OwnedReducer):
            self.reducer.free()
        self.reducer = None
        if self.bucketed and getattr(self, "model", None) is not None:
            _hook(self.model, None)     # not called into after the release

    def _measured(self, largest: int, dtype: Any, xp: Any, kind: str, ring: bool) -> Reducer:
        """The data group's reduction for buckets of ``largest`` elements: the group,
        its two levels across nodes or its ring, whichever measured fastest
        ([`choose`][mpishard.comm.hierarchical.choose], into ``timings``).
        In a 3D layout (the data group smaller than the job) the choice is made
        alike over the job, a stage without buckets taking part, and the ring is
        not tried: the data groups hold copies of the replicated tensors, which
        another order of addition in one group would let drift. Collective over
        the training group (the data group where it is the whole job)."""
        groups = self.config.groups
        whole = groups.dp.size == groups.world.size
        if whole and not largest:
            return self.dp
        nodes = groups.nodes
        key = repr((self.dp.size, groups.world.size, largest, np.dtype(dtype).str,
                    xp.__name__, kind, not self.bucketed, ring and whole,
                    None if nodes is None else nodes.nodes))
        known = _CHOSEN.get(key)
        # A rebuild on the same layout (a promotion: recalling_reducers) takes the
        # choice measured before, if every rank knows it (a newcomer learnt it).
        if _RECALL[0] and groups.world.allreduce(known is not None, op="land"):
            self.timings.update(known, source="recalled")
            return _reducer(known["choice"], self.dp)
        reducer = choose_reduction(self.dp, largest, dtype, xp, kind=kind,
                                   blocking=not self.bucketed, nodes=nodes,
                                   record=self.timings, ring=ring and whole,
                                   agree=None if whole else groups.world)
        _CHOSEN[key] = {k: v for k, v in self.timings.items()
                        if k in ("choice", "flat", "hierarchical", "ring", "levels")}
        return reducer

    def repro_source(self, model: Any) -> Any:
        """Where one reproducible unit's gradient is, to deposit."""
        return model.grads

    # --- the step's sums (reproducible mode has its own: .repro.ReproducibleStep) ---
    def reduce_step(self) -> float:
        """Complete the step's reduction; the seconds of it not spent communicating
        (none here). Collective over ``groups.dp``."""
        self.finish()
        return 0.0

    def fill_totals(self, totals: StepTotals, clipping: bool) -> None:
        """This rank's totals into the step buffer, with its share's sum of squares
        where ``clipping``. Local."""
        totals.fill(clipping)
        if clipping:
            totals.local_squares()

    def read_totals(self, totals: StepTotals, clipping: bool) -> None:
        """After the step's ``Allreduce``: the summed floats are the totals."""


class Allreduced(GradientReduction):
    """Every data-parallel rank ends the step with the whole summed gradient:
    each bucket ``Allreduce``-d (non-blocking during the backward where the
    buckets launch from its hooks). Only the step's last micro-batch
    communicates (``accumulation_steps``, ``no_sync``); a model that cannot add
    into its own gradient gets a buffer that does.

    Args:
        config: as [`GradientReduction`][mpishard.parallel.reduction.GradientReduction]'s.
        accumulation_steps: micro-batches per step.
    """

    def __init__(self, config: ShardingConfiguration, accumulation_steps: int) -> None:
        super().__init__(config)
        self.accumulation_steps = accumulation_steps
        self._accum: Any = None
        self.model: Any = None

    def attach(self, model: Any, xp: Any, buckets: GradientBuckets, bucketed: bool,
               accumulates: bool, check: Callable[[Any], None], dtype: Any = None) -> None:
        """Set up over ``model``'s gradient (hooks on ``buckets`` when ``bucketed``);
        ``check(vector)`` notes a non-finite local gradient; ``dtype``: the
        parameters' (``model.params``' where None). Collective over the
        training group (the reducer is measured)."""
        self.model, self.xp, self.buckets, self.bucketed = model, xp, buckets, bucketed
        self._accumulates, self._check = accumulates, check
        n, dtype = model.layout.size, model.params.dtype if dtype is None else dtype
        # Models that cannot accumulate into their own gradient get a buffer
        # (made here for accumulation_steps, on first need for no_sync()).
        needs_buffer = self.accumulation_steps > 1 and not accumulates
        self._accum = xp.zeros(n, dtype=dtype) if needs_buffer else None
        buckets.vector = self.vector
        _hook(model, buckets if bucketed else None)
        # Over the data group, in two levels (inside the nodes, then across) or as
        # a ring, whichever measured faster at this size.
        self.reducer = (self.dp if self.config.reproducible else
                        self._measured(buckets.largest, dtype, xp, "allreduce", ring=True))

    @property
    def vector(self) -> Any:
        """The whole (after the step: summed) gradient."""
        return self._accum if self._accum is not None else self.model.grads

    def reduce_bucket(self, index: int, source: Any, blocking: bool) -> Handle | None:
        """``GradientBuckets`` (``mpishard.comm.buckets``)' reduce call."""
        if self.dp.size == 1:
            return None
        if blocking:
            self.reducer.Allreduce(source, slot=index)
            return None
        return self.reducer.Iallreduce(source, slot=index)

    # --- one micro-batch --------------------------------------------------------
    def _begin(self, micro: int, no_sync: bool) -> bool:
        """Start a micro-batch; True when it is the step's last (it communicates)."""
        last = not no_sync and micro + 1 >= self.accumulation_steps
        self.buckets.begin(last)
        return last

    def backward(self, micro: int, run: RunModel, no_sync: bool = False) -> float:
        """Micro-batch ``micro`` of the step: ``run`` it and, on the last (not
        ``no_sync``), reduce what its backward did not launch. Collective over
        ``groups.dp``."""
        last = self._begin(micro, no_sync)
        if self._accumulates and self._accum is None:
            loss = run(micro > 0)
        else:
            grads = self.model.grads
            if micro > 0 and self._accum is None:
                # no_sync() with a model that overwrites its gradient: keep the sum here.
                self._accum = self.xp.empty_like(grads)
                self._accum[...] = grads
                self.buckets.vector = self._accum
            loss = run(False)
            if self._accum is not None:
                if micro == 0:
                    self._accum[...] = self.model.grads
                else:
                    self._accum += self.model.grads
        if last:
            self._reduce_rest()
        return loss

    def skip(self, micro: int, replay: Callable[[], None] | None = None,
             no_sync: bool = False) -> None:
        """A micro-batch of no rows: zeros, in every reduction the others join."""
        last = self._begin(micro, no_sync)
        if replay is not None:
            replay()
        if micro == 0:
            self.vector.fill(0)
        if last:
            if self.bucketed:
                # The other ranks' backward launches every bucket non-blocking.
                self.buckets.flush(blocking=False)
            else:
                self._reduce_rest()

    def _reduce_rest(self) -> None:
        """Reduce the buckets the backward pass has not launched, blocking."""
        if not self.bucketed:
            self._check(self.vector)
        self.buckets.flush()

    def finish(self) -> None:
        """Complete the step's reduction. Collective over ``groups.dp``."""
        self.buckets.wait()
        if not self.buckets.launched_all:
            self._reduce_rest()   # all micro-batches ran under no_sync(): reduce now

    # --- what the step reads -------------------------------------------------------
    def gradient(self, owned: Range) -> Any:
        """The summed gradient of world range ``owned``."""
        vector = self.vector
        if owned.start == 0 and owned.stop == vector.size:
            return vector
        return vector[owned.start:owned.stop]

    def norm_pieces(self, owned: list[Range]) -> list[Range]:
        """The ranges of ``norm_vector`` whose squares this rank sums, from the
        world ranges its replica owns: every replica holds the same sum, so each
        counts its 1/N of it (the check costs 1/N of a pass)."""
        mine = shard_ranges(self.model.layout.size, self.dp.size)[self.dp.rank]
        return [r.intersect(mine) for r in owned]

    def norm_vector(self) -> Any:
        return self.vector

    def memory(self) -> dict[str, int]:
        grads = self.model.grads.nbytes + (self._accum.nbytes if self._accum is not None else 0)
        return {"gradients": int(grads), "buffers": 0}

    # --- reproducible mode -----------------------------------------------------
    def reduce_words(self, acc: Any) -> None:
        """Sum the binned words of ``acc`` (bins agreed) over ``groups.dp``."""
        # Integer sums in float64 words: any Allreduce algorithm gives the same bits.
        # (A Reduce_scatter of the words, each rank converting its 1/N and an
        # Allgatherv of the gradient, moves fewer bytes but measured 10-60 % slower
        # with Open MPI 4.1 on one node, and mostly no faster at 4 ranks.)
        self.dp.Allreduce(acc.words, slot="repro-words")

    def repro_target(self) -> tuple[Any, int, int]:
        """``(out, start, stop)``: the world range of the sum this rank holds, and
        the array it goes into."""
        return self.vector, 0, self.model.layout.size

    def repro_shards(self) -> list[Range] | None:
        """Every rank's range of the sum where each holds its own only; None here."""
        return None

    def repro_nbytes(self) -> int:
        return 0


class ReducedToShards(GradientReduction):
    """Each data-parallel rank ends the step with its shard of the summed gradient
    only ([`shard_ranges`][mpishard.flat.shard_ranges]). With backward hooks the backward
    writes into two bucket-sized buffers in turn (the slots of
    ``GradientBuckets`` (``mpishard.comm.buckets``)); each bucket,
    once complete, is reduced to the shards (``Ireduce_scatter`` with per-rank
    counts, ``Iallreduce`` keeping this rank's piece, or a ring, whichever
    ``choose_reduce_method`` measured fastest) while the backward goes on.
    Every micro-batch is reduced (as DeepSpeed's stage 2): no ``no_sync``.

    Args:
        config: as [`GradientReduction`][mpishard.parallel.reduction.GradientReduction]'s.
        method: ``"auto"`` or one of ``REDUCE_METHODS`` (the option); the
            one used is ``method``.
    """

    #: Two bucket buffers: the backward fills one while the other is being reduced.
    slots = 2

    def __init__(self, config: ShardingConfiguration, method: str) -> None:
        super().__init__(config)
        #: The reduce method in use: the option, or the one ``"auto"`` measured
        #: fastest (chosen once: a rebuild keeps it).
        self.method = method
        #: ``method="auto"``: the times measured at attach, by method.
        self.method_timings: dict[str, float] = {}

    @classmethod
    def keeping(cls, config: ShardingConfiguration, method: str,
                old: GradientReduction | None) -> ReducedToShards:
        """A reduction over ``config`` with ``method`` (the option), or the method
        ``old`` (this core's reduction before a rebuild) chose: ``"auto"`` is
        measured once."""
        if not isinstance(old, ReducedToShards):
            return cls(config, method)
        again = cls(config, old.method)
        again.method_timings = old.method_timings
        return again

    def shed(self) -> None:
        super().shed()
        self.shard_grad = None
        self._scratch = None
        self._words = None

    def probe_kind(self) -> str:
        # overlap="auto" is decided before method="auto" (which is measured
        # blocking or not as that decides): the stand-in reduces to shards then.
        return "allreduce" if self.method == "allreduce" else "reduce_scatter"

    def attach(self, model: Any, xp: Any, buckets: GradientBuckets, bucketed: bool,
               accumulates: bool, check: Callable[[Any], None], dtype: Any = None) -> None:
        """As [`Allreduced.attach`][mpishard.parallel.reduction.Allreduced.attach];
        bucketed, the model's gradients are bound to the bucket buffers (the
        parameters may be sharded: ``model.params`` None). Collective over the
        training group (the method and reducer are measured)."""
        dp, n = self.dp, model.layout.size
        dtype = model.params.dtype if dtype is None else dtype
        self.model, self.xp, self.buckets, self.bucketed = model, xp, buckets, bucketed
        self._check = check
        self.shards = shard_ranges(n, dp.size)
        self.shard = self.shards[dp.rank]
        self.shard_grad = xp.zeros(len(self.shard), dtype=dtype)
        # Per bucket: the pieces every rank receives, and where mine goes.
        self._counts = [[len(b.intersect(s)) for s in self.shards] for b in buckets.ranges]
        self._mine = [b.intersect(self.shard) for b in buckets.ranges]
        # Later micro-batches are received here and added to the shard (one per
        # slot, made on first need: only accumulation uses them).
        self._scratch: list[Any] | None = None
        self._words: WordShards | None = None    # reproducible mode, on first need
        self._micro = 0
        if bucketed:
            buckets.allocate(xp, dtype)
            if self.pieces:
                model.bind_gradient_pieces(_piece_views(buckets), self.bucket_elements)
            else:
                model.bind_gradients(buckets.gradient_views(model.layout))
            _hook(model, buckets)
        else:
            _hook(model, None)
            buckets.vector = model.grads
        self._choose(buckets.largest, dtype, xp)

    def _choose(self, largest: int, dtype: Any, xp: Any) -> None:
        """The reduce method (``"auto"``: measured) and the reducer. Collective over
        the training group."""
        dp = self.dp
        if self.method == "auto":
            # Measured over this data group, chosen alike over the whole job (every
            # data group of a 3D layout adds the replicated tensors' copies the same
            # way); a stage without buckets measures nothing but takes part.
            if largest:
                choose_reduce_method(dp, largest, dtype, xp, self.method_timings,
                                     blocking=not self.bucketed)
            self.method = agree_on_fastest(self.config.groups.world, self.method_timings,
                                           REDUCE_METHODS, "reduce_scatter")
        dp.agree(None if self.method != "ring" or xp is np else
                 "reduce_method='ring' sums host (NumPy) arrays, got CuPy ones", ValueError)
        if self.config.reproducible or (self.method == "ring" and not largest):
            self.reducer = dp
        elif self.method == "ring":
            self.reducer = RingComm(dp)
            self.timings["choice"] = "ring"
        else:   # the ring is the method's
            kind = "allreduce" if self.method == "allreduce" else "reduce_scatter"
            self.reducer = self._measured(largest, dtype, xp, kind, ring=False)

    def reduce_bucket(self, index: int, source: Any, blocking: bool) -> Handle | None:
        """``GradientBuckets`` (``mpishard.comm.buckets``)' reduce call."""
        # GradientBuckets has waited for this slot's previous reduction, so its
        # scratch (and, bucketed, its buffer) is free.
        b, mine = self.buckets.ranges[index], self._mine[index]
        local = mine.shift(self.shard.start)
        target = self.shard_grad[local.start:local.stop]
        piece = source[mine.start - b.start:mine.stop - b.start] if len(mine) else source[:0]
        first = self._micro == 0
        if self.dp.size == 1:
            _store(target, piece, first)
            return None
        slot = index % self.slots
        recv = target if first else self._scratch_of(slot)[:len(mine)]
        allreduce = self.method == "allreduce"
        if blocking:
            if allreduce:
                self.reducer.Allreduce(source, slot=slot)
                _store(target, piece, first)
            else:
                self.reducer.Reduce_scatter(source, recv, self._counts[index], slot=slot)
                if not first:
                    _store(target, recv, False)
            return None
        if allreduce:
            return self.reducer.Iallreduce(source, slot=slot,
                                           finish=lambda: _store(target, piece, first))
        finish = None if first else (lambda: _store(target, recv, False))
        return self.reducer.Ireduce_scatter(source, recv, self._counts[index], slot=slot,
                                            finish=finish)

    def _scratch_of(self, slot: int) -> Any:
        if self._scratch is None:
            size = max(max(len(m) for m in self._mine), 1)
            self._scratch = [self.xp.empty(size, dtype=self.shard_grad.dtype)
                             for _ in range(self.slots)]
        return self._scratch[slot]

    # --- one micro-batch -------------------------------------------------------
    def _begin(self, micro: int, no_sync: bool) -> None:
        if no_sync:
            raise MpiShardError("no_sync() is not available with ZeRO-2: gradients are "
                                "reduced to shards during every backward; use "
                                "accumulation_steps to accumulate into the shards")
        self._micro = micro
        self.buckets.begin(True)

    def backward(self, micro: int, run: RunModel, no_sync: bool = False) -> float:
        """Micro-batch ``micro``: ``run`` it, then reduce what its backward did not
        launch, blocking (``no_sync``: an error). Collective over ``groups.dp``."""
        self._begin(micro, no_sync)
        loss = run(False)
        if not self.bucketed:
            self._check(self.model.grads)
        # (For a model without hooks that is every bucket, and it must be done
        # before the next backward overwrites the model's own gradient.)
        self.buckets.flush()
        return loss

    def skip(self, micro: int, replay: Callable[[], None] | None = None,
             no_sync: bool = False) -> None:
        """A micro-batch of no rows: the same calls as the others', with zeros
        (``replay``: the model's passes' hooks, without a model)."""
        self._begin(micro, no_sync)
        if replay is not None:
            replay()
        # Bucketed, the other ranks' backward launches every bucket non-blocking.
        self.buckets.flush(zero=True, blocking=not self.bucketed)

    def finish(self) -> None:
        """Complete the step's reduction. Collective over ``groups.dp``."""
        self.buckets.wait()

    # --- what the step reads -------------------------------------------------------
    def gradient(self, owned: Range) -> Any:
        """The summed gradient of world range ``owned`` (within this rank's shard)."""
        if not (self.shard.start <= owned.start and owned.stop <= self.shard.stop):
            raise ValueError(f"this rank holds the summed gradient of {self.shard}, "
                             f"not of {owned}")
        return self.shard_grad[owned.start - self.shard.start:owned.stop - self.shard.start]

    def norm_pieces(self, owned: list[Range]) -> list[Range]:
        # Shards partition the vector: each element is counted exactly once.
        return [r.intersect(self.shard).shift(self.shard.start) for r in owned]

    def norm_vector(self) -> Any:
        return self.shard_grad

    def memory(self) -> dict[str, int]:
        grads = self.shard_grad.nbytes + sum(int(b.nbytes) for b in self.buckets.buffers)
        if self.model.grads is not None:
            grads += self.model.grads.nbytes
        scratch = sum(int(a.nbytes) for a in self._scratch) if self._scratch else 0
        return {"gradients": int(grads), "buffers": scratch}

    # --- reproducible mode ------------------------------------------------------
    def reduce_words(self, acc: Any) -> None:
        """Sum the binned words of ``acc`` (bins agreed) over ``groups.dp``, this
        rank's shard of them at least."""
        # Integer sums in float64 words: either method, any algorithm, the same bits.
        if self.method == "allreduce":
            self.dp.Allreduce(acc.words, slot="repro-words")
            return
        # The words are padded per tensor: each rank receives its shard's padded range.
        if self._words is None:
            self._words = WordShards(acc, self.shards, self.dp.rank, self.xp)
        self._words.reduce(self.dp, acc)

    def repro_target(self) -> tuple[Any, int, int]:
        return self.shard_grad, self.shard.start, self.shard.stop

    def repro_shards(self) -> list[Range]:
        return self.shards

    def repro_nbytes(self) -> int:
        return self._words.nbytes() if self._words is not None else 0


def _piece_views(buckets: GradientBuckets) -> Callable[[Range], Any]:
    """``view(piece)``: where a gradient piece lives in the slot buffer of the
    bucket holding it (for ``bind_gradient_pieces``)."""
    def view(piece: Range) -> Any:
        index = buckets.index_of(piece.start)
        b = buckets.ranges[index]
        if piece.stop > b.stop:
            raise ValueError(f"gradient piece {piece} crosses the end of bucket {b}")
        return buckets.source(index)[piece.start - b.start:piece.stop - b.start]
    return view


def _store(target: Any, piece: Any, overwrite: bool) -> None:
    if overwrite:
        target[...] = piece
    else:
        target += piece


def choose_reduce_method(dp: FlatComm, elements: int, dtype: Any, xp: Any,
                         record: dict[str, float] | None = None,
                         repeats: int = 5, blocking: bool = False) -> str:
    """Time the ways of reducing one bucket to shards and return the fastest.

    Measured, not assumed: Open MPI 4.1's ``Reduce_scatter`` was slower than an
    ``Allreduce`` of the same buffer at 4 MiB and above on the machines this was
    written on, and both slower than a ring of point-to-point messages on one
    node (25M float32 on 2 ranks: 165, 59 and 15 ms); the answer differs
    between MPI libraries and networks. The ring is tried on host arrays of at
    least ``RING_MIN_ELEMENTS`` (``mpishard.comm.ring``) only. Each
    method's time is the slowest rank's best of ``repeats`` rounds that
    alternate the methods; every rank returns the same answer. ``blocking``
    measures the blocking forms (used when the reduction does not overlap a
    backward pass). Collective over ``dp``.
    """
    if dp.size == 1:
        return "reduce_scatter"
    buf = xp.zeros(max(elements, dp.size), dtype=dtype)
    counts = [len(s) for s in shard_ranges(buf.size, dp.size)]
    recv = xp.zeros(counts[dp.rank], dtype=dtype)
    ring = RingComm(dp) if xp is np and elements >= RING_MIN_ELEMENTS else None
    ways = {}
    for method in REDUCE_METHODS:
        if method == "ring" and ring is None:
            continue
        comm, kind = (ring, "reduce_scatter") if method == "ring" else (dp, method)
        ways[method] = functools.partial(reduce_once, comm, kind, blocking, buf, recv, counts)
    times = time_alternatives(dp, ways, repeats)
    if ring is not None:
        ring.free()
    if record is not None:
        record.update(times)
    return min(times, key=lambda m: (times[m], m))


def _hook(model: Any, buckets: GradientBuckets | None) -> None:
    """Point the model's backward hooks at ``buckets`` (None: off), where it has
    hooks: a rebuild that stops reducing during the backward must not leave them
    on the old buckets (issue 31). Local."""
    if isinstance(model, BucketedModel):
        model.set_backward_hooks(buckets)


def _reducer(choice: str, group: FlatComm) -> Reducer:
    """The reducer ``choice`` names over ``group`` (as
    [`choose`][mpishard.comm.hierarchical.choose] builds it). Collective over ``group``."""
    if choice == "ring":
        return RingComm(group)
    if choice == "hierarchical":
        return HierarchicalComm(group)
    return group
