"""``Reducer``: what a data-parallel gradient reduction calls on its group.

Three objects of this layer answer it: the group's own
[`FlatComm`][mpishard.comm.FlatComm] (flat), a
[`HierarchicalComm`][mpishard.comm.hierarchical.HierarchicalComm] (inside the
nodes, then across) and a [`RingComm`][mpishard.comm.ring.RingComm] (a ring of
point-to-point messages). [`choose`][mpishard.comm.hierarchical.choose] measures
them and returns one; the strategies' reductions
([`mpishard.parallel.reduction`][mpishard.parallel.reduction]) call it without
knowing which. A reducer made over a group (not the group itself) owns
communicators of its own: [`OwnedReducer`][mpishard.comm.reducer.OwnedReducer]
names them, for a recovery to revoke, and frees them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from .communicator import FlatComm

__all__ = ["OwnedReducer", "Reducer"]


@runtime_checkable
class Reducer(Protocol):
    """Sums over a group, blocking and not, whole or to per-rank pieces. Each
    call is collective over the reducer's group; ``slot`` names the call's
    reusable buffers, ``finish`` runs once a non-blocking call is complete."""

    name: str
    rank: int
    size: int

    def Allreduce(self, buf: Any, slot: Any = "allreduce", op: str = "sum") -> None: ...

    def Iallreduce(self, buf: Any, slot: Any = "allreduce",
                   finish: Callable[[], None] | None = None, op: str = "sum") -> Any: ...

    def Reduce_scatter(self, sendbuf: Any, recvbuf: Any, counts: list[int],
                       slot: Any = "reduce_scatter") -> None: ...

    def Ireduce_scatter(self, sendbuf: Any, recvbuf: Any, counts: list[int],
                        slot: Any = "reduce_scatter",
                        finish: Callable[[], None] | None = None) -> Any: ...


@runtime_checkable
class OwnedReducer(Reducer, Protocol):
    """A [`Reducer`][mpishard.comm.reducer.Reducer] made over a group, with
    communicators of its own (a two-level reduction's, a ring's)."""

    def communicators(self) -> list[FlatComm]:
        """The communicators it made (not its group). Local."""
        ...

    def free(self) -> None:
        """Free them. Collective over the group."""
        ...
