"""``ZeRO2Core``: gradients and optimizer state sharded over the data group."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..comm import FlatComm, Handle
from ..comm.ring import RING_MIN_ELEMENTS, RingComm
from ..comm.timing import agree_on_fastest, reduce_once, time_alternatives
from ..errors import MpiShardError
from ..flat import Range, shard_ranges
from ..protocols import Model
from .base import DataParallelCore, DataParallelOptions, _nbytes
from .reproexchange import WordShards

__all__ = ["REDUCE_METHODS", "ZeRO2Core", "ZeRO2Options", "choose_reduce_method"]

#: Ways of reducing a bucket to its shards: MPI's reduce-scatter, MPI's allreduce
#: (keeping this rank's piece), or a ring of point-to-point messages
#: (:class:`~mpishard.comm.ring.RingComm`; host arrays only).
REDUCE_METHODS = ("reduce_scatter", "allreduce", "ring")

# Two bucket buffers: the backward fills one while the other is being reduced.
_SLOTS = 2


@dataclass(frozen=True)
class ZeRO2Options(DataParallelOptions):
    """:class:`~mpishard.parallel.base.DataParallelOptions` and ZeRO-2's own.

    Attributes:
        reduce_method: ``"auto"`` (measure them at attach, on a bucket-sized
            buffer, and keep the fastest), ``"reduce_scatter"``, ``"allreduce"``
            or ``"ring"`` (:class:`~mpishard.comm.ring.RingComm`; host arrays
            only). All give the same sum up to rounding; on 3 or more ranks they
            may add in a different order, so pin one where two runs must agree
            bit for bit, or train with ``ShardingConfiguration(reproducible=True)``.
        buddy_copies: with fault tolerance on, each rank keeps copies of its
            right neighbour's shard (parameters and optimizer state) and of its
            own from before the update (:class:`~mpishard.recovery.ShardBuddy`),
            so a rank lost at any point of a step is recovered exactly; False: a
            lost shard rolls back to the newest checkpoint.
        overlap: as :class:`~mpishard.parallel.base.DataParallelOptions`', but
            True by default: reducing after the backward needs the whole
            gradient, which the bucketed backward never holds (two bucket
            buffers and the shard instead), so ``"auto"`` could trade ZeRO's
            gradient memory for a timing. Pass ``"auto"`` to let it.
    """

    # (Redefined with ZeRO's default; a dataclass field keeps its place.)
    overlap: bool | str = True
    reduce_method: str = "auto"
    buddy_copies: bool = True

    def problem(self) -> str | None:
        if self.reduce_method not in ("auto",) + REDUCE_METHODS:
            return (f"reduce_method must be 'auto' or one of {REDUCE_METHODS}, "
                    f"got {self.reduce_method!r}")
        return super().problem()


class ZeRO2Core(DataParallelCore):
    """ZeRO stage 2: each data-parallel rank keeps 1/N of gradients and state.

    The flat vector is cut into N contiguous shards (:func:`~mpishard.flat.shard_ranges`;
    shards do not respect tensor boundaries, the last ones may be shorter). With the
    library's models the backward pass writes gradients into two bucket-sized
    buffers in turn (the slots of :class:`~mpishard.comm.buckets.GradientBuckets`);
    each bucket, once complete, is reduced to its shards
    (``Ireduce_scatter`` with per-rank counts, ``Iallreduce`` and keep my piece,
    or a ring of point-to-point messages, whichever :func:`choose_reduce_method`
    measured fastest) while the backward
    goes on, and the rank keeps only the piece of its shard. The full reduced
    gradient never exists; peak gradient memory is two buffers of the largest
    bucket plus the shard. The wrapped optimizer then updates the rank's shard of
    the parameters with state of the shard's length, and an in-place ``Allgatherv``
    rebuilds the full parameters on every rank.

    A model that is not a :class:`~mpishard.protocols.BucketedModel` (for example
    a :class:`~mpishard.nn.FunctionModel` returning its whole gradient) keeps its
    full gradient; only the reduced gradient and the state are sharded then.

    Gradient accumulation reduces every micro-batch into the shard (as DeepSpeed
    does at stage 2); :meth:`no_sync` is not available, since skipping the
    reduction would need the full gradient.

    Args and options: :class:`~mpishard.parallel.base.DataParallelCore`'s, and
    :class:`ZeRO2Options` (``reduce_method``, ``buddy_copies``).
    """

    strategy = "zero2"
    public = "ZeRO2Optimizer"
    _slots = _SLOTS

    Options = ZeRO2Options

    def __init__(self, optimizer: Any, config: Any = None, *, model: Model | None = None,
                 **options: Any) -> None:
        #: reduce_method="auto": the times measured at attach, by method.
        self.reduce_timings: dict[str, float] = {}
        super().__init__(optimizer, config, model=model, **options)

    # --- setting up ----------------------------------------------------------
    def _setup(self) -> None:
        model, xp, dp, buckets = self.model, self.xp, self.dp, self.buckets
        n, dtype = model.params.size, model.params.dtype
        self.shards = shard_ranges(n, dp.size)
        self.shard = self.shards[dp.rank]
        self.shard_counts = [len(s) for s in self.shards]
        self.shard_grad = xp.zeros(len(self.shard), dtype=dtype)
        self.state = self.optimizer.init_state(len(self.shard), dtype, xp)
        self._params_shard = model.params[self.shard.start:self.shard.stop]
        # Per bucket: the pieces every rank receives, and where mine goes.
        self._counts = [[len(b.intersect(s)) for s in self.shards] for b in buckets.ranges]
        self._mine = [b.intersect(self.shard) for b in buckets.ranges]
        # Later micro-batches are received here and added to the shard (one per
        # slot, made on first need: only accumulation uses them).
        self._scratch: list[Any] | None = None
        self._repro_words: WordShards | None = None    # reproducible mode, on first need
        # keep_previous_step(): this rank's shard as it was before the last update.
        self.previous: dict[str, Any] | None = None
        self.previous_step = -1
        if self.bucketed:
            buckets.allocate(xp, dtype)
            model.bind_gradients(buckets.gradient_views(self.layout))
            model.set_backward_hooks(buckets)
        else:
            buckets.vector = model.grads
        # Without buckets (a stage with no parameters) nothing is reduced: nothing
        # to measure. Every rank of the data group holds the same layout.
        largest = buckets.largest
        if self.reduce_method == "auto":   # chosen once: a rebuild keeps it
            # Measured over this data group, chosen alike over the whole job (every
            # data group of a 3D layout adds the replicated tensors' copies the same
            # way); a stage without buckets measures nothing but takes part.
            if largest:
                choose_reduce_method(dp, largest, dtype, xp, self.reduce_timings,
                                     blocking=not self.bucketed)
            self.reduce_method = agree_on_fastest(
                self.config.groups.world, self.reduce_timings, REDUCE_METHODS,
                "reduce_scatter")
        dp.agree(None if self.reduce_method != "ring" or xp is np else
                 "reduce_method='ring' sums host (NumPy) arrays, got CuPy ones", ValueError)
        # That reduction over the data group, in two levels (inside the nodes,
        # then across) where that measured faster at this bucket size, or the ring
        # that reduce_method names.
        self._release()   # attached before
        self.reduction_timings: dict[str, Any] = {}
        if self.config.reproducible or (self.reduce_method == "ring" and not largest):
            self.reducer = dp
        elif self.reduce_method == "ring":
            self.reducer = RingComm(dp)
            self.reduction_timings["choice"] = "ring"
        else:   # the ring is reduce_method's
            kind = "allreduce" if self.reduce_method == "allreduce" else "reduce_scatter"
            self.reducer = self._measured_reducer(largest, dtype, kind, ring=False)

    def _probe_kind(self) -> str:
        # overlap="auto" is decided before reduce_method="auto" (which is measured
        # blocking or not as that decides): the stand-in reduces to shards then.
        return "allreduce" if self.reduce_method == "allreduce" else "reduce_scatter"

    @property
    def slots(self) -> list[Any]:
        """The bucket buffers the backward writes into (empty without hooks)."""
        return self.buckets.buffers

    # --- how one bucket is reduced: to the shards ----------------------------
    def _reduce(self, index: int, source: Any, blocking: bool) -> Handle | None:
        # GradientBuckets has waited for this slot's previous reduction, so its
        # scratch (and, bucketed, its buffer) is free.
        b, mine = self.buckets.ranges[index], self._mine[index]
        local = mine.shift(self.shard.start)
        target = self.shard_grad[local.start:local.stop]
        piece = source[mine.start - b.start:mine.stop - b.start] if len(mine) else source[:0]
        first = self._micro_now == 0
        if self.dp.size == 1:
            _store(target, piece, first)
            return None
        slot = index % _SLOTS
        recv = target if first else self._scratch_of(slot)[:len(mine)]
        if blocking:
            if self.reduce_method == "allreduce":
                self.reducer.Allreduce(source, slot=slot)
                _store(target, piece, first)
            else:
                self.reducer.Reduce_scatter(source, recv, self._counts[index], slot=slot)
                if not first:
                    _store(target, recv, False)
            return None
        if self.reduce_method == "allreduce":
            return self.reducer.Iallreduce(source, slot=slot,
                                           finish=lambda: _store(target, piece, first))
        finish = None if first else (lambda: _store(target, recv, False))
        return self.reducer.Ireduce_scatter(source, recv, self._counts[index], slot=slot,
                                            finish=finish)

    def _scratch_of(self, slot: int) -> Any:
        if self._scratch is None:
            size = max(max(len(m) for m in self._mine), 1)
            self._scratch = [self.xp.empty(size, dtype=self.dtype)
                             for _ in range(_SLOTS)]
            self._peak_bytes = max(self._peak_bytes, self._current_bytes())
        return self._scratch[slot]

    # --- one micro-batch -------------------------------------------------------
    def _begin(self, micro: int) -> None:
        if self._no_sync:
            raise MpiShardError("no_sync() is not available with ZeRO-2: gradients are "
                                "reduced to shards during every backward; use "
                                "accumulation_steps to accumulate into the shards")
        self._micro_now = micro
        self.buckets.begin(True)

    def _backward(self, model: Model, x: Any, y: Any, micro: int, rows: int) -> float:
        self._begin(micro)
        loss = self._forward_backward(model, x, y, False, rows)
        if not self.bucketed:
            self._check_local(model.grads)
        # The backward is over: reduce the rest with blocking collectives. (For a
        # model without hooks that is every bucket, and it must be done before
        # the next backward overwrites the model's own gradient.)
        self.buckets.flush()
        return loss

    def _skip(self, micro: int) -> None:
        self._begin(micro)
        # Bucketed, the other ranks' backward launches every bucket non-blocking.
        self.buckets.flush(zero=True, blocking=not self.bucketed)

    def _finish_gradients(self) -> None:
        self.buckets.wait()

    # --- reproducible mode ------------------------------------------------------
    def _reduce_words(self, acc: Any) -> None:
        # Integer sums in float64 words: either method, any algorithm, the same bits.
        if self.reduce_method == "allreduce":
            self.dp.Allreduce(acc.words, slot="repro-words")
            return
        # The words are padded per tensor: each rank receives its shard's padded range.
        if self._repro_words is None:
            self._repro_words = WordShards(acc, self.shards, self.dp.rank, self.xp)
        self._repro_words.reduce(self.dp, acc)

    def _repro_target(self) -> tuple[Any, int, int]:
        return self.shard_grad, self.shard.start, self.shard.stop

    def _repro_shards(self) -> list[Range]:
        return self.shards

    # --- norm, update and gather -----------------------------------------------
    def _norm_pieces(self, owned: list[Range]) -> list[Range]:
        # Shards partition the vector: each element is counted exactly once.
        return [r.intersect(self.shard).shift(self.shard.start) for r in owned]

    def _norm_vector(self) -> Any:
        return self.shard_grad

    def keep_previous_step(self) -> None:
        """From now on, keep a copy of this rank's shard of the parameters and of
        the optimizer state as they were before each update (:attr:`previous`,
        keys ``"params"`` and the state's; :attr:`previous_step`: the step they
        hold), so that a step interrupted after some ranks updated (a rank lost
        in the parameter ``Allgatherv``) can be undone exactly
        (:mod:`mpishard.recovery.shardcopy`). Costs one more shard of the
        parameters and of the state, and one copy of them per step. Local."""
        if self.previous is None:
            xp = self.xp
            self.previous = {"params": xp.empty_like(self._params_shard),
                             **{name: xp.empty_like(v) for name, v in self.state.items()}}
            self._peak_bytes = max(self._peak_bytes, self._current_bytes())

    def _update(self, lr: float, grad_scale: float) -> None:
        if self.previous is not None:   # step_count is this update's already
            self.previous["params"][...] = self._params_shard
            for name, value in self.state.items():
                self.previous[name][...] = value
            self.previous_step = self.step_count - 1
        if len(self.shard):
            self.optimizer.update(self._params_shard, self.shard_grad, self.state,
                                  self.step_count, lr, grad_scale)

    def _gather_parameters(self) -> None:
        if self.dp.size > 1:
            self.dp.Allgatherv(self.model.params, self.shard_counts)

    # --- reports and state ---------------------------------------------------
    def _memory(self) -> dict[str, int]:
        model = self.model
        grads = self.shard_grad.nbytes + _nbytes(self.slots)
        if model.grads is not None:
            grads += model.grads.nbytes
        buffers = _nbytes(self._scratch) if self._scratch is not None else 0
        if self.previous is not None:
            buffers += _nbytes(self.previous.values())
        # The whole vector, or (ZeRO-3, the model holding none) the shard.
        params = model.params if model.params is not None else self._params_shard
        return {"parameters": int(params.nbytes), "gradients": int(grads),
                "optimizer_state": _nbytes(self.state.values()), "buffers": int(buffers)}

    def optimizer_state_shard(self) -> tuple[Range, dict[str, Any]]:
        """The world range of the optimizer state this rank holds, and the state."""
        return self.shard, self.state

    def synchronize_optimizer_state(self) -> dict[str, Any]:
        """Gather the sharded optimizer state into full vectors on every rank.

        For a checkpoint or an export; allocates full-size arrays (they count in
        the peak of :meth:`memory_report`). Collective over ``groups.dp``.
        """
        n = self.layout.size
        full = {}
        for name, shard in self.state.items():
            whole = self.xp.zeros(n, dtype=shard.dtype)
            whole[self.shard.start:self.shard.stop] = shard
            if self.dp.size > 1:
                self.dp.Allgatherv(whole, self.shard_counts, slot=("state", name))
            full[name] = whole
        self._peak_bytes = max(self._peak_bytes, self._current_bytes()
                               + _nbytes(full.values()))
        return full

    _micro_now = 0


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
    least :data:`~mpishard.comm.ring.RING_MIN_ELEMENTS` only. Each
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
