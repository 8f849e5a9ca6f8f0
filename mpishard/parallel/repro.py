"""Reproducible mode: units of work fixed on the global batch, every sum order-independent.

With ``ShardingConfiguration(reproducible=True)`` a data-parallel core (DDP,
ZeRO-2, ZeRO-3) hands its ``backward`` and the sums of its ``step`` to
`ReproducibleStep`, which stands in for its gradient reduction's step
(``reduce_step``, ``fill_totals``, ``read_totals``), counts its units in the
core's [`StepTotals`][mpishard.parallel.totals.StepTotals] and keeps its own
state:

- **Units.** The global batch of ``B`` rows is cut into units of ``R`` rows
  (`unit_rows_for`: ``gcd(B, 24)`` units by default, ``gcd(B, lcm)`` of
  ``config.reproducible_sizes``, or ``config.unit_rows``; a dataset's short last
  batch of an epoch, with ``drop_last=False``, into units of one row).
  ``backward`` cuts the rows it is given at unit boundaries and runs one
  forward/backward per unit on a fixed buffer of exactly ``R`` rows, so a unit's
  gradient, computed with the same shapes and the same code, has the same bits
  on whatever rank computes it. A pipelined model (a
  [`UnitPassModel`][mpishard.protocols.UnitPassModel]:
  [`HybridShardedModel`][mpishard.nn.hybrid.HybridShardedModel]) runs passes of its schedule
  whose micro-batches are whole units (up to ``micro_batches`` a pass), each
  unit's gradient taken after its own backward: neither the micro-batch count,
  nor the schedule, nor the pipeline size changes a bit.
- **Sums.** The step's gradient is the binned sum ([`mpishard.reprosum`][mpishard.reprosum]) of
  the units' gradients: integer arithmetic, so neither the order of the units,
  nor how many ranks share them, nor the MPI algorithm changes a bit. Two ways
  to the same bits, chosen per step by the most units a rank holds (one small
  ``Allreduce(MAX)`` over ``groups.dp``):

  * **few units a rank** (at most `HELD_UNITS`, twice that alone; one
    unit per rank is the usual case at the largest size): each rank keeps its
    units' gradients as floats (the last where the model wrote it, the others
    copied aside), an ``Alltoallv`` per unit over ``groups.dp`` gives each rank
    every unit's chunks of the range it converts (its ZeRO-2/3 shard; for DDP an
    equal part on chunk boundaries, then an ``Allgatherv``), and
    `mpishard.kernels.deposit.exact_sum` sums them there in one pass whose
    words never leave the cache. On the wire: the default mode's bytes
    (reduce-scatter and allgather of the gradient) with the reduce-scatter's
    times the units a rank holds.
  * **many units a rank**: the held units are deposited into ``K`` float64
    words per element whenever the rows are full
    (`mpishard.kernels.deposit.deposit_rows`: one pass over the words for
    the rows); at ``step()``: ``Allreduce(MAX)`` of the chunk bins over
    ``groups.dp``, the words summed over it (DDP: ``Allreduce``; ZeRO-2/3:
    ``Reduce_scatter`` or ``Allreduce``) and converted back.

  The loss ([`ScalarSum`][mpishard.reprosum.ScalarSum]), and for clipping the global
  sum of squares (over each rank's share: any partition gives the same bits),
  ride as words in the step's one float64 ``Allreduce``, after a tiny
  ``Allreduce(MAX)`` of their bins over the step group. Row counts and flags are
  small integers: exact anyway. A unit's non-finite loss or gradient puts NaN
  in those words and flags the rank that computed it: the step is refused.

What holds: parameters, optimizer state and losses are bitwise equal for every
data-parallel size that divides the unit count, DDP, ZeRO-2 or ZeRO-3 (every
reduce method), any gradient accumulation on unit boundaries, with or without
clipping, pipeline sizes, schedules and micro-batch counts at one
tensor-parallel size, and across a checkpoint restart or resize (state is
stored exactly). Tensor-parallel sizes change how a layer's matrix products are
cut, hence the bits.

Costs: one forward/backward per unit (a unit's matrix products of ``R`` rows,
and its weight-gradient products write the whole gradient, whatever its rows);
the units' gradients copied aside and read once more (few a rank), or
deposited into ``K`` words per element (many); their exchange. The fewer units
a rank computes, the closer to the default step (``reproducible_sizes`` makes
them fewer): ``benchmarks/bench_reproducible.py`` measures it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..backend import array_namespace
from ..flat import Range, shard_ranges
from ..kernels import deposit as kernels
from ..protocols import UnitPassModel
from ..reprosum import (
    CHUNK,
    EMPTY_BIN,
    NORM_WORD_BITS,
    NORM_WORDS,
    WORD_BITS,
    BinnedAccumulator,
    ChunkGrid,
    ScalarSum,
    bin_of,
    words_to_float,
)
from .reproexchange import FloatExchange
from .totals import StepTotals

__all__ = ["DEFAULT_UNITS", "HELD_UNITS", "ReproducibleStep", "unit_rows_for"]

#: The default number of units in a global batch is ``gcd(B, DEFAULT_UNITS)``:
#: 24 has the divisors 1, 2, 3, 4, 6, 8, 12, 24.
DEFAULT_UNITS = 24

#: The most units' gradients a rank keeps as floats (per float item size): up to
#: this many take the float path; a step in which any rank holds more takes the
#: words path. The float path's memory stays below the words path's (``K``
#: words, 16 bytes an element for float32 and 24 for float64, beside these held
#: rows): over several ranks it also receives every unit's piece of its range
#: (about as many floats again), alone it keeps twice as many (its rows are all).
HELD_UNITS = {4: 4, 8: 3}

# Where the words sit in the step buffer, after the flags: the loss, then the squares.
_LOSS_WORDS = 3     # the loss is a float64: K = 3


def unit_rows_for(global_rows: int, unit_rows: int | None,
                  sizes: tuple[int, ...] | None = None) -> int:
    """Rows per unit for a global batch of ``global_rows``: ``unit_rows``, or
    ``global_rows // gcd(global_rows, L)`` with ``L`` the least common multiple of
    ``sizes`` (``config.reproducible_sizes``; by default `DEFAULT_UNITS`)."""
    if unit_rows is not None:
        return unit_rows
    units = math.lcm(*sizes) if sizes else DEFAULT_UNITS
    return global_rows // math.gcd(global_rows, units)


def _short_last_batch(strategy: Any, global_rows: int) -> bool:
    """A dataset's short last batch of an epoch (``optimize(..., drop_last=False)``):
    fewer rows than the run's ``batch_size`` (the training loop keeps it in
    ``data_position``, the same on every rank). The loop splits it over the ranks
    as evenly as its rows allow, which cuts units wherever the ranks' count falls:
    it runs in units of one row instead, the same units for any data-parallel size."""
    position = strategy.data_position
    return (position is not None and "batches" not in position
            and 0 < global_rows < int(position.get("batch_size", 0)))


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
        self.size = model.layout.size
        self.dtype = strategy.dtype
        # Chunks restart at every tensor: a tensor's bits do not depend on its offset
        # (a pipeline stage holds the whole model's tensors at other offsets).
        specs = sorted(model.layout, key=lambda t: t.offset)
        self.segments = [(t.offset, t.offset + t.size) for t in specs if t.size]
        if sum(b - a for a, b in self.segments) != self.size:
            self.segments = [(0, self.size)] if self.size else []
        self.held_max = HELD_UNITS[self.dtype.itemsize] * (2 if strategy.dp.size == 1 else 1)
        self.loss = ScalarSum()
        self._small_bins = np.zeros(2, dtype=np.int64)   # loss, squares: MAX over the step group
        self._units: dict[tuple, tuple[Any, Any]] = {}
        self._norm_scratch = self.xp.empty(CHUNK * 64, dtype=np.float64)
        self._norm_slices = self.xp.empty(CHUNK * 64, dtype=np.float64)
        # This step's units on this rank: ``_count`` of them. The last one is still
        # where the model wrote it (``_pending``), the ones before it in the first
        # ``_n_held`` rows of ``_held``; whenever the rows are full they are
        # deposited into the words (``_in_words``: the step takes the words path).
        self._count = 0
        self._n_held = 0
        self._pending = False
        self._in_words = False
        self._held: Any = None              # (rows, size), grown on need to held_max rows
        self._words: BinnedAccumulator | None = None      # on first need
        self._global_bins: Any = None
        self._exchange: FloatExchange | None = None
        self._dp_to_step: list[int] | None = None     # flags: data-parallel -> step rank
        # Non-finite values this step: a unit's loss here; a unit's gradient here
        # (words path), or a rank whose unit this rank found so (float path). The
        # step is then refused: NaN rides in the loss's or the squares' words.
        self._bad_loss = False
        self._bad_grad = False
        self._bad_rank: int | None = None
        # A pipelined model runs passes whose micro-batches are whole units.
        self._passes = model if isinstance(model, UnitPassModel) else None
        self._pass_losses = np.zeros(model.micro_batches if self._passes is not None else 0)
        self._real = 0          # the units of this pass that are this rank's (_run_passes)
        self._deposit_seconds = 0.0
        #: The model's forward/backward calls so far (one per unit).
        self.calls = 0

    # --- backward: one forward/backward per unit ----------------------------------
    def backward(self, x: Any, y: Any, batch_start: int | None, global_rows: int | None,
                 replay: Callable[[], None] | None = None) -> float:
        """Run the units of rows ``[batch_start, batch_start + len(x))``; returns
        their local mean loss. ``replay``: where the model's passes gather
        parameters over ``groups.dp`` (ZeRO-3), the hook calls of one
        ``forward_backward`` without a model. Collective over ``groups.dp``.

        With ``replay``, a short last batch gives the ranks unequal units: those
        with fewer join the others' gathers without a model, after their own
        passes. How many is agreed before any pass: a pass waits for its gathers,
        so a rank must not be waiting in another collective meanwhile. (A
        pipelined model's passes are run alike on every rank: `_run_passes`.)
        """
        if replay is None or self._passes is not None:
            return self._units_backward(x, y, batch_start, global_rows)
        s, rows = self.strategy, len(x)
        # Without global_rows, as below: every rank has len(x).
        total = global_rows if global_rows is not None else \
            rows * s.accumulation_steps * s.dp.size
        unit = self.unit_rows(total)
        most = int(s.dp.allreduce(rows, op="max")) // unit if unit else 0
        calls = self.calls
        loss = self._units_backward(x, y, batch_start, global_rows)
        for _ in range(most - (self.calls - calls)):
            replay()
        return loss

    def _units_backward(self, x: Any, y: Any, batch_start: int | None,
                        global_rows: int | None) -> float:
        """One forward/backward per unit of this rank's rows. Collective over
        ``groups.dp`` (one agreement)."""
        s = self.strategy
        model, dp = s.model, s.dp
        rows = len(x)
        if batch_start is None:
            # As the default mode assumes: every rank and micro-batch has len(x) rows.
            per_rank = rows * s.accumulation_steps
            batch_start = dp.rank * per_rank + s.totals.micro * rows
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
                       f"dividing {global_rows // r}, or set reproducible_sizes or "
                       f"unit_rows)")
        dp.agree(problem, ValueError)
        t0 = time.perf_counter()
        self._deposit_seconds = 0.0
        total = 0.0
        if self._passes is not None and (rows or s.placement.lockstep):
            total = self._run_passes(x, y, r, batch_start, global_rows)
        elif rows:
            xb, yb = self._unit_buffers(x, y, r, 0)
            for u in range(rows // r):
                self._make_room()
                xb[...] = x[u * r:(u + 1) * r]
                yb[...] = y[u * r:(u + 1) * r]
                if s.sets_batch_context:
                    model.set_batch_context(s.step_count, batch_start + u * r, global_rows)
                loss = s.run_model(model, xb, yb, False, r)
                self.calls += 1
                self._took_unit()
                self._add_loss(loss, r)
                total += r * loss
        deposit = self._deposit_seconds
        s.timings["forward_backward"] += time.perf_counter() - t0 - deposit
        s.timings["deposit"] = s.timings.get("deposit", 0.0) + deposit
        s.totals.counted(rows)
        return total / rows if rows else 0.0

    def unit_rows(self, global_rows: int) -> int:
        """Rows per unit of a global batch of ``global_rows`` (the same on every rank)."""
        if _short_last_batch(self.strategy, global_rows):
            return 1    # split over the ranks as evenly as the rows allow: cut anywhere
        config = self.strategy.config
        return unit_rows_for(global_rows, config.unit_rows, config.reproducible_sizes)

    def _run_passes(self, x: Any, y: Any, r: int, batch_start: int, global_rows: int) -> float:
        """A pipelined model: passes of its schedule whose micro-batches are this
        rank's units, up to ``micro_batches`` a pass; each unit's gradient is taken
        right after its own backward (so neither the micro-batch count, nor the
        schedule, nor the pipeline size changes a bit). Where the passes
        communicate over ``groups.dp`` (``_lockstep_passes``) every rank runs the
        passes of the most units any holds (one ``Allreduce(MAX)``), its missing
        units as zeros whose gradients and losses are dropped (ranks hold unequal
        units only in a short last batch). Returns the rows' loss sum."""
        s, model = self.strategy, self.strategy.model
        per_pass, units = model.micro_batches, len(x) // r
        most = int(s.dp.allreduce(units, op="max")) if s.placement.lockstep else units
        losses, total = self._pass_losses, 0.0
        for first in range(0, most, per_pass):
            count = min(per_pass, most - first)
            self._real = max(0, min(count, units - first))
            xs, ys, contexts = [], [], []
            for i in range(count):
                xb, yb = self._unit_buffers(x, y, r, i)
                u = first + i
                if i < self._real:
                    xb[...] = x[u * r:(u + 1) * r]
                    yb[...] = y[u * r:(u + 1) * r]
                    contexts.append((s.step_count, batch_start + u * r, global_rows))
                else:
                    xb.fill(0)
                    yb.fill(0)
                    contexts.append((s.step_count, 0, global_rows))     # any rows: dropped
                xs.append(xb)
                ys.append(yb)
            model.forward_backward_units(xs, ys, losses,
                                         contexts=contexts if s.sets_batch_context else None,
                                         loss_scale=r, before_backward=self._before_unit,
                                         after_backward=self._after_unit)
            for i in range(self._real):
                self._add_loss(float(losses[i]), r)
                total += r * float(losses[i])
        return total

    def _before_unit(self, i: int) -> None:
        self._make_room()

    def _after_unit(self, i: int) -> None:
        if i < self._real:       # not a stand-in of a rank with fewer units
            self._took_unit()

    def _unit_buffers(self, x: Any, y: Any, r: int, i: int) -> tuple[Any, Any]:
        """Unit ``i`` of a pass is copied here: the same shapes and memory for every
        unit in that place (made once)."""
        key = (r, i, tuple(x.shape[1:]), x.dtype.str, tuple(y.shape[1:]), y.dtype.str)
        bufs = self._units.get(key)
        if bufs is None:
            xp = array_namespace(x)
            bufs = (xp.empty((r,) + tuple(x.shape[1:]), dtype=x.dtype),
                    xp.empty((r,) + tuple(y.shape[1:]), dtype=y.dtype))
            self._units[key] = bufs
        return bufs

    def _make_room(self) -> None:
        """Before a unit's backward overwrites the model's gradient: move the pending
        unit into a row (after depositing the rows into the words, when full)."""
        if not self._pending:
            return
        t1 = time.perf_counter()
        if self._n_held == self.held_max:
            self._flush()
        self._held_rows(self._n_held + 1)[self._n_held][...] = \
            self.strategy.reduction.repro_source(self.strategy.model).reshape(-1)
        self._n_held += 1
        self._pending = False
        self._deposit_seconds += time.perf_counter() - t1

    def _took_unit(self) -> None:
        """A unit's backward wrote its gradient where the model keeps it."""
        self._count += 1
        self._pending = True

    def _add_loss(self, loss: float, r: int) -> None:
        """Deposit a unit's loss (``r`` times its mean)."""
        t1 = time.perf_counter()
        if math.isfinite(loss):
            self.loss.deposit(r * loss)
        else:
            self._bad_loss = True
        self._deposit_seconds += time.perf_counter() - t1

    def _held_rows(self, count: int) -> Any:
        """The held rows, at least ``count`` of them (grown, keeping them, by
        doubling up to ``held_max``: in the first steps only)."""
        held = self._held
        if held is None or held.shape[0] < count:
            rows = min(self.held_max, max(count, 2 * (held.shape[0] if held is not None else 0)))
            self._held = self.xp.zeros((rows, self.size), dtype=self.dtype)
            if held is not None:
                self._held[:held.shape[0]] = held
            self.strategy.note_peak(self.nbytes())
        return self._held

    def _word_acc(self) -> BinnedAccumulator:
        if self._words is None:
            self._words = BinnedAccumulator(self.size, self.dtype, self.xp,
                                            segments=[b - a for a, b in self.segments]
                                            if self.segments else None)
            self._global_bins = self.xp.empty_like(self._words.bins)
            self.strategy.note_peak(self.nbytes())
        return self._words

    def _flush(self) -> None:
        """Deposit the held rows into the words, in one pass over them."""
        if self._n_held and kernels.deposit_rows(self._word_acc(),
                                                 self._held[:self._n_held]) >= 0:
            self._bad_grad = True
        self._n_held = 0
        self._in_words = True

    # --- step: the gradient --------------------------------------------------------
    def reduce_step(self) -> float:
        """Sum this step's units over ``groups.dp`` into where the strategy updates
        from; returns the seconds not spent communicating (recorded as
        ``timings["deposit"]`` and ``timings["conversion"]``). Collective over
        ``groups.dp``."""
        s = self.strategy
        dp = s.dp
        t0 = time.perf_counter()
        if dp.size > 1 and self._dp_to_step is None:
            self._dp_to_step = dp.allgather(s.totals.group.rank)
        mine = self.held_max + 1 if self._in_words else self._count
        cap = dp.allreduce(mine, op="max") if dp.size > 1 else mine
        t1 = time.perf_counter()
        local = self._reduce_words() if cap > self.held_max else self._reduce_floats(cap)
        self._count = 0
        self._n_held = 0
        self._pending = False
        self._in_words = False
        return local + (t1 - t0 if dp.size == 1 else 0.0)

    def _reduce_words(self) -> float:
        """The words path: deposit what is still held, agree on the bins, sum the
        words, convert. Returns the local seconds."""
        s = self.strategy
        t0 = time.perf_counter()
        self._make_room()           # the pending unit joins the rows ...
        self._flush()               # ... which join the words
        acc = self._word_acc()
        deposit = time.perf_counter() - t0
        if s.dp.size > 1:
            self._global_bins[...] = acc.bins
            s.dp.Allreduce(self._global_bins, slot="repro-bins", op="max")
            acc.realign(self._global_bins)
            s.reduction.reduce_words(acc)
        t1 = time.perf_counter()
        out, start, stop = s.reduction.repro_target()
        kernels.to_float(acc, out, start, stop)
        acc.clear()
        convert = time.perf_counter() - t1
        self._record(deposit, convert)
        return deposit + convert

    def _reduce_floats(self, cap: int) -> float:
        """The float path: every unit's piece to the rank that converts it, summed
        there in one pass (DDP: then gathered). Returns the local seconds."""
        s = self.strategy
        dp = s.dp
        ex = self._exchange_plan()
        out, start, stop = s.reduction.repro_target()
        source = s.reduction.repro_source(s.model).reshape(-1)
        deposit = 0.0
        if dp.size == 1:
            if self._n_held == 0:       # the one unit where it was computed, or none
                rows = source.reshape(1, -1)[:1 if self._pending else 0]
            else:
                t0 = time.perf_counter()
                self._make_room()
                deposit = time.perf_counter() - t0
                rows = self._held[:self._n_held]
        else:
            rows = ex.rows(cap)
            for u in range(cap):
                if u < self._n_held:
                    vector = self._held[u]
                elif u == self._n_held and self._pending:
                    vector = source
                elif u == self._n_held:
                    vector = source             # this rank has no unit u: zeros
                    vector.fill(0)
                else:
                    vector = self._held_rows(u + 1)[u]
                    vector.fill(0)
                ex.send(dp, vector, rows, u, cap)
        t1 = time.perf_counter()
        target, span = ex.targets[dp.rank], ex.spans[dp.rank]
        piece = out[target.start - start:target.stop - start]
        bad = kernels.exact_sum(ex.grid, rows, piece, target.start - span.start,
                                target.stop - span.start)
        if bad >= 0:
            if dp.size > 1:
                self._bad_rank = bad // cap
            else:
                self._bad_grad = True
        convert = time.perf_counter() - t1
        if ex.replicated and dp.size > 1:
            dp.Allgatherv(out, [len(t) for t in ex.targets], slot="repro-gather")
        self._record(deposit, convert)
        return deposit + convert

    def _record(self, deposit: float, convert: float) -> None:
        timings = self.strategy.timings
        timings["deposit"] = timings.get("deposit", 0.0) + deposit
        timings["conversion"] = timings.get("conversion", 0.0) + convert

    def _exchange_plan(self) -> FloatExchange:
        if self._exchange is None:
            s = self.strategy
            targets = s.reduction.repro_shards()
            replicated = targets is None
            if replicated:
                grid = ChunkGrid([b - a for a, b in self.segments])
                cuts = [grid.floor(r.start) for r in shard_ranges(self.size, s.dp.size)]
                targets = [Range(a, b) for a, b in zip(cuts, cuts[1:] + [self.size])]
            self._exchange = FloatExchange(self.segments, list(targets), s.dp.rank,
                                            self.dtype, self.xp, replicated)
            s.note_peak(self.nbytes())
        return self._exchange

    # --- step: the totals (loss, sum of squares) -------------------------------------
    def fill_totals(self, totals: StepTotals, clipping: bool) -> None:
        """This rank's totals into the step buffer, the loss and the squares as
        binned words after the flags (`_fill_words`). Collective over the
        step group."""
        totals.fill(clipping)
        self._fill_words(totals, clipping)

    def _fill_words(self, totals: StepTotals, clipping: bool) -> None:
        """Agree on the loss's and the squares' bins over the step group and write
        this rank's words into the step buffer after the flags
        ([`StepTotals.tail`][mpishard.parallel.totals.StepTotals]), and the flags
        of the ranks where a unit's loss or gradient was not finite; their NaN
        in the words makes the step's loss or norm NaN. Collective over the step
        group."""
        buf, base, group = totals.buffer, totals.tail, totals.group
        flags = base - group.size
        if self._bad_loss or self._bad_grad:
            buf[flags + group.rank] = 1.0
        if self._bad_rank is not None:
            buf[flags + (self._dp_to_step[self._bad_rank] if self._dp_to_step
                         else group.rank)] = 1.0
        bins = self._small_bins
        bins[0] = self.loss.bin if totals.counts_rows else EMPTY_BIN
        bins[1] = EMPTY_BIN
        pieces = []
        if clipping:
            vector = totals.norm_vector()
            pieces = [vector[r.start:r.stop] for r in totals.norm_ranges]
            top = max((kernels.max_magnitude(p) for p in pieces), default=0.0)
            if math.isfinite(top * top):
                bins[1] = bin_of(top * top, NORM_WORD_BITS)
            else:       # the step is refused: its squares do not matter
                self._bad_grad = True
                pieces = []
        group.Allreduce(bins, slot="repro-small", op="max")
        if totals.counts_rows:
            self.loss.realign(int(bins[0]))
            buf[base:base + _LOSS_WORDS] = self.loss.words
        self.loss.clear()
        if clipping:
            words = [0.0] * NORM_WORDS
            for p in pieces:
                for k, w in enumerate(kernels.square_words(p, int(bins[1]), self._norm_scratch,
                                                           self._norm_slices)):
                    words[k] += w
            buf[base + _LOSS_WORDS:base + self.extra] = words
        if self._bad_loss:
            buf[base:base + _LOSS_WORDS] = math.nan
        if self._bad_grad or self._bad_rank is not None:
            buf[base + _LOSS_WORDS:base + self.extra] = math.nan
        self._bad_loss = self._bad_grad = False
        self._bad_rank = None

    def read_totals(self, totals: StepTotals, clipping: bool) -> None:
        """After the step's ``Allreduce``: the exact loss sum and (with clipping, or
        NaN: a rank's unit gradient was not finite) sum of squares from the words."""
        loss_sum, squares = self._read_words(totals)
        totals.set(loss_sum, squares if clipping or not math.isfinite(squares) else None)

    def _read_words(self, totals: StepTotals) -> tuple[float, float]:
        """The global loss sum and sum of squares from the reduced words (NaN where
        a rank's was not finite)."""
        buf, base = totals.buffer, totals.tail
        bins = self._small_bins
        loss_words = buf[base:base + _LOSS_WORDS].tolist()
        square_words = buf[base + _LOSS_WORDS:base + self.extra].tolist()
        loss = words_to_float(loss_words, int(bins[0]), WORD_BITS)
        squares = words_to_float(square_words, int(bins[1]), NORM_WORD_BITS)
        if not all(math.isfinite(w) for w in loss_words):
            loss = math.nan
        if not all(math.isfinite(w) for w in square_words):
            squares = math.nan
        return loss, squares

    def nbytes(self) -> int:
        held = int(self._held.nbytes) if self._held is not None else 0
        words = self._words.nbytes() if self._words is not None else 0
        exchange = self._exchange.nbytes() if self._exchange is not None else 0
        return (held + words + exchange + self.strategy.reduction.repro_nbytes()
                + sum(int(a.nbytes) + int(b.nbytes) for a, b in self._units.values()))
