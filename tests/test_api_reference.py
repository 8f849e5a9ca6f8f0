"""docs/api.md is the reference generated from the current docstrings."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO, mpi_env


def test_api_reference_is_current():
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "api_reference.py"), "--check"],
                          env=mpi_env(), capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr + proc.stdout


def test_api_reference_documents_what_the_readme_names():
    text = (REPO / "docs" / "api.md").read_text()
    for name in ("mpishard.checkpoint.load_checkpoint(", "strict_architecture",
                 "mpishard.checkpoint.CheckpointInfo(", "mpishard.nn.FunctionModel(",
                 "mpishard.strategies.DDPOptimizer(", "mpishard.ShardingConfiguration(",
                 "abort_on_exception", "mpishard.data.BatchStream(",
                 "mpishard.data.LocalDataset(", "mpishard.comm.NodeMap(",
                 "mpishard.comm.hierarchical.choose(", "allow_tensor_across_nodes",
                 "reproducible", "unit_rows", "fault_tolerance", "evict_stuck",
                 "mpishard.comm.ulfm.available(", "mpishard.comm.ulfm.leave(",
                 "mpishard.parallel.recovery.recover_in_place(", "InexactRecoveryWarning",
                 "buddy_copies", "recoveries", "overlap_timings", "mpishard.reprosum"):
        assert name in text, name
