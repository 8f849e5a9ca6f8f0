"""``ProcessGroups``: the world, data, tensor and pipeline groups of one rank."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..topology import Coordinates, Topology
from .communicator import FlatComm

__all__ = ["ProcessGroups"]


@dataclass
class ProcessGroups:
    """The groups of this rank, each one :class:`~mpishard.comm.FlatComm`.

    ``world`` is a duplicate of the parent communicator (so the library's
    messages never mix with the caller's), and ``dp``, ``tp``, ``pp`` come from
    ``Comm.Split`` of it in the ``tp-dp-pp`` order of :mod:`mpishard.topology`.
    With 8 ranks, tp=2, dp=2, pp=2, rank 5 has ``tp`` = {4,5}, ``dp`` = {5,7},
    ``pp`` = {1,5}; its ranks in those groups are 1, 0 and 1.

    These are the library's only communicators over these ranks: every
    collective and point-to-point call goes through them, so the timeout and
    the "which call, which group" message cover all of it. Pass them on
    explicitly (``groups.dp``); never make a second ``FlatComm`` over one.

    Building is collective over the parent; :meth:`free` (or leaving a ``with``
    block) is collective over it too.
    """

    topology: Topology
    world: FlatComm
    dp: FlatComm
    tp: FlatComm
    pp: FlatComm
    coordinates: Coordinates = field(init=False)

    def __post_init__(self) -> None:
        self.coordinates = self.topology.coordinates(self.world.rank)

    @classmethod
    def split(cls, world: FlatComm, topology: Topology) -> ProcessGroups:
        """Split ``world`` (the library's own duplicate of the parent) into the
        groups of ``topology``; ``world`` becomes :attr:`world`. Collective over
        ``world``."""
        c = topology.coordinates(world.rank)
        # Colour = the coordinates a group shares; key = position inside the group.
        dp = world.split(c.pp * topology.tp + c.tp, c.dp, "data-parallel")
        tp = world.split(c.pp * topology.dp + c.dp, c.tp, "tensor-parallel")
        pp = world.split(c.dp * topology.tp + c.tp, c.pp, "pipeline-parallel")
        return cls(topology=topology, world=world, dp=dp, tp=tp, pp=pp)

    def free(self) -> None:
        """Free the communicators. Collective over ``world``."""
        for name in ("pp", "tp", "dp", "world"):
            getattr(self, name).free()

    def __enter__(self) -> ProcessGroups:
        return self

    def __exit__(self, *exc) -> None:
        self.free()
