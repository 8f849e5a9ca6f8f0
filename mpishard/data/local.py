"""``LocalDataset``: training on the rows each rank already holds, moved only as batches need them.

A simulation leaves its samples where it made them: rank ``r`` holds ``n_r``
rows (any number, zero included). The dataset they form is the concatenation
of the ranks' rows in data-parallel rank order, sample ``i`` of the union being
row ``i - start_r`` of the rank whose block ``[start_r, start_r + n_r)`` holds
it. The sampler shuffles that union exactly as it would shuffle the same rows
held by one process, so training equals one process on the concatenated rows,
whatever the number of ranks (when the simulation's decomposition changes with
the rank count, ``start=`` pins each rank's block to its global place).

Each step, every rank needs its part of the global batch (rows
``rank_rows(B, P, r)`` of it). One ``Alltoallv`` over the data-parallel group
(two: inputs, then targets) moves exactly those rows from the ranks that hold
them; nothing else moves, and a rank's memory is its own rows plus
buffers for one batch: O(local rows + batch). The sampler's permutation
of the global indices (8 bytes per sample of the union, as for any dataset)
is the one part that grows with the whole set.

With tensor or pipeline parallelism the data-parallel group is what matters:
every rank of one model replica (its tensor and pipeline peers) trains on the
same rows, so those peers must hold the same rows (checked at construction:
row counts and a digest of the bytes); rows that differ between them are
refused, naming the rank and its group.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

import numpy as np

from .sampler import rank_rows
from .transfer import RowMover

if TYPE_CHECKING:   # annotations only: importing the data layer does not start MPI
    from ..comm import FlatComm
    from ..config import ShardingConfiguration

__all__ = ["LocalDataset"]


class LocalDataset:
    """The union of the rows each data-parallel rank holds.

    Args:
        x, y: this rank's inputs and targets (NumPy arrays, samples along the
            first axis; any number of rows, zero included). Kept by reference:
            do not change them while training.
        config: the layout training will use; the rows are exchanged over its
            data-parallel group (``config.groups.dp``).
        start: the global index of this rank's first row. Default: the blocks
            follow each other in data-parallel rank order. When given (by every
            rank), the blocks may come in any order but must tile
            ``[0, total)`` without gap or overlap.

    Construction is collective over ``config.world``;
    [`gather_batch`][mpishard.data.LocalDataset.gather_batch] over ``config.groups.dp``. ``len()``
    is the size of the union. ``rows_sent`` and ``rows_received`` count the rows this rank sent to
    and received from other ranks.

    Raises (on every rank):
        ValueError: inputs and targets of different lengths; row shapes or
            dtypes that differ between ranks; ``start`` blocks that do not tile
            the union; tensor- or pipeline-parallel peers holding different rows.
    """

    def __init__(self, x: Any, y: Any, config: ShardingConfiguration, *,
                 start: int | None = None) -> None:
        world, groups = config.world, config.groups
        self.comm: FlatComm = groups.dp
        self.x, self.y = x, y
        problem = None
        if not isinstance(x, np.ndarray) or not isinstance(y, np.ndarray):
            problem = (f"expecting NumPy arrays of this rank's rows, got "
                       f"{type(x).__name__} and {type(y).__name__}")
        elif len(x) != len(y):
            problem = f"inputs have {len(x)} samples but targets have {len(y)}"
        world.agree(problem, ValueError)
        n = len(x)
        mine = (n, x.shape[1:], x.dtype.str, y.shape[1:], y.dtype.str, start)
        every = self.comm.allgather(mine)
        problem = _layout_problem(every)
        peers = _peer_problem(config, x, y)   # collective: called by every rank
        world.agree(problem or peers, ValueError)
        counts = np.array([e[0] for e in every], dtype=np.int64)
        if start is None:
            starts = np.concatenate(([0], np.cumsum(counts[:-1])))
        else:
            starts = np.array([e[5] for e in every], dtype=np.int64)
        self.counts = counts
        self.starts = starts
        self.start = int(starts[self.comm.rank])
        self.total = int(counts.sum())
        # Blocks by global position, to find who holds sample i (empty blocks left out).
        order = np.argsort(starts, kind="stable")
        order = order[counts[order] > 0]
        self._block_starts = starts[order]
        self._block_ranks = order
        self._row_elements = (int(np.prod(x.shape[1:], dtype=np.int64)),
                              int(np.prod(y.shape[1:], dtype=np.int64)))
        self._send: tuple[np.ndarray, np.ndarray] | None = None
        self._recv: tuple[np.ndarray, np.ndarray] | None = None
        self.rows_sent = 0
        self.rows_received = 0
        self._mover = RowMover()

    def __len__(self) -> int:
        return self.total

    def buffers(self, rows: int, xp: Any = np, float_dtype: Any = None) -> tuple[Any, Any]:
        """Buffers for ``rows`` samples on the device of ``xp``; floating-point
        data held in ``float_dtype`` when given."""
        dx, dy = self._dtypes(float_dtype)
        return (xp.empty((rows,) + self.x.shape[1:], dtype=dx),
                xp.empty((rows,) + self.y.shape[1:], dtype=dy))

    def holders(self, indices: np.ndarray) -> np.ndarray:
        """The data-parallel rank holding each sample of ``indices``. Local."""
        block = np.searchsorted(self._block_starts, indices, side="right") - 1
        return self._block_ranks[block]

    def gather_batch(self, batch: np.ndarray, x_out: Any, y_out: Any) -> None:
        """Fill ``x_out``, ``y_out`` with this rank's part of the global batch
        ``batch`` (its rows ``rank_rows(len(batch), P, rank)``), receiving them
        from the ranks that hold them. Every rank passes the same ``batch``.
        Collective over ``config.groups.dp``.

        (A few index arrays of the batch's length are made each call: the
        batch changes every step and they are small beside the rows.)
        """
        comm, size, rank = self.comm, self.comm.size, self.comm.rank
        batch = np.asarray(batch, dtype=np.int64)
        rows = len(batch)
        lo, hi = rank_rows(rows, size, rank)
        part_starts = np.array([rank_rows(rows, size, d)[0] for d in range(size)])
        owner = self.holders(batch)
        # Sending: my samples of the batch, in batch order, which is destination order.
        mine = np.flatnonzero(owner == rank)
        dest = np.searchsorted(part_starts, mine, side="right") - 1
        sendcounts = np.bincount(dest, minlength=size)
        # Receiving: my part's samples arrive grouped by holder, each group in batch order.
        owners = owner[lo:hi]
        recvcounts = np.bincount(owners, minlength=size)
        arrival = np.argsort(owners, kind="stable")   # arrival[k]: position of the k-th row
        sx, sy = self._buffers("_send", len(mine), x_out.dtype, y_out.dtype)
        rx, ry = self._buffers("_recv", hi - lo, x_out.dtype, y_out.dtype)
        local = batch[mine] - self.start
        np.take(self.x, local, axis=0, out=sx[:len(mine)])
        np.take(self.y, local, axis=0, out=sy[:len(mine)])
        ex, ey = self._row_elements
        comm.Alltoallv(sx.reshape(-1), sendcounts * ex, rx.reshape(-1), recvcounts * ex,
                       slot="data-x")
        comm.Alltoallv(sy.reshape(-1), sendcounts * ey, ry.reshape(-1), recvcounts * ey,
                       slot="data-y")
        self.rows_sent += int(len(mine) - sendcounts[rank])
        self.rows_received += int(hi - lo - recvcounts[rank])
        n = hi - lo
        # In batch order; a device buffer is filled in pinned memory, one copy up each.
        self._mover.put(rx[:n], x_out[:n], key="x", order=arrival)
        self._mover.put(ry[:n], y_out[:n], key="y", order=arrival)

    def _dtypes(self, float_dtype: Any) -> tuple[Any, Any]:
        def dtype(a: np.ndarray) -> Any:
            floating = np.issubdtype(a.dtype, np.floating)
            return float_dtype if floating and float_dtype is not None else a.dtype

        return dtype(self.x), dtype(self.y)

    def _buffers(self, which: str, rows: int, dx: Any, dy: Any) -> tuple[np.ndarray, np.ndarray]:
        """Grow-only host buffers of at least ``rows`` rows (the step loop reuses them)."""
        have = getattr(self, which)
        if (have is None or len(have[0]) < rows or have[0].dtype != dx
                or have[1].dtype != dy):
            cap = max(rows, 1 if have is None else len(have[0]))
            have = (np.empty((cap,) + self.x.shape[1:], dtype=dx),
                    np.empty((cap,) + self.y.shape[1:], dtype=dy))
            setattr(self, which, have)
        return have[0][:rows], have[1][:rows]

    def __repr__(self) -> str:
        return (f"LocalDataset({len(self.x)} local rows at {self.start} of {self.total}, "
                f"data-parallel rank {self.comm.rank} of {self.comm.size})")


def _layout_problem(every: list[tuple[Any, ...]]) -> str | None:
    """Row shapes and dtypes the same on every rank; ``start`` given by all or none
    and tiling the union."""
    first = every[0]
    for r, e in enumerate(every):
        if e[1:5] != first[1:5]:
            return (f"data-parallel rank {r} holds rows of shape {e[1]} {np.dtype(e[2]).name} "
                    f"-> {e[3]} {np.dtype(e[4]).name}, rank 0 {first[1]} "
                    f"{np.dtype(first[2]).name} -> {first[3]} {np.dtype(first[4]).name}")
    given = [e[5] is not None for e in every]
    if any(given) and not all(given):
        return (f"start= is given on data-parallel ranks {[r for r, g in enumerate(given) if g]} "
                f"only: give it on every rank or on none")
    if all(given):
        blocks = sorted((int(e[5]), int(e[5]) + e[0], r) for r, e in enumerate(every) if e[0])
        at = 0
        for lo, hi, r in blocks:
            if lo != at:
                return (f"the blocks of rows do not tile the union: data-parallel rank {r} "
                        f"starts at {lo}, expecting {at}")
            at = hi
    return None


def _peer_problem(config: ShardingConfiguration, x: np.ndarray, y: np.ndarray) -> str | None:
    """Every rank of a tensor or pipeline group holds the same rows (they are one
    model replica and train on one part of the batch). Collective over both groups."""
    groups = config.groups
    if groups.tp.size == 1 and groups.pp.size == 1:
        return None
    digest = hashlib.sha256()
    for a in (x, y):
        digest.update(np.ascontiguousarray(a))   # the buffer itself, no copy
    mine = (len(x), digest.hexdigest())
    for group in (groups.tp, groups.pp):
        every = group.allgather(mine)
        for r, e in enumerate(every):
            if e != mine:
                return (f"with tensor or pipeline parallelism, the ranks of one model "
                        f"replica must hold the same rows: rank {r} of the {group.name} "
                        f"group holds {e[0]} rows, this rank {mine[0]}"
                        + (" with other values" if e[0] == mine[0] else ""))
    return None
