"""The namespace cluster of ``scripts/cluster-local.sh`` as a pytest fixture.

``cluster`` (module scope) starts 2 nodes of 2 slots (network namespaces on a
bridge, each with its own host name, reached by Open MPI through an rsh agent),
yields the variables of its environment file, and stops it at the end, also after
a failure; where namespaces cannot be made (not root, no ``ip``, no bridge) the
tests that use it skip with the reason. Import the fixture into a test module
(``from nscluster import cluster``); used by ``tests/cluster`` and by
``tests/faults/test_ulfm_cluster.py``.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from mpijobs import REPO

__all__ = ["HOSTS", "SCRIPT", "STATE", "cluster", "cluster_local"]

SCRIPT = REPO / "scripts" / "cluster-local.sh"
STATE = Path(os.environ.get("MPISHARD_CLUSTER_DIR", "/run/mpishard-cluster"))
HOSTS = ["mpishard-node0", "mpishard-node1"]


def cluster_local(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``bash scripts/cluster-local.sh ARGS``, its output captured."""
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def cluster() -> dict[str, str]:
    """A 2-node cluster (uncapped links) for the module; its environment file's variables."""
    check = cluster_local("check")
    if check.returncode != 0:
        pytest.skip(f"no namespace cluster here: {check.stdout.strip() or check.stderr.strip()}")
    try:
        start = cluster_local("start", "--nodes", "2", "--slots", "2")
        if start.returncode != 0:
            pytest.fail(f"cluster-local.sh start failed:\n{start.stdout}{start.stderr}")
        text = (STATE / "env").read_text()
        env = dict(re.findall(r'^export (\w+)="?(.*?)"?$', text, re.M))
        yield env
    finally:
        cluster_local("stop")
