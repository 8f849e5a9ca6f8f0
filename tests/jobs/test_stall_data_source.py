"""A trainer blocked in its own data source is named as such (issue 34, item 6).

Each job (plain pytest, its own ``mpirun``) trains with ``timeout=2``; on one rank the
user's data stops giving rows at the third step: a ``Dataset`` whose ``gather``
blocks, or a ``BatchStream`` whose generator blocks. The rank waiting for it must
say that the stuck rank is in the user's data source (not "in no call of the
library"), and show its stack with the user's function.
"""

from __future__ import annotations

import re
import socket

import pytest
from mpijobs import mpirun

pytestmark = [pytest.mark.launch, pytest.mark.timing]

JOB = """
import os, time
import numpy as np
from mpi4py import MPI
from mpishard import ShardingConfiguration
from mpishard.data import ArrayDataset, BatchStream
from mpishard.nn import MLP
from mpishard.optim import Adam
from mpishard.strategies import DDPOptimizer

config = ShardingConfiguration(timeout=2, data_timeout=2)
rank = MPI.COMM_WORLD.rank
print(f"PID {{rank}} {{os.getpid()}}", flush=True)
rng = np.random.default_rng(0)
x, y = rng.standard_normal((64, 5)), rng.standard_normal((64, 3))
calls = 0

def blocked_read():
    time.sleep(600)                        # the user's source gives nothing more

class SlowDataset(ArrayDataset):
    def gather(self, indices, x_out, y_out):
        global calls
        calls += 1
        if rank == 1 and calls == 3:
            blocked_read()
        super().gather(indices, x_out, y_out)

def batches():
    for step in range(100):
        if rank == 1 and step == 2:
            blocked_read()
        yield x[:8], y[:8]

data = {{"dataset": SlowDataset(x, y), "stream": BatchStream(batches(), local=False)}}["{how}"]
ddp = DDPOptimizer(Adam(lr=1e-3), config)
model = MLP([5, 7, 3], seed=1, loss="mse", dtype=np.float64)
kwargs = {{"epochs": 5, "batch_size": 16}} if "{how}" == "dataset" else {{}}
ddp.optimize(model, data, **kwargs)
print("unreachable", flush=True)
"""


@pytest.mark.parametrize("how", ["dataset", "stream"])
def test_rank_blocked_in_its_data_source_is_named(how):
    job = mpirun(2, JOB.format(how=how), timeout=90, quiet=True)
    out = job.output
    assert job.returncode != 0, out
    assert "unreachable" not in out, out
    pid = dict(re.findall(r"PID (\d+) (\d+)", out))["1"]
    lines = [line for line in out.splitlines() if "did not finish within" in line]
    assert lines and lines[0].startswith("[mpishard] world rank 0 "), out
    assert "in no call of the library" not in lines[0], lines[0]
    assert (f"did not arrive: world rank 1 (pid {pid} on {socket.gethostname()}): is "
            f"running (state S) but is in the user's data source") in lines[0], lines[0]
    stack = out[out.index("[mpishard] Python stack of world rank 1"):]
    assert re.search(r'File "<string>", line \d+ in blocked_read', stack), out
