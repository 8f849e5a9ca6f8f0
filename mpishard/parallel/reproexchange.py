"""How reproducible mode moves the units' sums over the data-parallel group.

* `FloatExchange`: the float path's plan, every unit's chunks of a range
  to the rank that converts that range (one ``Alltoallv`` per unit).
* `WordShards`: the words path's reduction of binned words to ZeRO-2's
  shards (one ``Reduce_scatter`` per word row).

Both are made once and called from `ReproducibleStep`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..flat import Range
from ..reprosum import ChunkGrid

__all__ = ["FloatExchange", "WordShards"]


class WordShards:
    """Sum the words of a [`BinnedAccumulator`][mpishard.reprosum.BinnedAccumulator] over a
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


class FloatExchange:
    """The float path's plan over ``groups.dp`` (made on first need).

    Rank ``j`` converts the *target* range ``targets[j]`` (its ZeRO-2 shard; for
    DDP an equal part on chunk boundaries, then gathered) and receives, from
    every rank and for every unit it holds, the values of the chunks that cover
    that range, ``spans[j]``: a chunk's bin is set by its largest magnitude over
    the whole chunk. ZeRO-2 shards do not respect chunks, so neighbouring spans
    may share a chunk, which both receive (sent pieces may overlap).
    """

    def __init__(self, segments: list[tuple[int, int]], targets: list[Range], rank: int,
                 dtype: Any, xp: Any, replicated: bool) -> None:
        grid = ChunkGrid([b - a for a, b in segments])
        self.targets = targets
        #: Each rank holds the whole gradient (DDP): the parts are gathered after.
        self.replicated = replicated
        self.spans = [Range(grid.floor(t.start), grid.ceil(t.stop)) if len(t)
                      else Range(t.start, t.start) for t in targets]
        self.rank = rank
        lo, hi = self.spans[rank]
        # The chunks of this rank's span: the tensors' pieces in it (the span starts
        # on a chunk boundary, so their chunks are the whole vector's).
        self.grid = ChunkGrid([min(b, hi) - max(a, lo) for a, b in segments
                               if min(b, hi) > max(a, lo)])
        self.send_counts = [len(sp) for sp in self.spans]
        self.send_displs = [sp.start for sp in self.spans]
        self.xp = xp
        self.dtype = np.dtype(dtype)
        self._recv: Any = None          # received rows, grown on need

    def rows(self, cap: int) -> Any:
        """The receive buffer as ``(ranks * cap, span)`` rows: row ``j * cap + u``
        holds rank ``j``'s unit ``u``."""
        span = len(self.spans[self.rank])
        size = cap * len(self.spans) * span
        if self._recv is None or self._recv.size < size:
            self._recv = self.xp.zeros(max(size, 1), dtype=self.dtype)
        return self._recv[:size].reshape(len(self.spans) * cap, span)

    def send(self, dp: Any, vector: Any, rows: Any, unit: int, cap: int) -> None:
        """Send unit ``unit`` of this rank (``vector``, the whole gradient) to the
        ranks whose spans it covers, into their row ``rank * cap + unit``.
        Collective over ``dp``."""
        span = rows.shape[1]
        displs = [(j * cap + unit) * span for j in range(len(self.spans))]
        dp.Alltoallv(vector, self.send_counts, rows.reshape(-1), [span] * len(self.spans),
                     slot="repro-units", senddispls=self.send_displs, recvdispls=displs)

    def nbytes(self) -> int:
        return int(self._recv.nbytes) if self._recv is not None else 0
