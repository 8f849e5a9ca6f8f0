"""The node map without MPI: how ranks are renumbered node by node, and a tensor
group that would cross nodes refused (jobs over the nodes of the namespace
cluster: ``tests/cluster/test_cluster.py``).
"""

from __future__ import annotations

import pytest

from mpishard import TopologyError
from mpishard.comm.nodes import NodeMap, crossing_groups, node_placement


def test_node_placement_renumbers_round_robin_ranks_node_by_node():
    nodes = NodeMap(node_of=(0, 1, 0, 1, 0, 1), hosts=("a", "b"))
    assert node_placement(nodes, 1) is None
    assert node_placement(nodes, 3) == [0, 3, 1, 4, 2, 5]   # new rank of each old rank
    assert node_placement(NodeMap((0, 0, 1, 1), ("a", "b")), 2) is None
    assert nodes.describe() == "2 nodes: a ranks 0, 2, 4; b ranks 1, 3, 5"
    assert NodeMap((0, 0, 0, 1), ("a", "b")).describe() == "2 nodes: a ranks 0-2; b ranks 3"


def test_a_tensor_group_that_must_cross_nodes_is_refused_naming_the_node_sizes():
    nodes = NodeMap(node_of=(0, 0, 0, 1, 1, 1), hosts=("a", "b"))
    with pytest.raises(TopologyError, match=r"tensor_parallel_size 2 does not divide the "
                                            r"ranks of every node \(ranks per node \[3, 3\]"):
        node_placement(nodes, 2)
    assert crossing_groups(nodes, 2) == [[2, 3]]
