"""ZeRO-3 across the nodes of the namespace cluster (``scripts/cluster-local.sh``; root).

2 nodes of 2 ranks (uncapped links), the fixture of ``tests/test_cluster.py``; each
job (``zero3_cases.py``) checks against its serial reference (float64, rtol 1e-10):
ZeRO-3 with its data group over both nodes, with and without prefetch (every
parameter gather crosses the link), and tensor parallel inside the nodes with
ZeRO-3 across them. Skips, saying why, where no cluster can be made.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest
from mpijobs import SUPPORT, mpi_env
from nscluster import HOSTS
from test_cluster import hosts_by_rank

pytestmark = pytest.mark.launch

CASES = SUPPORT / "zero3_cases.py"


def run_case(env, case, n=4, timeout=180):
    command = [*shlex.split(env["MPISHARD_CLUSTER_EXEC"]), "mpirun",
               *shlex.split(env["MPISHARD_CLUSTER_MPIRUN_FLAGS"]), "-n", str(n),
               sys.executable, str(CASES), case]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=mpi_env(), start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        pytest.fail(f"{case} did not finish within {timeout:g} s:\n{out}")
    assert proc.returncode == 0, f"{case} failed (exit {proc.returncode}):\n{out}"
    oks = re.findall(rf"{re.escape(case)} ok on (\S+) rank (\d+): (.*?);;", out)
    assert len(oks) == n, f"expecting {n} ranks to report, got {len(oks)}:\n{out}"
    return oks


@pytest.mark.parametrize("case", ["zero3-prefetch", "zero3-no-prefetch"])
def test_zero3_gathers_across_nodes_match_serial(cluster, case):  # noqa: F811
    oks = run_case(cluster, case)
    assert hosts_by_rank(oks) == [HOSTS[0], HOSTS[0], HOSTS[1], HOSTS[1]]
    assert all("12 steps" in d and "data group over 2 nodes" in d for _, _, d in oks), oks


def test_tensor_inside_nodes_zero3_across_matches_serial(cluster):  # noqa: F811
    oks = run_case(cluster, "tp2-zero3")
    assert all("data group over 2 nodes" in d for _, _, d in oks), oks
