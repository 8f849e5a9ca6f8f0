"""``StepTotals``: what a step adds up besides the gradient, in one small ``Allreduce``."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from ..comm import FlatComm, world_rank
from ..errors import NonFiniteError
from ..flat import Range
from ..optim.base import CHUNK_ELEMENTS, DEVICE_CHUNK_ELEMENTS
from ..optim.clip import all_finite, sum_of_squares

__all__ = ["StepSums", "StepTotals"]

# The one small vector every step reduces (float64): the row-weighted loss sum,
# the row count, this rank's share of the gradient's sum of squares (with
# clipping; without it 0 or infinity: whether that share is finite), then one
# flag per rank of the step group (a non-finite local loss or gradient).
_LOSS, _ROWS, _SQUARES, _FLAGS = 0, 1, 2, 3


class StepSums(Protocol):
    """What sums a step besides the totals: a core's
    [gradient reduction][mpishard.parallel.reduction.GradientReduction], or
    reproducible mode's binned sums
    (``ReproducibleStep``, ``mpishard.parallel.repro``)."""

    def reduce_step(self) -> float: ...

    def fill_totals(self, totals: StepTotals, clipping: bool) -> None: ...

    def read_totals(self, totals: StepTotals, clipping: bool) -> None: ...


class StepTotals:
    """This rank's micro-batches since the last step (their count, rows, loss
    sum and whether a local value was non-finite), and the step's reduction of
    them over the step group with the gradient's sum of squares.

    The step's one small ``Allreduce`` (float64) carries the row-weighted loss,
    the row count ``N`` (the gradient is averaged as ``1/N`` folded into the
    update), the gradient's sum of squares (each rank summing only its share of
    the reduced gradient; without clipping only whether the share is finite,
    which is cheaper, and ``last_grad_norm`` is then not computed) and which
    ranks saw a non-finite value. A NaN or infinite global loss or gradient
    norm updates nothing: with ``nonfinite="error"`` the step raises
    ([`refusal`][mpishard.parallel.totals.StepTotals.refusal]), with ``"skip"``
    it is counted in ``skipped_steps`` (not in ``step_count``).

    Made by the core; ``setup`` at attach, over the step group (the data
    group; the world for a 3D layout). Reproducible mode counts its units here
    too, and adds its binned words after the flags (``extra`` slots).
    """

    def __init__(self) -> None:
        #: Micro-batches since the last step on this rank.
        self.micro = 0
        #: Rows of those micro-batches on this rank.
        self.rows = 0
        #: Sum over them of rows x mean loss.
        self.loss_sum = 0.0
        #: A non-finite local loss or gradient appeared since the last step.
        self.local_bad = False
        self.group: FlatComm | None = None

    def setup(self, group: FlatComm, dp: FlatComm, norm_ranges: list[Range],
              norm_vector: Callable[[], Any], xp: Any, counts_rows: bool, extra: int) -> None:
        """Set up the step's buffer over ``group``; ``norm_vector()[r]`` for each
        ``r`` of ``norm_ranges``: this rank's share of the reduced gradient.
        Collective over ``group`` (who is who, gathered once)."""
        self.group = group
        self.counts_rows = counts_rows
        self.buffer = np.zeros(_FLAGS + group.size + extra, dtype=np.float64)
        #: Where reproducible mode's words start in ``buffer``.
        self.tail = _FLAGS + group.size
        # (data-parallel rank, world rank) of each rank of the step group, to name
        # the rank where a non-finite value appeared; gathered once, here.
        self.who = group.allgather((dp.rank, world_rank()))
        self.norm_ranges = [r for r in norm_ranges if len(r)]
        self.norm_vector = norm_vector
        longest = max((len(r) for r in self.norm_ranges), default=1)
        limit = CHUNK_ELEMENTS if xp is np else DEVICE_CHUNK_ELEMENTS
        self._scratch = xp.empty(max(1, min(limit, longest)), dtype=np.float64)

    # --- between steps -----------------------------------------------------------
    def add(self, rows: int, loss: float) -> None:
        """A micro-batch of ``rows`` (mean loss ``loss``) ran on this rank."""
        if rows:
            if not math.isfinite(loss):
                self.local_bad = True
            self.loss_sum += rows * loss
        self.counted(rows)

    def counted(self, rows: int) -> None:
        """A micro-batch of ``rows`` whose loss is summed elsewhere (reproducible mode)."""
        self.micro += 1
        self.rows += rows

    def check_local(self, vector: Any) -> None:
        """Note a non-finite value in this rank's own (unreduced) gradient. Only
        where the whole local gradient exists before a blocking reduction (models
        without backward hooks), so it costs one read and no overlap."""
        if self.group.size > 1 and not all_finite(vector):   # one rank: named anyway
            self.local_bad = True

    # --- the step ------------------------------------------------------------------
    def fill(self, clipping: bool) -> Any:
        """Write this rank's totals into the step buffer (the sum of squares of
        its share with ``clipping``, else 0 or infinity: whether it is finite)
        and forget them; the buffer. Local."""
        buf = self.buffer
        buf.fill(0.0)
        if self.counts_rows:
            buf[_LOSS] = self.loss_sum
            buf[_ROWS] = self.rows
        if not clipping:
            # No norm is needed, only whether the gradient is finite: a pass that
            # costs a seventh of the float64 sum of squares (optim.clip.all_finite).
            buf[_SQUARES] = 0.0 if self._local_finite() else math.inf
        buf[_FLAGS + self.group.rank] = self.local_bad
        self.micro = self.rows = 0
        self.loss_sum = 0.0
        self.local_bad = False
        return buf

    def local_squares(self) -> None:
        """Write this rank's share's sum of squares into the buffer (one pass over
        the share, into a float64 scratch made at setup). Local."""
        vector, total = self.norm_vector(), 0.0
        for r in self.norm_ranges:
            total += sum_of_squares(vector[r.start:r.stop], self._scratch)
        self.buffer[_SQUARES] = total

    def reduce(self) -> None:
        """Sum the buffers of the step group. Collective over the step group."""
        self.group.Allreduce(self.buffer, slot="step")

    def reduce_with(self, sums: StepSums, clipping: bool) -> tuple[float, float]:
        """The step's reductions: ``sums`` completes the gradient's and writes this
        rank's totals (its share's sum of squares with ``clipping``), then the one
        small ``Allreduce``, read back. Returns the seconds spent communicating
        and the seconds spent on this rank. Collective over ``groups.dp`` and
        the step group."""
        t0 = time.perf_counter()
        converted = sums.reduce_step()     # seconds converting (reproducible mode)
        t1 = time.perf_counter()
        sums.fill_totals(self, clipping)
        t2 = time.perf_counter()
        self.reduce()
        t3 = time.perf_counter()
        sums.read_totals(self, clipping)
        return (t1 - t0 - converted) + (t3 - t2), (t2 - t1) + (time.perf_counter() - t3)

    def mean(self, factor: float) -> tuple[float, float, float]:
        """``(loss, norm, scale)`` of the reduced totals: the global mean loss, the
        norm of ``factor`` times the mean gradient (NaN where the sum of squares
        is), and ``factor / rows``, which turns the summed gradient into it.

        Raises:
            ValueError: no rank had any rows since the last step (on every rank).
        """
        loss_sum, rows, squares = self.read()
        if rows == 0:
            raise ValueError("step(): the global batch has no rows (every rank called "
                             "backward() with an empty batch since the last step)")
        scale = factor / rows
        norm = math.sqrt(squares) * scale if squares >= 0 else float("nan")
        return loss_sum / rows, norm, scale

    def set(self, loss_sum: float, squares: float | None) -> None:
        """Put reproducible mode's exact sums in place of the summed floats
        (``squares`` None: keep the summed one)."""
        self.buffer[_LOSS] = loss_sum
        if squares is not None:
            self.buffer[_SQUARES] = squares

    def read(self) -> tuple[float, int, float]:
        """The reduced ``(loss sum, rows, sum of squares)``."""
        buf = self.buffer
        return float(buf[_LOSS]), int(buf[_ROWS]), float(buf[_SQUARES])

    def first_bad(self) -> tuple[int, int] | None:
        """``(data-parallel rank, world rank)`` of the first rank that flagged a
        non-finite local value in the reduced buffer (the only rank, alone), or None."""
        flags = self.buffer[_FLAGS:_FLAGS + self.group.size]
        first = next((i for i, f in enumerate(flags) if f), None)
        if first is None and len(flags) == 1:
            first = 0
        return None if first is None else self.who[first]

    def _local_finite(self) -> bool:
        vector = self.norm_vector()
        return all(all_finite(vector[r.start:r.stop]) for r in self.norm_ranges)

    def refusal(self, step: int, loss: float, norm: float) -> NonFiniteError:
        """The error of a step refused for a non-finite global ``loss`` or ``norm``,
        naming the first rank that flagged a local one (the same on every rank)."""
        what = " and ".join(name for name, v in (("loss", loss), ("gradient norm", norm))
                            if not math.isfinite(v))
        first = self.first_bad()
        if first is None:
            rank = world = None
            where = ("no rank's local loss was non-finite, and the local gradients were "
                     "reduced as the backward produced them (unchecked, to keep the "
                     "check one pass), so the rank cannot be named")
        else:
            rank, world = first
            where = (f"it first appeared on data-parallel rank {rank} (world rank {world}), "
                     f"whose local loss or gradient was non-finite")
        return NonFiniteError(
            f"step {step}: non-finite {what} (global mean loss {loss}, gradient norm "
            f"{norm}); {where}. Parameters and optimizer state are unchanged; pass "
            f"nonfinite='skip' to skip such steps instead", step=step, rank=rank,
            world_rank=world)
