"""Training inside a coupled simulation: world rank 0 simulates, the other ranks train
on a sub-communicator of their own. What a late rank does to the training, by kind
of wait, and what the caller's own communicator is worth after a timeout.

* Deadlines by kind: a ``BatchStream`` step waits for the slowest rank's data
  (``data_timeout``), a checkpoint for rank 0's ``fsync`` (``io_timeout``), a
  collective for the other ranks (``timeout``); ``timeout`` alone still bounds
  all three, and each message names the deadline that ran out.
* The constructor's one call on the caller's communicator is its duplication: a
  rank that arrives late fails on the library's duplicate, and the caller's own
  collectives then pair up on every rank.
* ``HDF5Dataset`` opens over the ranks it is given (a configuration's, under
  its file-I/O deadline), never ``MPI.COMM_WORLD`` unasked, and closes at exit
  without h5py's tracebacks when ``close()`` was forgotten.

Each test starts its own ``mpirun`` (a timeout must not leave a pytest-mpi run
waiting) and checks what the job printed; results are compared with one NumPy
process trained on the same batches.
"""

from __future__ import annotations

import json
import re

import h5py
import numpy as np
import pytest
from mpijobs import mpirun

# Timeouts of 1 s that every healthy rank must meet: run alone (scripts/test.sh).
pytestmark = [pytest.mark.launch, pytest.mark.timing]

#: World rank 0 simulates; the others train on ``ml``. ``late(seconds)`` sleeps on
#: the last trainer only.
SETUP = """
import json, sys, time
import numpy as np
from mpi4py import MPI
from mpishard import CommunicationError, ShardingConfiguration
from mpishard.data import BatchStream
from mpishard.nn import MLP
from mpishard.optim import SGD
from mpishard.strategies import DDPOptimizer

world = MPI.COMM_WORLD
trains = world.rank > 0
ml = world.Split(color=int(trains), key=world.rank)
last = world.rank == world.size - 1

def late(seconds):
    if last:
        time.sleep(seconds)

def batches(n=4, late_at=None, seconds=0.0):
    rng = np.random.default_rng(5)
    w = rng.standard_normal((3, 2))
    for k in range(n):
        x = rng.standard_normal((8, 3))
        if k == late_at:
            late(seconds)                 # this rank's simulation is behind
        yield x, np.tanh(x @ w)

def report(what):
    sys.stdout.write(f"RESULT {world.rank} " + json.dumps(what) + "\\n")
    sys.stdout.flush()
"""


def reports(out: str) -> dict[int, list]:
    """Each rank's reports, in order. (mpirun forwards the ranks' output in pieces
    that may meet on one line: each report is read from its tag on.)"""
    found: dict[int, list] = {}
    decoder = json.JSONDecoder()
    for match in re.finditer(r"RESULT (\d+) ", out):
        found.setdefault(int(match.group(1)), []).append(decoder.raw_decode(out, match.end())[0])
    return found


def results(out: str) -> dict[int, object]:
    """Each rank's last report."""
    return {rank: said[-1] for rank, said in reports(out).items()}


def serial(n: int = 4) -> np.ndarray:
    """One process, one SGD step (lr 0.1) per batch of the stream above."""
    from mpishard.nn import MLP

    model = MLP([3, 4, 2], activation="tanh", loss="mse", dtype=np.float64, seed=2)
    rng = np.random.default_rng(5)
    w = rng.standard_normal((3, 2))
    for _ in range(n):
        x = rng.standard_normal((8, 3))
        model.forward_backward(x, np.tanh(x @ w))
        model.params -= 0.1 * model.grads
    return model.params.copy()


STREAM = """
config = ShardingConfiguration(ml, abort_on_exception=False, {deadlines})
model = MLP([3, 4, 2], activation="tanh", loss="mse", dtype=np.float64, seed=2)
try:
    result = DDPOptimizer(SGD(lr=0.1), config).optimize(
        model, BatchStream(batches(late_at=2, seconds=3.0)))
    report({{"steps": result.steps, "params": model.params.tolist()}})
except CommunicationError as exc:
    report({{"error": str(exc).splitlines()[0]}})
"""


def test_a_late_simulation_rank_is_waited_for_under_the_data_deadline():
    """timeout=1 for collectives, data_timeout=None: the last trainer's simulation
    is 3 s late with batch 2, and training still ends like one process."""
    code, out, _ = mpirun(3, SETUP + "if trains:\n" + _indent(STREAM.format(
        deadlines="timeout=1, data_timeout=None")), timeout=120)
    assert code == 0, out
    got = results(out)
    assert sorted(got) == [1, 2], out
    for r in (1, 2):
        assert got[r]["steps"] == 4, out
        np.testing.assert_allclose(got[r]["params"], serial(), rtol=1e-12)


