"""What pytest needs for every test folder: the helpers' path, fixtures and markers.

The test folders, each one kind of run (``scripts/test.sh``):

* ``unit/``: no MPI world, plain pytest;
* ``mpi/``: ``mpirun -n N python -m pytest --with-mpi`` (N = 1, 2, 4; the tests
  marked ``layout3d`` also at N = 8);
* ``jobs/``: tests that start their own ``mpirun`` or whole programs, plain pytest;
* ``cluster/``: jobs over the namespace cluster (``scripts/cluster-local.sh``);
* ``faults/``: ULFM tests, plain pytest in ``.venv-ft``.

The helpers live in ``support/`` (on ``sys.path`` from here): ``mpijobs`` (jobs
with their own ``mpirun``), ``backends`` (the ``xp`` and ``kernels`` fixtures), ``strategies``
(``STRATEGIES``), ``reference`` (the one serial reference), ``worlds`` (skips for
world sizes a test does not fit), ``elastic``, ``slurmjobs``, ``nscluster`` (the
``cluster`` fixture), ``stuckjob`` and ``deposit_cases`` (vectors for the
binned-sum kernels), and the job scripts ``elastic_worker.py`` and
``cluster_cases.py``. World sizes: ``@pytest.mark.mpi(min_size=N)`` (pytest-mpi)
skips a test, on every rank, when the world has fewer than ``N`` ranks.
"""

from __future__ import annotations

import mpishard  # noqa: F401  (first: each rank limits its BLAS threads before NumPy loads)

# isort: split
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

# isort: split
from backends import kernels, xp  # noqa: E402, F401  (the fixtures)
from mpijobs import mpirun  # noqa: E402
from nscluster import cluster  # noqa: E402, F401  (the fixture: tests/cluster, tests/faults)


@pytest.fixture(name="mpirun")
def _mpirun_fixture():
    """:func:`mpijobs.mpirun`, for tests that take it as a fixture."""
    return mpirun
