"""Sharded state moved from one split of a flat vector to another, shard to shard.

After a lost rank the survivors hold the pieces of a sharded vector (parameters,
optimizer state): each its own old shard, some the buddy copy of a lost one. The
new data group wants it split again, [`shard_ranges`][mpishard.flat.shard_ranges]
over fewer ranks. ``moves`` says which world range goes from which rank to
which (the overlaps of what each holds with what each wants); ``resplit`` moves
them with one ``Alltoallv`` per vector, so each rank allocates its new shard,
what it sends and what it receives, and no rank ever holds the whole vector.
Every element comes from exactly one rank, as it was: the move is exact, bit for
bit. The same holds for any other re-split of a sharded vector over one group
(a rank that holds nothing or wants nothing takes part with empty ranges).

Worked example, 12 elements over 4 ranks (shards of 3), rank 2 lost, rank 1
holding its copy: rank 0 has ``[0, 3)``, rank 1 ``[3, 6)`` and ``[6, 9)``,
rank 3 ``[9, 12)``; the three survivors want ``[0, 4)``, ``[4, 8)``, ``[8,
12)``: rank 0 keeps ``[0, 3)``, rank 1 sends ``[3, 4)`` to rank 0, keeps ``[4,
8)`` and sends ``[8, 9)`` to rank 2 (the old rank 3), which keeps ``[9, 12)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..comm import FlatComm
from ..flat import Range

__all__ = ["Moved", "moves", "resplit"]

#: ``moves(...)[i][j]``: the world ranges rank ``i`` sends to rank ``j``, in order,
#: each with the index of the piece of rank ``i`` it is cut from.
Plan = list[list[list[tuple[Range, int]]]]


@dataclass
class Moved:
    """What a ``resplit`` moved, on this rank: ``bytes`` sent to other ranks,
    ``kept`` bytes copied within the rank, and ``peak`` bytes it allocated at
    once (the new shards, and what it sent and received)."""

    bytes: int = 0
    kept: int = 0
    peak: int = 0


def moves(have: Sequence[Sequence[Range]], want: Sequence[Range]) -> Plan:
    """Who sends what to whom: rank ``i`` holds the world ranges ``have[i]``
    (disjoint over every rank), rank ``j`` wants ``want[j]``. Pure.

    Raises:
        ValueError: two ranks hold the same element, or an element wanted is
            held nowhere (names the range).
    """
    pieces = sorted((r, i, k) for i, rs in enumerate(have) for k, r in enumerate(rs) if len(r))
    for (a, i, _), (b, j, _) in zip(pieces, pieces[1:]):
        if b.start < a.stop:
            raise ValueError(f"ranks {i} and {j} both hold [{b.start}, {min(a.stop, b.stop)})")
    plan: Plan = [[[] for _ in want] for _ in have]
    for j, w in enumerate(want):
        covered = w.start
        for r, i, k in pieces:
            part = r.intersect(w)
            if len(part):
                if part.start != covered:
                    break
                plan[i][j].append((part, k))
                covered = part.stop
        if len(w) and covered != w.stop:
            raise ValueError(f"rank {j} wants [{w.start}, {w.stop}) but "
                             f"[{covered}, ...) is held by no rank")
    return plan


def resplit(group: FlatComm, pieces: Sequence[tuple[Range, dict[str, Any]]], want: Range,
            dtypes: dict[str, Any], xp: Any, moved: Moved | None = None,
            out: dict[str, Any] | None = None) -> dict[str, Any]:
    """This rank's range ``want`` of each vector of ``dtypes`` (name: dtype), put
    together from the ``pieces`` every rank holds (``(world range, arrays by
    name)``; disjoint over ``group``): per name, one ``Alltoallv`` per piece
    slot (a rank's first pieces, then its second ones), each sending the
    overlaps straight from the piece and receiving them in place (``moves``):
    nothing is packed. Returns the new arrays by name (NumPy or CuPy as the
    pieces), ``out``'s where given (a piece that may share memory with one is
    copied first: MPI's buffers must not overlap). ``moved``: what was sent,
    added to. Collective over ``group``."""
    every = group.allgather(([tuple(r) for r, _ in pieces], tuple(want)))
    plan = moves([[Range(*r) for r in rs] for rs, _ in every], [Range(*w) for _, w in every])
    me, n = group.rank, group.size
    slots = max(len(rs) for rs, _ in every)
    found: dict[str, Any] = {}
    for name, dtype in dtypes.items():
        mine = out[name] if out is not None else xp.empty(len(want), dtype=dtype)
        made = 0 if out is not None else mine.nbytes
        for k in range(slots):
            # (Not ``mine[:0]``: Open MPI takes a send buffer at the receive
            # buffer's address for MPI_IN_PLACE.)
            held, source = pieces[k] if k < len(pieces) else (want, xp.zeros(1, dtype=dtype))
            if k < len(pieces):
                source = source[name]
                if xp.may_share_memory(source, mine):
                    source = source.copy()
                    made += source.nbytes
            sends, sdispls = _segments([[r for r, p in plan[me][j] if p == k] for j in range(n)],
                                       held.start)
            receives, rdispls = _segments([[r for r, p in plan[i][me] if p == k]
                                           for i in range(n)], want.start)
            group.Alltoallv(source, sends, mine, receives, slot=("resplit", name, k),
                            senddispls=sdispls, recvdispls=rdispls)
            if moved is not None:
                moved.bytes += (sum(sends) - sends[me]) * mine.itemsize
                moved.kept += sends[me] * mine.itemsize
        found[name] = mine
        if moved is not None:
            moved.peak = max(moved.peak, made)
    return found


def _segments(parts: list[list[Range]], origin: int) -> tuple[list[int], list[int]]:
    """``(counts, displacements)`` of one range per rank (at most one: a piece
    overlaps a wanted range in one range), relative to ``origin``."""
    return ([sum(len(r) for r in rs) for rs in parts],
            [rs[0].start - origin if rs else 0 for rs in parts])
