"""``BatchStream``: training on global batches as they arrive, one per step.

A simulation that hands its training a snapshot every time step has no data
set to sample from: it has a sequence of batches. ``optimize(model,
BatchStream(batches))`` trains one optimizer step on each batch, in the order
they come, until the iterator ends (``result.stopped == "exhausted"``),
``max_steps``, the callback or a stop. Training equals one process stepping
through the same sequence of global batches (the loss of a step is the mean
over its global batch), at any number of ranks.

**Which rows a rank yields.** ``local=False`` (the default): every rank's
iterator yields the same whole global batch ``(x, y)``, and data-parallel rank
``r`` of ``P`` trains on its rows ``rank_rows(len(x), P, r)``. ``local=True``:
each rank yields only its own rows (any number, zero included, and the number
may change from batch to batch); the global batch is their concatenation in
data-parallel rank order, and no row moves between ranks. With tensor or
pipeline parallelism the ranks of one model replica (same data-parallel rank)
yield the same rows.

**What is checked, and how cheaply.** Before each step the ranks exchange four
integers each (one ``Allgatherv`` over the world): their data-parallel rank,
their row count, a checksum of the row shapes and dtypes, and whether their
iterator has ended. Row counts that disagree (``local=False``: every rank the
same; ``local=True``: the peers of one replica the same), other row shapes or
dtypes, a stream that ends on some ranks only, an item that is not an ``(x,
y)`` pair, or an iterator that raises, are a ``ValueError`` on every rank that
names the batch and the ranks (by their rank in ``MPI.COMM_WORLD``, with their
rank in the library's group beside it unless the group numbers them as
``MPI.COMM_WORLD`` does). The values
themselves are not compared: that each rank yields the right rows is the
caller's part.

**Waiting for the data.** That exchange completes once the slowest rank's
iterator has yielded its batch: its wait is one for data, under
``ShardingConfiguration(data_timeout=...)`` (by default the ``timeout``), not
the deadline of the other collectives; see [`mpishard.comm.deadlines`][mpishard.comm.deadlines].

**Reading.** A batch is read when its step is about to run, never ahead, so a
stop (``max_steps``, a signal, the callback) leaves the next batch in the
iterator; and the loop is done with a batch's arrays before it reads the next,
so an iterator may yield views of one receive buffer that it refills each time.

**The data position** of a stream counts its batches: ``data_position`` holds
``batches`` (the stream's index of the next batch; the batches before it were
read: trained on, or refused) and ``samples_consumed`` (the rows trained on),
and a checkpoint stores both. A batch that is refused (the ``ValueError``s
above, an iterator that raises) was read from the iterator, so it counts:
after the error the position and `BatchStream.index` are one past it on
every rank, and ``BatchStream(batches)`` or ``BatchStream(batches, first=k + 1)``
goes on with the batch after the refused batch ``k``.

A stream is numbered from ``first``: ``BatchStream(batches)`` continues the
position (its first batch is batch ``data_position["batches"]``:
a live simulation handing over what comes next), and
``BatchStream(batches, first=k)`` says that its first batch is batch ``k`` of
the sequence: batches before the position are read and skipped (a replayable
stream, restarted from its beginning with ``first=0``, or a simulation
restarted from its own checkpoint at step ``k``), and ``k`` beyond the position
is an error (batches would be missed).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..backend import array_namespace
from .sampler import rank_rows
from .transfer import RowMover

if TYPE_CHECKING:   # annotations only: importing the data layer does not start MPI
    from ..comm import FlatComm

__all__ = ["BatchStream"]

# The record each rank contributes before a step: who it is, what it read.
_DP, _ROWS, _SIG, _STATE = range(4)
_READ, _ENDED, _FAILED = 0, 1, 2


class BatchStream:
    """Global batches that arrive one at a time, for ``optimize()``.

    Args:
        batches: an iterable of ``(x, y)`` pairs of arrays (NumPy or CuPy,
            samples along the first axis), such as a generator that receives a
            simulation's snapshot each time step. Read once, lazily: one item
            per optimizer step, never ahead.
        local: False: every rank yields the whole global batch; True: each rank
            yields its own rows of it (see the module docstring).
        first: the index of the stream's first batch in the whole sequence; None
            (the default): it continues the data position, whatever that is.

    ``index`` is the index of the next batch this stream will yield (None
    until it is known: the first ``optimize()`` with ``first=None``).
    """

    def __init__(self, batches: Iterable[Any], *, local: bool = False,
                 first: int | None = None) -> None:
        if first is not None and (not isinstance(first, (int, np.integer)) or first < 0):
            raise ValueError(f"first must be a non-negative integer or None, got {first!r}")
        self.local = bool(local)
        self.index: int | None = None if first is None else int(first)
        self.exhausted = False
        self._items = iter(batches)
        self._mine = np.zeros(4, dtype=np.int64)
        self._every: np.ndarray | None = None
        self._shape_key: tuple[Any, ...] | None = None
        self._buffers: dict[Any, Any] = {}
        self._mover = RowMover()

    def __repr__(self) -> str:
        return (f"BatchStream(local={self.local}, index={self.index}, "
                f"exhausted={self.exhausted})")

    # --- the training loop's side ----------------------------------------------------
    def start(self, at: int | None, world: FlatComm) -> int:
        """Place the stream at the data position's batch ``at`` (None: no
        position; the stream starts one at its own index): skip the batches
        before it, refuse a stream that starts after it. Returns the index of
        the next batch. Collective over ``world``.

        Raises:
            ValueError: on every rank: the ranks' streams start at different
                indices; the stream starts after the position; it ended, or
                failed, while skipping.
        """
        here = self.index if self.index is not None else (at or 0)
        starts = world.allgather(here)
        problem = None
        if min(starts) != max(starts):
            problem = (f"the ranks' streams start at different batches: "
                       f"{_Labels(world).values(starts, 'batch {}')}; pass the same first= "
                       f"everywhere")
        elif at is not None and here > at:
            problem = (f"the stream starts at batch {here} but the data position is at "
                       f"batch {at}: batches {at} to {here - 1} would be missed (first= "
                       f"is the index of the stream's first batch; new_pass() starts a "
                       f"new count)")
        world.agree(problem, ValueError)
        skip, problem = (at - here if at is not None else 0), None
        # Every rank reads its iterator up to the position, as fast as its producer
        # gives it: the agreement below is a wait for the slowest rank's data.
        for k in range(skip):
            try:
                next(self._items)
            except StopIteration:
                problem = (f"the stream ended after {k} of the {skip} batches it skips "
                           f"(from batch {here} to the data position's {at})")
                self.exhausted = True
                break
            except Exception as exc:   # the caller's iterator: named, agreed on
                problem = (f"the stream raised {type(exc).__name__} while skipping to "
                           f"batch {at}: {exc}")
                break
        with world.deadline("data"), world.during(f"BatchStream skipping to batch {at}"):
            world.agree(problem, ValueError)
        self.index = here + skip
        return self.index

    def read(self, world: FlatComm, dp: FlatComm, xp: Any, float_dtype: Any, *,
             batch_size: int | None = None, equal_parts: int = 1
             ) -> tuple[Any, Any, int, int] | None:
        """The next global batch: ``(x, y, start, rows)``, this rank's rows of it
        (as ``xp`` arrays, floating-point ones in ``float_dtype``: the caller's
        arrays themselves when they already are), where they start in the
        global batch, and its size. None when every rank's iterator has ended.
        ``batch_size``: every global batch must have that many rows;
        ``equal_parts`` > 1: every data-parallel rank's rows are equal in
        number and divide into that many (a pipelined model's micro-batches).
        Collective over ``world`` (every rank of it calls it, the same
        number of times).

        Raises:
            ValueError: on every rank: see the module docstring. The batch was
                read: `index` is past it.
        """
        x = y = None
        problem = None
        state = _READ
        try:
            item = next(self._items)
        except StopIteration:
            state = _ENDED
        except Exception as exc:   # the caller's iterator: named, agreed on
            state, problem = _FAILED, f"the stream raised {type(exc).__name__}: {exc}"
        if state == _READ:
            try:
                x, y = self._pair(item)
            except (TypeError, ValueError) as exc:
                state, problem = _FAILED, str(exc)
        mine = self._mine
        mine[_DP] = dp.rank
        mine[_ROWS] = 0 if x is None else len(x)
        mine[_SIG] = 0 if x is None else self._signature(x, y)
        mine[_STATE] = state
        if self._every is None or len(self._every) != 4 * world.size:
            self._every = np.empty(4 * world.size, dtype=np.int64)
        index = self.index if self.index is not None else 0
        # The slowest rank's iterator sets when this completes: a wait for data.
        with world.deadline("data"), world.during(f"BatchStream batch {index}"):
            world.Allgatherv(self._every, [4] * world.size, slot="batch-stream", sendbuf=mine)
        every = self._every.reshape(world.size, 4)
        if (every[:, _STATE] == _ENDED).all():
            self.exhausted = True
            return None
        # From here the batch was read on some rank: it counts, refused or not, so
        # that the position stays that of the caller's iterator (the next batch).
        self.index = index + 1
        if (every[:, _STATE] == _FAILED).any():
            world.agree(f"stream batch {index}: {problem}" if problem else None, ValueError)
        labels = _Labels(world)
        problem = self._disagreement(every, dp.size, batch_size, equal_parts, labels)
        if problem is not None:
            detail = world.allgather(None if x is None else _describe(x, y))
            raise ValueError(f"stream batch {index}: {problem}" + _shapes_named(detail, labels))
        per_rank = np.zeros(dp.size, dtype=np.int64)
        per_rank[every[:, _DP]] = every[:, _ROWS]   # the peers of a replica agree
        assert x is not None and y is not None
        if self.local:
            rows = int(per_rank.sum())
            lo = int(per_rank[:dp.rank].sum())
            hi = lo + len(x)
        else:
            rows = int(per_rank[0])
            lo, hi = rank_rows(rows, dp.size, dp.rank)
            x, y = x[lo:hi], y[lo:hi]
        return self._placed(x, xp, float_dtype, "x"), self._placed(y, xp, float_dtype, "y"), \
            lo, rows

    # --- helpers -----------------------------------------------------------------------
    @staticmethod
    def _pair(item: Any) -> tuple[Any, Any]:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise TypeError(f"expecting an (inputs, targets) pair, got "
                            f"{type(item).__name__}")
        x, y = (a if hasattr(a, "__array_namespace__") or isinstance(a, np.ndarray)
                or hasattr(a, "__cuda_array_interface__") else np.asarray(a) for a in item)
        if x.ndim < 1 or y.ndim < 1:
            raise ValueError(f"expecting arrays with samples along the first axis, got "
                             f"shapes {x.shape} and {y.shape}")
        if len(x) != len(y):
            raise ValueError(f"inputs have {len(x)} samples but targets have {len(y)}")
        return x, y

    def _signature(self, x: Any, y: Any) -> int:
        key = (x.shape[1:], x.dtype.str, y.shape[1:], y.dtype.str)
        if key != self._shape_key:   # the same shapes step after step: computed once
            self._shape_key = key
            self._sig = zlib.crc32(repr(key).encode())
        return self._sig

    def _disagreement(self, every: np.ndarray, dp_size: int, batch_size: int | None,
                      equal_parts: int, labels: _Labels) -> str | None:
        ended = np.flatnonzero(every[:, _STATE] == _ENDED)
        if len(ended):
            read = np.flatnonzero(every[:, _STATE] == _READ)
            return (f"the stream ended on {labels.many(ended)} but yielded a "
                    f"batch on {labels.many(read)}")
        if (every[:, _SIG] != every[0, _SIG]).any():
            return "the ranks yield rows of different shapes or dtypes"
        rows = every[:, _ROWS]
        if not self.local:
            if (rows != rows[0]).any():
                return (f"with local=False every rank yields the same global batch, but "
                        f"the ranks yield {labels.values(rows, '{} rows')}")
            total, parts = int(rows[0]), [rank_rows(int(rows[0]), dp_size, r)
                                          for r in range(dp_size)]
            per_rank = [hi - lo for lo, hi in parts]
        else:
            per_rank = [-1] * dp_size
            for d, n in zip(every[:, _DP].tolist(), rows.tolist()):
                if per_rank[d] not in (-1, n):
                    return (f"with local=True the ranks of one model replica (data-parallel "
                            f"rank {d}: its tensor and pipeline peers) yield the same rows, "
                            f"but they yield {per_rank[d]} and {n} rows")
                per_rank[d] = n
            total = sum(per_rank)
        if total == 0:
            return "the global batch has no rows"
        if batch_size is not None and total != batch_size:
            return f"the global batch has {total} rows, expecting batch_size={batch_size}"
        if equal_parts > 1 and (len(set(per_rank)) > 1 or per_rank[0] % equal_parts):
            return (f"a pipelined model needs every data-parallel rank's rows equal and "
                    f"divisible into {equal_parts} micro-batches, got {per_rank} rows "
                    f"(by data-parallel rank)")
        return None

    def _placed(self, a: Any, xp: Any, float_dtype: Any, which: str) -> Any:
        """``a`` as an ``xp`` array with floating-point data in ``float_dtype``:
        ``a`` itself when it is one, else a copy into a grow-only buffer."""
        floating = np.issubdtype(np.dtype(a.dtype), np.floating)
        dtype = np.dtype(float_dtype) if floating and float_dtype is not None else a.dtype
        if array_namespace(a) is xp and a.dtype == dtype:
            return a
        n = len(a)
        buf = self._buffers.get(which)
        if (buf is None or len(buf) < n or buf.shape[1:] != a.shape[1:]
                or buf.dtype != dtype or array_namespace(buf) is not xp):
            buf = xp.empty((max(n, 1),) + tuple(a.shape[1:]), dtype=dtype)
            self._buffers[which] = buf
        out = buf[:n]
        # Host rows to a device buffer go through pinned memory, one copy up.
        self._mover.put(a, out, key=which)
        return out


def _describe(x: Any, y: Any) -> str:
    return (f"{len(x)} rows {tuple(x.shape[1:])} {np.dtype(x.dtype).name} -> "
            f"{tuple(y.shape[1:])} {np.dtype(y.dtype).name}")


def _shapes_named(detail: list[str | None], labels: _Labels) -> str:
    """What each rank yielded (only on the error path: one more allgather)."""
    parts = [f"{labels.one(r)}: {d or 'nothing'}" for r, d in enumerate(detail)]
    return " (" + "; ".join(parts[:8]) + ("; ..." if len(parts) > 8 else "") + ")"


class _Labels:
    """How the stream's errors name the ranks of ``group``: by ``MPI.COMM_WORLD``
    rank, with the rank in the group beside it unless the group numbers its ranks
    as ``MPI.COMM_WORLD`` does (only on the error path)."""

    def __init__(self, group: FlatComm) -> None:
        self.name, self.world = group.name, group.world_ranks()
        self.same = self.world == list(range(len(self.world)))

    def one(self, rank: int) -> str:
        world = self.world[rank]
        return (f"world rank {world}" if self.same else
                f"world rank {world} (rank {rank} of the {self.name} group)")

    def many(self, ranks: Any) -> str:
        return ", ".join(self.one(int(r)) for r in ranks)

    def values(self, values: Any, form: str) -> str:
        """Each rank's value as ``form`` says ("{} rows"), in group order."""
        return ", ".join(f"{form.format(int(v))} on {self.one(r)}"
                         for r, v in enumerate(values))
