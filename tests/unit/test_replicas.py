"""Which data-parallel replicas are whole after lost ranks, without MPI (the jobs
that lose ranks under ULFM: ``tests/faults/test_ulfm_hybrid.py``).
"""

from __future__ import annotations


def test_whole_replicas_worked_example():
    # No MPI: the module docstring's 8 ranks, tp=2, dp=2, pp=2 (replica 0 = {0, 1, 4, 5},
    # replica 1 = {2, 3, 6, 7}), and dp=3 with a loss in each of two replicas.
    from mpishard.recovery import whole_replicas
    from mpishard.topology import Topology

    t = Topology.build(8, tp=2, pp=2)
    assert whole_replicas(t, [0, 1, 2, 3, 4, 5, 7]) == ([0], {1: [6]})
    assert whole_replicas(t, [1, 2, 3, 4, 5, 6, 7]) == ([1], {0: [0]})
    assert whole_replicas(t, range(8)) == ([0, 1], {})
    assert whole_replicas(t, [0, 2, 4, 6]) == ([], {0: [1, 5], 1: [3, 7]})
    t = Topology.build(12, tp=2, pp=2)                 # dp=3: replica d = {2d, 2d+1, 2d+6, 2d+7}
    assert whole_replicas(t, [r for r in range(12) if r not in (1, 11)]) == \
        ([1], {0: [1], 2: [11]})