# 6 s, not 60: long against the 1 s data deadline and the 3 s late batch (were the
# data wait bounded by timeout, the late batch would arrive in time and nothing would
# fail), and the job ends one `timeout` after the late rank arrives (70 s with 60,
# 21 s with 15, about 10 s with 6).
@pytest.mark.parametrize("deadlines", ["timeout=1", "timeout=6, data_timeout=1"])
def test_the_data_deadline_names_itself(deadlines):
    """timeout=1 alone bounds the data wait as it always did; data_timeout=1 with a
    long timeout bounds it too. The message names data_timeout and the batch."""
    code, out, seconds = mpirun(3, SETUP + "if trains:\n" + _indent(STREAM.format(
        deadlines=deadlines)), timeout=120)
    assert code == 0, out
    waiting = results(out)[1]["error"]
    assert "Iallgatherv over the training group (size 2) in BatchStream batch 2 did not " \
           "finish within 1 s (data_timeout=1: a wait for the slowest rank's data" in waiting, out
    assert waiting.startswith("world rank 1 on "), waiting
    assert "(rank 0 of the training group)" in waiting, waiting


CHECKPOINT = """
import os
from mpishard.checkpoint import CheckpointManager
if world.rank == 1:                     # rank 0 of the trainers writes the seal
    real = os.fsync
    def slow_fsync(fd):
        time.sleep(1.5)                 # a busy shared file system
        real(fd)
    os.fsync = slow_fsync
config = ShardingConfiguration(ml, abort_on_exception=False, {deadlines})
model = MLP([3, 4, 2], activation="tanh", loss="mse", dtype=np.float64, seed=2)
opt = DDPOptimizer(SGD(lr=0.1), config)
folder = "{folder}"
try:
    opt.optimize(model, BatchStream(batches()), checkpoints=CheckpointManager(folder))
    report({{"files": sorted(os.listdir(folder)), "params": model.params.tolist()}})
except CommunicationError as exc:
    report({{"error": str(exc).splitlines()[0]}})
"""


def test_a_slow_fsync_is_waited_for_under_the_io_deadline(tmp_path):
    folder = tmp_path / "ckpt"
    code, out, _ = mpirun(3, SETUP + "if trains:\n" + _indent(CHECKPOINT.format(
        deadlines="timeout=1, io_timeout=30", folder=folder)), timeout=120)
    assert code == 0, out
    got = results(out)
    for r in (1, 2):
        assert got[r]["files"] == ["ckpt-0000000004.h5"], out
        np.testing.assert_allclose(got[r]["params"], serial(), rtol=1e-12)
    code, out, _ = mpirun(3, SETUP + "if trains:\n" + _indent(CHECKPOINT.format(
        deadlines="timeout=1", folder=tmp_path / "again")), timeout=120)
    assert code == 0, out
    errors = [r["error"] for r in results(out).values()]
    assert any(str(tmp_path / "again") in e and "did not finish within 1 s (io_timeout=1: "
               "a wait for file I/O" in e for e in errors), out


def test_a_late_rank_in_the_constructor_leaves_the_callers_communicator_usable():
    """abort_on_exception=False, the last trainer 4 s late: both trainers time out
    (the late one on the library's duplicate), then their own Ibarrier and
    allreduce on ``ml`` pair up, and the simulation's on the world too."""
    code, out, _ = mpirun(3, SETUP + """
def waited(request, seconds=10.0):
    end = time.monotonic() + seconds
    while not request.Test():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True

if trains:
    late(4.0)
    try:
        ShardingConfiguration(ml, abort_on_exception=False, timeout=1)
        error = None
    except CommunicationError as exc:
        error = str(exc).splitlines()[0]
    barrier = waited(ml.Ibarrier())
    total = ml.allreduce(world.rank) if barrier else None
    report({"error": error, "barrier": barrier, "total": total})
everyone = waited(world.Ibarrier())
report({"world": everyone, "sum": world.allreduce(world.rank) if everyone else None})
""", timeout=120)
    assert code == 0, out
    got = reports(out)
    for r in (1, 2):
        first, everyone = got[r]
        assert first["barrier"] is True and first["total"] == 3, out
        assert everyone == {"world": True, "sum": 3}, out
    assert got[0] == [{"world": True, "sum": 3}], out
    assert "Iallreduce over the caller's group (size 2) in ShardingConfiguration(comm=...)" \
           in got[1][0]["error"] and "did not finish within 1 s (timeout=1" in \
           got[1][0]["error"], out
    assert re.search(r"the last rank of the caller's group called ShardingConfiguration\(\) "
                     r"[45]\.\d s after the first, past timeout=1", got[2][0]["error"]), out


