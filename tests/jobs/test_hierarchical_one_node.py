"""The hierarchical reductions on this machine alone (one node): one level, the
group's own calls. Plain pytest: the test starts ``mpirun -n 4`` on a case of
``tests/support/cluster_cases.py`` (the same case across two nodes:
``tests/cluster/test_cluster.py``).
"""

from __future__ import annotations

import pytest
from mpijobs import SUPPORT, mpirun

pytestmark = pytest.mark.launch

CASES = SUPPORT / "cluster_cases.py"


def test_hierarchical_reductions_on_one_node_are_the_flat_ones():
    """No cluster needed: 4 ranks on this machine, one level (the group's own calls)."""
    job = mpirun(4, [str(CASES), "hierarchical"], timeout=120)
    assert job.returncode == 0, job.output
    assert job.output.count("levels 1 nodes x 4 ranks, chose flat;;") == 4, job.output
