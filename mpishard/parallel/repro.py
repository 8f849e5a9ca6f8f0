"""Reproducible mode: units of work fixed on the global batch, every sum order-independent.

With ``ShardingConfiguration(reproducible=True)`` a data-parallel strategy hands
its ``backward`` and the reductions of its ``step`` to :class:`ReproducibleStep`:

- **Units.** The global batch of ``B`` rows is cut into units of ``R`` rows
  (``config.unit_rows``; by default ``B // gcd(B, 24)``; a dataset's short last
  batch of an epoch, with ``drop_last=False``, into units of one row). ``backward`` cuts the
  rows it is given at unit boundaries and runs one forward/backward per unit on
  a fixed buffer of exactly ``R`` rows, so a unit's gradient, computed with the
  same shapes and the same code, has the same bits on whatever rank computes it.
  A pipelined model (:class:`~mpishard.parallel.HybridShardedModel`) runs one
  pass of its schedule per unit; every schedule runs the backward of micro-batch
  0, 1, ... in that order, so GPipe and 1F1B accumulate alike.
- **Sums.** Each unit's gradient and its loss (``R`` times its mean) are
  deposited into binned accumulators (:mod:`mpishard.reprosum`): integer sums,
  so neither the order of the units on a rank, nor how many ranks share them,
  nor the MPI algorithm changes a bit. At ``step()``: ``Allreduce(MAX)`` of the
  chunk bins over ``groups.dp``, then the words are summed over it (DDP:
  ``Allreduce``; ZeRO-2: ``Reduce_scatter`` to the shards or ``Allreduce``) and
  converted back to the gradient's dtype. The loss, and for clipping the global
  sum of squares (over each rank's share: any partition gives the same bits),
  ride as words in the step's one float64 ``Allreduce``, after a tiny
  ``Allreduce(MAX)`` of their bins over the step group. Row counts and flags are
  small integers: exact anyway.

What holds: parameters, optimizer state and losses are bitwise equal for every
data-parallel size that divides the unit count, DDP or ZeRO-2 (both reduce
methods), any gradient accumulation on unit boundaries, with or without
clipping, pipeline sizes and schedules at one tensor-parallel size, and across
a checkpoint restart or resize (state is stored exactly). Tensor-parallel sizes
change how a layer's matrix products are cut, hence the bits.

Costs: one forward/backward per unit instead of per micro-batch; a deposit per
unit (about ten passes over the gradient in float64); ``K`` float64 words per
element on every rank (16 bytes for float32, 24 for float64, ZeRO-2 included:
every unit deposits its whole gradient, so a rank cannot keep only its shard's
words without reducing after every unit) and their reduction instead of the
gradient's; no overlap of reduction and backward. Both the deposit and a unit's
weight-gradient write cost the same for any rows, so the overhead is about
units per rank times parameters: fewer, larger units (``unit_rows``) cost less.
``benchmarks/bench_reproducible.py`` measures them.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from ..backend import array_namespace
from ..reprosum import (
    CHUNK,
    EMPTY_BIN,
    NORM_WORD_BITS,
    NORM_WORDS,
    WORD_BITS,
    BinnedAccumulator,
    bin_of,
    fixed_bin_sum,
    words_to_float,
)

__all__ = ["DEFAULT_UNITS", "ReproducibleStep", "WordShards", "unit_rows_for"]

#: The default number of units in a global batch is ``gcd(B, DEFAULT_UNITS)``:
#: 24 has the divisors 1, 2, 3, 4, 6, 8, 12, 24.
DEFAULT_UNITS = 24

# Where the words sit in the step buffer, after the flags: the loss, then the squares.
_LOSS_WORDS = 3     # the loss is a float64: K = 3


def unit_rows_for(global_rows: int, unit_rows: int | None) -> int:
    """Rows per unit for a global batch of ``global_rows``: ``unit_rows``, or by
    default ``global_rows // gcd(global_rows, 24)``."""
    if unit_rows is not None:
        return unit_rows
    return global_rows // math.gcd(global_rows, DEFAULT_UNITS)


def _short_last_batch(strategy: Any, global_rows: int) -> bool:
    """A dataset's short last batch of an epoch (``optimize(..., drop_last=False)``):
    fewer rows than the run's ``batch_size`` (the training loop keeps it in
    ``data_position``, the same on every rank). The loop splits it over the ranks
    as evenly as its rows allow, which cuts units wherever the ranks' count falls:
    it runs in units of one row instead, the same units for any data-parallel size."""
    position = strategy.data_position
    return (position is not None and "batches" not in position
            and 0 < global_rows < int(position.get("batch_size", 0)))


