"""A rank lost on one node of a real (namespace) cluster: the survivors go on in place (ULFM).

Runs in the fault-tolerant runtime (``.venv-ft``: Open MPI 5 with ULFM), on the
2-node cluster of ``scripts/cluster-local.sh`` (network namespaces with their own
host names, TCP between them; the ``cluster`` fixture of ``tests/support/nscluster.py``
starts and stops it); skips, saying why, where either is missing. Each test runs the job
of ``tests/faults/test_ulfm_train.py`` at 4 ranks placed by node (ranks 0 and 2 on node
0, 1 and 3 on node 1) through ``prterun``'s ssh launcher: the victim, on node 1,
SIGKILLs itself in the test's phase; the survivors on both nodes revoke, shrink,
agree and go on, and end equal (rtol 1e-12) to the reference computed in the
same job, which drops the victim at the agreed step on purpose.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from mpijobs import mpi_env
from nscluster import HOSTS
from test_ulfm import MPIRUN, _ft_or_skip
from test_ulfm_train import job_code

pytestmark = pytest.mark.launch

SUBNET = "10.213.0.0/24"   # scripts/cluster-local.sh's


@pytest.fixture(scope="module", autouse=True)
def fault_tolerant_runtime() -> None:
    """Skip before the cluster is started where this is not the ULFM runtime."""
    _ft_or_skip()


@pytest.mark.parametrize("strategy,phase,seed", [("ddp", "bucket", 2),
                                                 ("zero2", "allgather", 13)])
def test_a_rank_lost_on_another_node_is_recovered_in_place(cluster, tmp_path,
                                                           strategy, phase, seed):
    code, victims, kill = job_code(tmp_path, phase, strategy=strategy, seed=seed, ranks=4,
                                   victims=[3])
    script = tmp_path / "job.py"
    script.write_text(code)
    agent = re.search(r"plm_rsh_agent (\S+)", cluster["MPISHARD_CLUSTER_MPIRUN_FLAGS"]).group(1)
    command = [*cluster["MPISHARD_CLUSTER_EXEC"].split(), str(MPIRUN), "--with-ft", "ulfm",
               "--mca", "coll", "^han", "--hostfile", cluster["MPISHARD_CLUSTER_HOSTFILE"],
               "--prtemca", "plm_ssh_agent", agent, "--prtemca", "plm_ssh_no_tree_spawn", "1",
               "--prtemca", "oob_tcp_if_include", SUBNET, "--mca", "btl_tcp_if_include",
               SUBNET, "--mca", "btl", "tcp,sm,self", "--map-by", "node", "-n", "4",
               sys.executable, str(script)]
    env = mpi_env({"PATH": f"{MPIRUN.parent}:{mpi_env()['PATH']}"})   # prted on each node
    job = subprocess.run(command, capture_output=True, text=True, env=env, timeout=180)
    out = job.stdout + job.stderr
    match = re.search(r"^RESULT (.*)$", out, re.MULTILINE)
    assert match, out
    result = json.loads(match.group(1))
    agreed = kill - 1
    [rec] = result["recoveries"]
    assert rec["lost_ranks"] == [3] and rec["world_size"] == 3 and rec["step"] == agreed, rec
    assert rec["from"] == ("buddy" if strategy == "zero2" else "survivor"), rec
    assert result["steps"] == 32 and result["allclose_reference"], result
    # The survivors are on both nodes, the victim beside one of them.
    hosts = dict(re.findall(r"^HOST (\d) (\S+)$", out, re.MULTILINE))
    assert hosts == {"0": HOSTS[0], "1": HOSTS[1], "2": HOSTS[0], "3": HOSTS[1]}, out
    assert re.search(rf"KILL 3 step \d+ {phase}", out), out
    print(f"{strategy} {phase} across {HOSTS}: recovery {rec['seconds']:.4f} s (shrink+agree "
          f"{rec['shrink_seconds']:.4f} s), vs reference {result['vs_reference']:.2e}")
    assert job.returncode == 0, out
