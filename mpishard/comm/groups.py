"""``ProcessGroups``: the world, data, tensor and pipeline groups of one rank."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from ..errors import TopologyError
from ..topology import Coordinates, Topology
from .communicator import FlatComm
from .nodes import NodeMap, crossing_groups, node_map, node_placement

__all__ = ["ProcessGroups"]


@dataclass
class ProcessGroups:
    """The groups of this rank, each one [`FlatComm`][mpishard.comm.FlatComm].

    ``world`` is a duplicate of the parent communicator (so the library's
    messages never mix with the caller's), and ``dp``, ``tp``, ``pp`` come from
    ``Comm.Split`` of it in the ``tp-dp-pp`` order of [`mpishard.topology`][mpishard.topology].
    With 8 ranks, tp=2, dp=2, pp=2, rank 5 has ``tp`` = {4,5}, ``dp`` = {5,7},
    ``pp`` = {1,5}; its ranks in those groups are 1, 0 and 1.

    ``nodes`` is the node map of ``world`` (`mpishard.comm.nodes`). Tensor
    groups are placed inside nodes: when the parent's rank order would put a
    tensor group on two nodes (ranks mapped round robin, ``--map-by node``),
    ``world`` is renumbered node by node; when no order can (a node's rank count
    is not a multiple of tp) the layout is refused with a ``TopologyError``, or,
    with ``allow_tensor_across_nodes=True``, accepted with a warning.

    These are the library's only communicators over these ranks: every
    collective and point-to-point call goes through them, so the timeout and
    the "which call, which group" message cover all of it. Pass them on
    explicitly (``groups.dp``); never make a second ``FlatComm`` over one.

    Building is collective over the parent; [`free`][mpishard.comm.ProcessGroups.free] (or leaving a
    ``with`` block) is collective over it too.
    """

    topology: Topology
    world: FlatComm
    dp: FlatComm
    tp: FlatComm
    pp: FlatComm
    nodes: NodeMap | None = None
    coordinates: Coordinates = field(init=False)

    def __post_init__(self) -> None:
        self.coordinates = self.topology.coordinates(self.world.rank)

    @classmethod
    def split(cls, world: FlatComm, topology: Topology, *,
              allow_tensor_across_nodes: bool = False) -> ProcessGroups:
        """Split ``world`` (the library's own duplicate of the parent) into the
        groups of ``topology``; ``world`` (renumbered node by node when the tensor
        groups need it, see the class doc) becomes `world`. Collective over
        ``world``.

        Raises:
            TopologyError: a tensor group would cross nodes (on every rank: the
                node map is the same on all of them), unless allowed.
        """
        nodes = node_map(world)
        try:
            placement = node_placement(nodes, topology.tp)
        except TopologyError as exc:
            if not allow_tensor_across_nodes:
                raise
            placement = None
            warnings.warn(f"tensor-parallel groups {crossing_groups(nodes, topology.tp)} "
                          f"cross nodes ({nodes.describe()}): their every layer "
                          f"communicates over the network ({exc})", stacklevel=3)
        if placement is not None:
            # Old rank r becomes placement[r]. The caller's ``world`` object takes
            # the renumbered communicator (it may hold the object already) and the
            # old one is freed: still one FlatComm over these ranks.
            placed = world.split(0, placement[world.rank], world.name)
            world.comm, placed.comm = placed.comm, world.comm
            world.rank = placed.rank
            placed.free()
            order = sorted(range(world.size), key=placement.__getitem__)
            nodes = NodeMap(node_of=tuple(nodes.node_of[old] for old in order),
                            hosts=nodes.hosts)
        c = topology.coordinates(world.rank)
        # Colour = the coordinates a group shares; key = position inside the group.
        dp = world.split(c.pp * topology.tp + c.tp, c.dp, "data-parallel")
        tp = world.split(c.pp * topology.dp + c.dp, c.tp, "tensor-parallel")
        pp = world.split(c.dp * topology.tp + c.tp, c.pp, "pipeline-parallel")
        return cls(topology=topology, world=world, dp=dp, tp=tp, pp=pp, nodes=nodes)

    def free(self) -> None:
        """Free the communicators. Collective over ``world``."""
        for name in ("pp", "tp", "dp", "world"):
            getattr(self, name).free()

    def __enter__(self) -> ProcessGroups:
        return self

    def __exit__(self, *exc) -> None:
        self.free()