class WordShards:
    """Sum the words of a :class:`~mpishard.reprosum.BinnedAccumulator` over a
    group so that each rank gets only its shard's: one ``Reduce_scatter`` per
    word row over the padded shard ranges (the words are padded per tensor).
    Integer sums in float64: any algorithm gives the same bits. Made once."""

    def __init__(self, acc: Any, shards: list[Any], rank: int, xp: Any) -> None:
        ends = [acc.padded_offset(r.start) for r in shards] + [acc.padded_size]
        self.counts = [b - a for a, b in zip(ends[:-1], ends[1:])]
        self.span = (ends[rank], ends[rank + 1])
        self.recv = xp.empty(max(self.counts[rank], 1), dtype=acc.words.dtype)

    def reduce(self, group: Any, acc: Any) -> None:
        """Collective over ``group``: the rank's padded span of every word row
        holds the group's sum; the rest of the words is left as it was."""
        lo, hi = self.span
        recv = self.recv[:hi - lo]
        for k in range(acc.k):
            row = acc.words[k].reshape(-1)
            group.Reduce_scatter(row[:acc.padded_size], recv, self.counts, slot="repro-words")
            row[lo:hi] = recv

    def nbytes(self) -> int:
        return int(self.recv.nbytes)


class ReproducibleStep:
    """The reproducible path of one data-parallel strategy (made at attach).

    Not collective itself; its methods are called from the strategy's
    ``backward`` and ``step``, which are (over ``groups.dp`` and the step group).
    """

    #: float64 slots it appends to the step buffer.
    extra = _LOSS_WORDS + NORM_WORDS

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        model = strategy.model
        self.xp = strategy.xp
        # Chunks restart at every tensor: a tensor's bits do not depend on its offset
        # (a pipeline stage holds the whole model's tensors at other offsets).
        segments = [spec.size for spec in sorted(model.layout, key=lambda t: t.offset)]
        if sum(segments) != model.params.size:
            segments = None
        self.grads = BinnedAccumulator(model.params.size, model.params.dtype, self.xp,
                                       segments=segments)
        self.loss = BinnedAccumulator(1, np.float64, np)
        self._loss_in = np.zeros(1)
        self._global_bins = self.xp.empty_like(self.grads.bins)
        self._small_bins = np.zeros(2, dtype=np.int64)   # loss, squares: MAX over the step group
        self._units: dict[tuple, tuple[Any, Any]] = {}
        self._norm_scratch = self.xp.empty(CHUNK * 64, dtype=np.float64)
        self._norm_slices = self.xp.empty(CHUNK * 64, dtype=np.float64)

    # --- backward: one forward/backward and one deposit per unit ------------------
    def backward(self, x: Any, y: Any, batch_start: int | None,
                 global_rows: int | None) -> float:
        """Run the units of rows ``[batch_start, batch_start + len(x))``; returns
        their local mean loss. Collective over ``groups.dp`` (one agreement)."""
        s = self.strategy
        model, dp, micro = s.model, s.dp, s._pending_micro
        rows = len(x)
        if batch_start is None:
            # As the default mode assumes: every rank and micro-batch has len(x) rows.
            per_rank = rows * s.accumulation_steps
            batch_start = dp.rank * per_rank + micro * rows
            global_rows = per_rank * dp.size
        r = self.unit_rows(global_rows)
        problem = None
        if global_rows % r:
            problem = (f"reproducible mode: the global batch of {global_rows} rows does not "
                       f"split into units of unit_rows={r} rows")
        elif batch_start % r or rows % r:
            problem = (f"reproducible mode: rows [{batch_start}, {batch_start + rows}) of "
                       f"data-parallel rank {dp.rank} cut a unit of {r} rows; the "
                       f"{global_rows // r} units of the global batch of {global_rows} rows "
                       f"must split evenly over {dp.size} data-parallel ranks and "
                       f"{s.accumulation_steps} micro-batches (choose a data-parallel size "
                       f"dividing {global_rows // r}, or set unit_rows)")
        dp.agree(problem, ValueError)
        t0 = time.perf_counter()
        deposit = 0.0
        total = 0.0
        if rows:
            xb, yb = self._unit_buffers(x, y, r)
            for u in range(rows // r):
                xb[...] = x[u * r:(u + 1) * r]
                yb[...] = y[u * r:(u + 1) * r]
                if s._batch_context:
                    model.set_batch_context(s.step_count, batch_start + u * r, global_rows)
                loss = s._forward_backward(model, xb, yb, False, r)
                t1 = time.perf_counter()
                self._loss_in[0] = r * loss
                ok = math.isfinite(loss) and self.grads.deposit(s._repro_source())
                if ok:
                    self.loss.deposit(self._loss_in)
                else:
                    s._local_bad = True
                total += r * loss
                deposit += time.perf_counter() - t1
        s.timings["forward_backward"] += time.perf_counter() - t0 - deposit
        s.timings["deposit"] = s.timings.get("deposit", 0.0) + deposit
        s._pending_micro += 1
        s._rows += rows
        return total / rows if rows else 0.0

    def unit_rows(self, global_rows: int) -> int:
        """Rows per unit of a global batch of ``global_rows`` (the same on every rank)."""
        if _short_last_batch(self.strategy, global_rows):
            return 1    # split over the ranks as evenly as the rows allow: cut anywhere
        return unit_rows_for(global_rows, self.strategy.config.unit_rows)

    def _unit_buffers(self, x: Any, y: Any, r: int) -> tuple[Any, Any]:
        """A unit's rows are copied here: the same shapes and memory for every unit."""
        key = (r, tuple(x.shape[1:]), x.dtype.str, tuple(y.shape[1:]), y.dtype.str)
        bufs = self._units.get(key)
        if bufs is None:
            xp = array_namespace(x)
            bufs = (xp.empty((r,) + tuple(x.shape[1:]), dtype=x.dtype),
                    xp.empty((r,) + tuple(y.shape[1:]), dtype=y.dtype))
            self._units[key] = bufs
        return bufs

    # --- step: the gradient --------------------------------------------------------
    def reduce(self) -> float:
        """Sum the deposited gradients over ``groups.dp`` and convert them where the
        strategy updates from; returns the seconds of the conversion (counted in
        ``timings["deposit"]``; the caller counts the rest as communication).
        Collective over ``groups.dp``."""
        s, acc = self.strategy, self.grads
        if s.dp.size > 1:
            self._global_bins[...] = acc.bins
            s.dp.Allreduce(self._global_bins, slot="repro-bins", op="max")
            acc.realign(self._global_bins)
            s._reduce_words(acc)
        t1 = time.perf_counter()
        out, start, stop = s._repro_target()
        acc.to_float(out, start, stop)
        acc.clear()
        seconds = time.perf_counter() - t1
        s.timings["deposit"] = s.timings.get("deposit", 0.0) + seconds
        return seconds

    # --- step: the totals (loss, sum of squares) -------------------------------------
    def fill_totals(self, buf: Any, base: int, clipping: bool) -> None:
        """Agree on the loss's and the squares' bins over the step group and write
        this rank's words at ``buf[base:]``. Collective over the step group."""
        s = self.strategy
        bins = self._small_bins
        bins[0] = self.loss.bins[0] if s._counts_rows else EMPTY_BIN
        bins[1] = EMPTY_BIN
        pieces = []
        if clipping:
            vector = s._norm_vector()
            pieces = [vector[r.start:r.stop] for r in s._norm_ranges]
            top = 0.0
            for p in pieces:
                top = max(top, float(p.max()), -float(p.min()))
            bins[1] = bin_of(top * top, NORM_WORD_BITS)
        s._stepper.Allreduce(bins, slot="repro-small", op="max")
        if s._counts_rows:
            self.loss.realign(bins[:1].copy())
            buf[base:base + _LOSS_WORDS] = self.loss.words[:, 0, 0]
        self.loss.clear()
        if clipping:
            words = [0.0] * NORM_WORDS
            for p in pieces:
                for k, w in enumerate(fixed_bin_sum(p, int(bins[1]), self._norm_scratch,
                                                    self._norm_slices, square=True)):
                    words[k] += w
            buf[base + _LOSS_WORDS:base + self.extra] = words

    def read_totals(self, buf: Any, base: int) -> tuple[float, float]:
        """The global loss sum and sum of squares from the reduced words."""
        bins = self._small_bins
        loss = words_to_float(buf[base:base + _LOSS_WORDS].tolist(), int(bins[0]), WORD_BITS)
        squares = words_to_float(buf[base + _LOSS_WORDS:base + self.extra].tolist(),
                                 int(bins[1]), NORM_WORD_BITS)
        return loss, squares

    def nbytes(self) -> int:
        shards = getattr(self.strategy, "_repro_words", None)
        return (self.grads.nbytes() + (shards.nbytes() if shards is not None else 0)
                + sum(int(a.nbytes) + int(b.nbytes) for a, b in self._units.values()))