def _series(tmp_path):
    path = tmp_path / "flow.h5"
    u = np.sin(np.linspace(0, 8, 65)[:, None] + np.linspace(0, np.pi, 4))
    with h5py.File(path, "w") as f:
        f["u"] = u
    return path, u


def test_hdf5_dataset_opens_over_the_ranks_it_is_given(tmp_path):
    """Not over MPI.COMM_WORLD unasked (the simulation would never come: before,
    the trainers hung there without a word); over the configuration's ranks."""
    path, u = _series(tmp_path)
    code, out, _ = mpirun(3, SETUP + f"""
from mpishard.data import HDF5Dataset
if trains:
    config = ShardingConfiguration(ml, timeout=30)
    try:
        HDF5Dataset("{path}", "/u").close()
        report({{"default": None}})
    except TypeError as exc:
        report({{"default": str(exc)}})
    with HDF5Dataset("{path}", "/u", comm=config) as data:
        x, y = data.read(0, len(data))
        np.save(f"{tmp_path}/x-{{world.rank}}.npy", x)
        np.save(f"{tmp_path}/y-{{world.rank}}.npy", y)
        report({{"rows": len(data), "driver": data.driver}})
""", timeout=60)
    assert code == 0, out
    got = reports(out)
    assert sorted(got) == [1, 2], out
    for r in (1, 2):
        default, data = got[r]
        assert default["default"] == (
            "HDF5Dataset opens its file collectively: pass comm= the ranks that train (the "
            "ShardingConfiguration, or a communicator); MPI.COMM_WORLD, of 3 processes here, "
            "is not assumed"), out
        assert data["rows"] == 64 and data["driver"] == "mpio", out
        np.testing.assert_array_equal(np.load(tmp_path / f"x-{r}.npy"), u[:-1])
        np.testing.assert_array_equal(np.load(tmp_path / f"y-{r}.npy"), u[1:])


@pytest.mark.parametrize("comm", ["config", "config.world", "ml"])
def test_hdf5_dataset_left_open_is_closed_at_exit(tmp_path, comm):
    """A dataset whose close() was forgotten (two of them, opened over the trainers'
    ranks) is closed at exit, after the configuration was freed: no h5py traceback,
    no abort, exit status 0."""
    path, u = _series(tmp_path)
    code, out, _ = mpirun(3, SETUP + f"""
from mpishard.data import HDF5Dataset
if trains:
    config = ShardingConfiguration(ml, timeout=30)
    first = HDF5Dataset("{path}", "/u", comm={comm})
    second = HDF5Dataset("{path}", "/u", comm={comm})
    x, _ = first.read(0, 4)
    report({{"x": x.tolist(), "driver": second.driver}})
    config.free()
""", timeout=60)
    assert code == 0, out
    got = results(out)
    for r in (1, 2):
        np.testing.assert_array_equal(got[r]["x"], u[:4])
        assert got[r]["driver"] == "mpio", out
    assert "Traceback" not in out and "objects still open" not in out, out
    assert "[mpishard]" not in out, out


def test_hdf5_dataset_opens_under_the_io_deadline(tmp_path):
    path, _ = _series(tmp_path)
    code, out, _ = mpirun(3, SETUP + f"""
from mpishard.data import HDF5Dataset
if trains:
    config = ShardingConfiguration(ml, abort_on_exception=False, timeout=60, io_timeout=1)
    late(4.0)
    try:
        HDF5Dataset("{path}", "/u", comm=config).close()
        report({{"late": None}})
    except CommunicationError as exc:
        report({{"late": str(exc).splitlines()[0]}})
""", timeout=120)
    assert code == 0, out
    waiting = results(out)[1]["late"]
    assert f"in HDF5Dataset({path}) did not finish within 1 s (io_timeout=1: a wait for " \
           f"file I/O" in waiting, out


def _indent(code: str) -> str:
    return "".join(f"    {line}\n" for line in code.strip("\n").splitlines())
