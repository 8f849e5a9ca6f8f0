"""How the library waits for MPI (mpishard/comm/waiting.py): spin or nap, by MPISHARD_WAIT
and the launcher's count of the node's ranks against the cores."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("mpi4py")
from mpishard.comm import waiting  # noqa: E402


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    for name in ("MPISHARD_WAIT", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"):
        monkeypatch.delenv(name, raising=False)
    waiting.naps.cache_clear()
    yield
    waiting.naps.cache_clear()


@pytest.mark.parametrize("name", ["OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"])
def test_auto_naps_only_where_the_nodes_ranks_outnumber_its_cores(monkeypatch, name):
    monkeypatch.setenv("MPISHARD_WAIT", "auto")
    cores = os.cpu_count() or 1
    monkeypatch.setenv(name, str(cores))
    assert not waiting.naps()
    waiting.naps.cache_clear()
    monkeypatch.setenv(name, str(cores + 1))
    assert waiting.naps()


def test_the_default_spins_even_where_ranks_outnumber_cores(monkeypatch):
    assert not waiting.naps()
    waiting.naps.cache_clear()
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "1000")
    assert not waiting.naps()
    waiting.naps.cache_clear()
    monkeypatch.setenv("MPISHARD_WAIT", "auto")
    monkeypatch.delenv("OMPI_COMM_WORLD_LOCAL_SIZE")
    assert not waiting.naps()     # auto without a launcher's count


@pytest.mark.parametrize("mode, naps", [("spin", False), ("nap", True), (" NAP ", True)])
def test_the_variable_decides(monkeypatch, mode, naps):
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "1000")
    monkeypatch.setenv("MPISHARD_WAIT", mode)
    assert waiting.naps() is naps


def test_a_bad_value_names_what_is_accepted(monkeypatch):
    monkeypatch.setenv("MPISHARD_WAIT", "sleep")
    with pytest.raises(ValueError, match="auto, spin, nap.*'sleep'"):
        waiting.naps()


class _Request:
    """Done after ``tests`` calls of Test(); counts Wait() and Test()."""

    def __init__(self, tests):
        self.left, self.tested, self.waited = tests, 0, 0

    def Test(self):
        self.tested += 1
        self.left -= 1
        return self.left <= 0

    def Wait(self):
        self.waited += 1


def test_spinning_is_mpis_wait_napping_tests_until_done(monkeypatch):
    request = _Request(5)
    waiting.wait(request)
    assert (request.waited, request.tested) == (1, 0)
    monkeypatch.setenv("MPISHARD_WAIT", "nap")
    waiting.naps.cache_clear()
    request = _Request(5)
    waiting.wait(request)
    assert (request.waited, request.tested) == (0, 5)


def test_naps_grow_to_the_bound_after_the_spin():
    assert waiting.next_nap(0.0, waiting.SPIN_S / 2) == 0.0
    nap, naps = 0.0, []
    for _ in range(30):
        nap = waiting.next_nap(nap, 2 * waiting.SPIN_S)
        naps.append(nap)
    assert naps[0] == waiting.NAP_MIN_S and naps[-1] == waiting.NAP_MAX_S
    assert naps == sorted(naps)
