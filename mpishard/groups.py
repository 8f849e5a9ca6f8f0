"""``ProcessGroups``: the data, tensor and pipeline communicators of one rank."""

from __future__ import annotations

from dataclasses import dataclass, field

from mpi4py import MPI

from .topology import Coordinates, Topology

__all__ = ["ProcessGroups"]


@dataclass
class ProcessGroups:
    """The communicators of this rank, split from a parent communicator.

    ``world`` is a duplicate of the parent (so the library's messages never mix
    with the caller's), and ``dp``, ``tp``, ``pp`` come from ``Comm.Split`` of it in
    the ``tp-dp-pp`` order of :mod:`mpishard.topology`. With 8 ranks, tp=2, dp=2,
    pp=2, rank 5 has ``tp`` = {4,5}, ``dp`` = {5,7}, ``pp`` = {1,5}; its ranks in
    those groups are 1, 0 and 1.

    Building is collective over the parent; :meth:`free` (or leaving a ``with``
    block) is collective over it too.
    """

    topology: Topology
    world: MPI.Comm
    dp: MPI.Comm
    tp: MPI.Comm
    pp: MPI.Comm
    coordinates: Coordinates = field(init=False)

    def __post_init__(self) -> None:
        self.coordinates = self.topology.coordinates(self.world.Get_rank())

    @classmethod
    def split(cls, comm: MPI.Comm, topology: Topology) -> ProcessGroups:
        """Split ``comm`` into the groups of ``topology``. Collective over ``comm``."""
        world = comm.Dup()
        rank = world.Get_rank()
        c = topology.coordinates(rank)
        # Colour = the coordinates a group shares; key = position inside the group.
        dp = world.Split(color=c.pp * topology.tp + c.tp, key=c.dp)
        tp = world.Split(color=c.pp * topology.dp + c.dp, key=c.tp)
        pp = world.Split(color=c.dp * topology.tp + c.tp, key=c.pp)
        return cls(topology=topology, world=world, dp=dp, tp=tp, pp=pp)

    def free(self) -> None:
        """Free the communicators. Collective over ``world``."""
        for name in ("pp", "tp", "dp", "world"):
            comm = getattr(self, name)
            if comm != MPI.COMM_NULL:
                comm.Free()

    def __enter__(self) -> ProcessGroups:
        return self

    def __exit__(self, *exc) -> None:
        self.free()
