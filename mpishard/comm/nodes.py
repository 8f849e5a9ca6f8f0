"""The node map: which node (shared-memory domain) each rank of a group runs on.

MPI says which ranks share memory (``Split_type(COMM_TYPE_SHARED)``): those are
one node. Nodes are numbered by their lowest rank, so with 4 ranks placed by
slot on two nodes of 2 (Open MPI's default) the map is::

    rank   0 1 2 3
    node   0 0 1 1          ranks per node (2, 2)

and with ``--map-by node`` (round robin) it is ``0 1 0 1``. A tensor-parallel
group (neighbouring ranks in the ``tp-dp-pp`` order of [`mpishard.topology`][mpishard.topology])
stays inside a node when every node holds whole tensor groups:
`node_placement` finds the rank order that makes it so, or says why none does.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from math import gcd

from ..errors import TopologyError
from .communicator import FlatComm

__all__ = ["NodeMap", "crossing_groups", "node_map", "node_placement"]


@dataclass(frozen=True)
class NodeMap:
    """Where the ranks of one group run.

    ``node_of[r]``: the node of rank ``r`` (nodes numbered by their lowest rank);
    ``hosts[n]``: the host name of node ``n``.
    """

    node_of: tuple[int, ...]
    hosts: tuple[str, ...]

    @property
    def size(self) -> int:
        """Ranks in the group."""
        return len(self.node_of)

    @property
    def nodes(self) -> int:
        """Nodes the group spans."""
        return len(self.hosts)

    def ranks_on(self, node: int) -> list[int]:
        """The ranks on ``node``, in rank order."""
        return [r for r, n in enumerate(self.node_of) if n == node]

    @property
    def ranks_per_node(self) -> tuple[int, ...]:
        """How many ranks each node holds, by node."""
        return tuple(len(self.ranks_on(n)) for n in range(self.nodes))

    @property
    def contiguous(self) -> bool:
        """True when each node holds a consecutive run of ranks (placement by slot)."""
        return list(self.node_of) == sorted(self.node_of)

    def nodes_of(self, ranks: list[int]) -> list[int]:
        """The distinct nodes that ``ranks`` run on, in order of first appearance."""
        return list(dict.fromkeys(self.node_of[r] for r in ranks))

    def describe(self) -> str:
        """``2 nodes: mpishard-node0 ranks 0-1; mpishard-node1 ranks 2-3``."""
        parts = [f"{self.hosts[n]} ranks {_spans(self.ranks_on(n))}" for n in range(self.nodes)]
        return f"{self.nodes} node{'s' if self.nodes != 1 else ''}: {'; '.join(parts)}"

    def as_dict(self) -> dict[str, object]:
        """For JSON (``mpishard info --json``)."""
        return {"nodes": self.nodes, "ranks_per_node": list(self.ranks_per_node),
                "hosts": list(self.hosts), "node_of_rank": list(self.node_of)}


def node_map(group: FlatComm) -> NodeMap:
    """The node of every rank of ``group``, the same on every rank.
    Collective over ``group``: one ``Split_type`` (freed again) and one allgather."""
    node = group.split_shared("node")
    try:
        # The node's lowest rank in ``group`` names it (key=rank: node rank 0 is it).
        leader = node.bcast(group.rank, root=0)
    finally:
        node.free()
    seen = group.allgather((leader, socket.gethostname()))
    leaders = sorted({lead for lead, _ in seen})
    index = {lead: i for i, lead in enumerate(leaders)}
    hosts = tuple(seen[lead][1] for lead in leaders)
    return NodeMap(node_of=tuple(index[lead] for lead, _ in seen), hosts=hosts)


def node_placement(nodes: NodeMap, tp: int) -> list[int] | None:
    """A new rank for each rank (``placement[old] = new``) that keeps every tensor
    group of ``tp`` consecutive ranks inside one node, or None when the ranks are
    already placed so (nothing to change). Pure arithmetic.

    Ranks are renumbered node by node (a node's ranks keep their order), which is
    the placement by slot that Open MPI makes by default.

    Raises:
        TopologyError: a node holds a number of ranks that is not a multiple of
            ``tp``, so some tensor group must cross nodes; names the node sizes.
    """
    if tp == 1 or _inside_nodes(nodes.node_of, tp):
        return None
    sizes = nodes.ranks_per_node
    if any(s % tp for s in sizes):
        raise TopologyError(
            f"tensor_parallel_size {tp} does not divide the ranks of every node "
            f"(ranks per node {list(sizes)}: {nodes.describe()}), so a tensor-parallel "
            f"group would cross nodes; choose a tensor_parallel_size that divides "
            f"{_gcd(sizes)}, or pass allow_tensor_across_nodes=True to accept it")
    order = sorted(range(nodes.size), key=lambda r: (nodes.node_of[r], r))
    placement = [0] * nodes.size
    for new, old in enumerate(order):
        placement[old] = new
    return placement


def crossing_groups(nodes: NodeMap, tp: int) -> list[list[int]]:
    """The tensor groups (``tp`` consecutive ranks) that span more than one node."""
    groups = [list(range(start, start + tp)) for start in range(0, nodes.size, tp)]
    return [g for g in groups if len(nodes.nodes_of(g)) > 1]


def _inside_nodes(node_of: tuple[int, ...], tp: int) -> bool:
    return all(len(set(node_of[s:s + tp])) == 1 for s in range(0, len(node_of), tp))


def _gcd(sizes: tuple[int, ...]) -> int:
    out = 0
    for s in sizes:
        out = gcd(out, s)
    return out


def _spans(ranks: list[int]) -> str:
    """``0-1, 4`` for [0, 1, 4]."""
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(f"{start}" if start == r else f"{start}-{r}")
            start = None
    return ", ".join(out)
