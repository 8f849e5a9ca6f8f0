"""Cases of the MPI tests at 3 ranks, each in a job of its own ``mpirun -n 3``.

The MPI runs (``tests/mpi``) use 1, 2 and 4 ranks; these uneven splits over 3
ranks run here, with plain pytest. Each job imports its test module from
``tests/mpi`` for the helpers and compares with one process (the serial reference
in the job, or the same training on ``MPI.COMM_SELF`` in this process).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from types import ModuleType

import pytest
from mpi4py import MPI
from mpijobs import REPO, SUPPORT, mpirun

pytestmark = pytest.mark.launch

#: The folder of the MPI tests whose helpers the jobs (and this process) import.
MPI_TESTS = REPO / "tests" / "mpi"


def mpi_tests_path() -> str:
    """``PYTHONPATH`` for a job that imports modules of ``tests/mpi`` (and ``tests/support``)."""
    return os.pathsep.join(p for p in (str(MPI_TESTS), str(SUPPORT),
                                       os.environ.get("PYTHONPATH", "")) if p)


def mpi_test_module(name: str) -> ModuleType:
    """A module of ``tests/mpi`` (for its helpers), imported in this process."""
    if str(MPI_TESTS) not in sys.path:
        sys.path.insert(0, str(MPI_TESTS))
    return importlib.import_module(name)


def test_three_ranks_equal_one_process():
    """``tests/mpi/test_local_data.py`` at 3 ranks (blocks of 18, 0 and 52 rows)
    against one process, in its own job."""
    code = """
import numpy as np
from mpi4py import MPI
from mpishard import ShardingConfiguration
from mpishard.data import LocalDataset
from mpishard.nn import MLP
from mpishard.optim import Adam
from mpishard.strategies import ZeRO2Optimizer
import test_local_data as t
x, y = t.union()
lo, hi = t.blocks(t.TOTAL, MPI.COMM_WORLD.size)[MPI.COMM_WORLD.rank]
config = ShardingConfiguration(MPI.COMM_WORLD)
model = MLP(t.SIZES, activation="tanh", dtype=np.float64, seed=3)
opt = ZeRO2Optimizer(Adam(lr=1e-2), config, reduce_method="reduce_scatter")
result = opt.optimize(model, LocalDataset(x[lo:hi], y[lo:hi], config), epochs=2,
                      batch_size=t.BATCH)
ref, losses = t.serial_reference(x, y, epochs=2)
np.testing.assert_allclose(model.params, ref, rtol=1e-10, atol=1e-13)
np.testing.assert_allclose(result.losses, losses, rtol=1e-10)
rows = MPI.COMM_WORLD.gather(hi - lo)
if MPI.COMM_WORLD.rank == 0:
    print("rows held:", *rows, flush=True)
"""
    job = mpirun(3, code, timeout=240, env={"PYTHONPATH": mpi_tests_path()})
    assert job.returncode == 0, job.output
    assert "rows held: 18 0 52\n" in job.output, job.output


THREE_RANKS = """
import json, sys
sys.path.insert(0, {tests!r})
import numpy as np
from mpi4py import MPI
import test_reproducible as t
out = [list(t.train(MPI.COMM_WORLD, *case[:5], unit_rows=case[5])[:2]) for case in t.CASES3]
if MPI.COMM_WORLD.rank == 0:
    print("HASHES " + json.dumps(out))
"""


def test_three_ranks():
    """``tests/mpi/test_reproducible.py``'s training runs (``CASES3``) at 3 ranks: the
    same bits as one process."""
    t = mpi_test_module("test_reproducible")
    job = mpirun(3, THREE_RANKS.format(tests=str(MPI_TESTS)), timeout=300,
                 env={"PYTHONPATH": mpi_tests_path()})   # tests/support: worlds
    assert job.returncode == 0, job.output
    # Anywhere in a line, the JSON alone: another rank's terminal reset (ESC[0m,
    # no newline) may land before or after it (mpirun joins the ranks' output).
    line = next(x for x in job.output.splitlines() if "HASHES " in x)
    got = json.JSONDecoder().raw_decode(line[line.index("HASHES ") + len("HASHES "):])[0]
    for case, hashes in zip(t.CASES3, got):
        kind, model, dtype, acc, clip, rows = case
        serial = t.train(MPI.COMM_SELF, "ddp", model, dtype, acc, clip, unit_rows=rows)
        assert tuple(hashes) == serial[:2], case
