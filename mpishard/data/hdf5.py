"""``HDF5Dataset``: training samples in an HDF5 file, each rank reading only its rows.

Scientific data usually lives in HDF5 files far larger than one process's share
of them. This dataset never loads a whole dataset: opening reads only the
metadata, and each step's ``gather`` reads exactly the rows of the global batch
that this data-parallel rank trains on (a sorted, duplicate-free selection, one
read per dataset). Over an epoch a rank of ``N`` therefore reads ``1/N`` of the
samples, and the ranks together read each sample once. With h5py built
against parallel HDF5 the file is opened with the ``mpio`` driver over the
given communicator (reads are independent: ranks need different rows at
different moments); otherwise every rank opens it with the default driver.

The ranks that open the file are named explicitly (``comm=``: the
[`ShardingConfiguration`][mpishard.config.ShardingConfiguration] the data trains under, one of its
groups, or an mpi4py communicator): in a job whose other ranks do other work (a
simulation), a collective open over ``MPI.COMM_WORLD`` would wait for ranks that
never come. Only a job of one process may leave it out. The dataset works on
its own duplicate of those ranks' communicator (freed by ``close``). With a
configuration the collective open and close wait under its file-I/O deadline
(``io_timeout=``, [`mpishard.comm.deadlines`][mpishard.comm.deadlines]). A dataset still open when
the process exits is closed then (collectively, in the order the datasets were
opened, before MPI ends), so a forgotten [`close`][mpishard.data.hdf5.HDF5Dataset.close] costs no
error at exit, even after the configuration was freed.

Inputs and targets:

* ``inputs="/group/x", targets="/group/y"``: sample ``i`` is ``(x[i], y[i])``.
* ``targets=None``: one dataset read as a time series, sample ``i`` is
  ``(u[i], u[i + 1])``: learn the map from one row (a state, a snapshot) to
  the next, the surrogate of a time stepper. ``len`` is then ``rows - 1``.

A row may be a scalar (1-D dataset, one feature) or a vector (2-D dataset).
"""

from __future__ import annotations

import atexit
import os
import weakref
from typing import Any

import numpy as np

from ..comm import FlatComm, from_comm, hdf5_deadline
from ..config import ShardingConfiguration
from .transfer import RowMover

__all__ = ["HDF5Dataset", "parse_data_spec"]


def parse_data_spec(spec: str) -> tuple[str, str]:
    """``"file.h5:/group/dataset"`` -> ``("file.h5", "/group/dataset")``.

    Raises:
        ValueError: no ``:/`` between the file and the dataset.
    """
    path, sep, name = str(spec).rpartition(":")
    if not sep or not path or not name.startswith("/"):
        raise ValueError(f"expecting FILE.h5:/group/dataset, got {spec!r}")
    return path, name


class HDF5Dataset:
    """Samples from datasets of an HDF5 file, read by rows on demand.

    Args:
        path: the HDF5 file.
        inputs: path of the inputs dataset in the file (``/group/x``).
        targets: path of the targets dataset, or None for the next-row rule
            (see the module docstring).
        comm: the ranks that open the file together: the
            [`ShardingConfiguration`][mpishard.config.ShardingConfiguration] training uses (its
            ranks, ``config.world``; its file-I/O deadline then covers opening and
            closing), one of its groups, or an mpi4py communicator (untimed).
            Required unless the job is one process.
        driver: ``"auto"`` (``mpio`` when h5py has MPI and ``comm`` has more
            than one rank), ``"mpio"`` or ``"serial"``.

    Opening and [`close`][mpishard.data.hdf5.HDF5Dataset.close] are collective over ``comm``;
    [`gather`][mpishard.data.hdf5.HDF5Dataset.gather] and
    [`read`][mpishard.data.hdf5.HDF5Dataset.read] are not (each rank reads its own rows).
    ``rows_read`` counts the rows this rank has read from each dataset.

    Raises (on every rank, whichever rank found the problem):
        TypeError: no ``comm`` in a job of several processes (on each rank).
        FileNotFoundError: no file at ``path``.
        ValueError: not an HDF5 file, no such dataset (the message lists those
            there are), datasets of more than 2 dimensions or of a non-numeric
            type, inputs and targets with different numbers of rows.
    """

    def __init__(self, path: str | os.PathLike, inputs: str, targets: str | None = None, *,
                 comm: Any = None, driver: str = "auto") -> None:
        self._file = None
        self.comm: FlatComm | None = None
        group = _ranks(comm)
        self.path = os.fspath(path)
        if driver not in ("auto", "mpio", "serial"):
            raise ValueError(f"driver must be 'auto', 'mpio' or 'serial', got {driver!r}")
        # Every wait of opening is one for the file (its checks read it on every
        # rank): under the file-I/O deadline, a late rank named with it. The
        # dataset's own duplicate of the group: its calls never meet the caller's,
        # and it outlives the group (a configuration freed before the exit).
        opening = f"HDF5Dataset({self.path})"
        with group.deadline("io"), group.during(opening):
            self.comm = group.dup(context=False)
        try:
            with self.comm.deadline("io"), self.comm.during(opening):
                self._open(inputs, targets, driver)
        except BaseException:
            self.close()                      # the file, if open, and the duplicate
            raise
        self.inputs, self.targets = inputs, targets
        assert self._file is not None
        self._x = self._file[inputs]
        self._y = self._file[targets] if targets is not None else None
        self._next_row = targets is None
        self.rows_read = {"inputs": 0, "targets": 0}
        self._mover = RowMover()

    def _open(self, inputs: str, targets: str | None, driver: str) -> None:
        """Check the file and open it; collective over ``comm``."""
        import h5py

        comm = self.comm
        assert comm is not None
        missing = None if os.path.isfile(self.path) else f"{self.path}: no such file"
        comm.agree(missing, FileNotFoundError)
        comm.agree(None if h5py.is_hdf5(self.path) else f"{self.path}: not an HDF5 file",
                   ValueError)
        if driver == "auto":
            driver = "mpio" if h5py.get_config().mpi and comm.size > 1 else "serial"
        self.driver = driver
        if driver == "mpio":
            # HDF5's collective open cannot be timed by FlatComm: enter it once
            # every rank has arrived, under a deadline (as checkpoints do). h5py
            # gets the raw communicator, the one handoff that is allowed.
            with hdf5_deadline(comm, "HDF5 File open (mpio)"):
                self._file = h5py.File(self.path, "r", driver="mpio", comm=comm.comm)
        else:
            self._file = h5py.File(self.path, "r")
        _OPEN.append(weakref.ref(self))
        comm.agree(self._check(inputs, targets), ValueError)

    def _check(self, inputs: str, targets: str | None) -> str | None:
        import h5py

        names: list[str] = []
        self._file.visititems(lambda n, o: names.append("/" + n)
                              if isinstance(o, h5py.Dataset) else None)
        rows = []
        for role, name in (("inputs", inputs), ("targets", targets)):
            if name is None:
                continue
            obj = self._file.get(name)
            if not isinstance(obj, h5py.Dataset):
                return (f"{self.path}: no dataset {name} for the {role}; the file has "
                        f"{', '.join(names) or 'no datasets'}")
            if obj.ndim not in (1, 2):
                return (f"{self.path}:{name}: expecting 1-D or 2-D data (samples, features), "
                        f"got shape {obj.shape}")
            if obj.dtype.kind not in "fiu":
                return f"{self.path}:{name}: expecting numbers, got dtype {obj.dtype}"
            rows.append(obj.shape[0])
        if len(rows) == 2 and rows[0] != rows[1]:
            return (f"{self.path}: inputs {inputs} have {rows[0]} rows but targets "
                    f"{targets} have {rows[1]}")
        if targets is None and rows[0] < 2:
            return f"{self.path}:{inputs}: a time series needs at least 2 rows, got {rows[0]}"
        return None

    # -- the Dataset protocol (mpishard.protocols.Dataset) ------------------------
    def __len__(self) -> int:
        n = self._x.shape[0]
        return n - 1 if self._next_row else n

    @property
    def input_shape(self) -> tuple[int, ...]:
        """The shape of one sample's input (a scalar row reads as one feature)."""
        return self._x.shape[1:] or (1,)

    @property
    def target_shape(self) -> tuple[int, ...]:
        src = self._x if self._next_row else self._y
        return src.shape[1:] or (1,)

    @property
    def input_dtype(self) -> np.dtype:
        """The inputs' dtype in the file."""
        return self._x.dtype

    @property
    def target_dtype(self) -> np.dtype:
        return (self._x if self._next_row else self._y).dtype

    def buffers(self, rows: int, xp: Any = np, float_dtype: Any = None) -> tuple[Any, Any]:
        """Buffers for ``rows`` samples; floating data in ``float_dtype`` when given."""
        def dtype(d: np.dtype) -> Any:
            return float_dtype if d.kind == "f" and float_dtype is not None else d

        return (xp.empty((rows,) + self.input_shape, dtype=dtype(self._x.dtype)),
                xp.empty((rows,) + self.target_shape, dtype=dtype(self.target_dtype)))

    def gather(self, indices: np.ndarray, x_out: Any, y_out: Any) -> None:
        """Read samples ``indices`` into ``x_out`` and ``y_out``. Not collective.

        HDF5 selections must be increasing: the rows are read sorted and
        without duplicates, then put back in the order asked for. (This
        allocates a few index arrays a step: reading from a file costs far
        more, and the order changes every step.)
        """
        idx = np.asarray(indices, dtype=np.int64)
        if self._next_row:
            want = np.union1d(idx, idx + 1)
            block = self._rows(self._x, want, "inputs")
            x = block[np.searchsorted(want, idx)]
            y = block[np.searchsorted(want, idx + 1)]
        else:
            want, inverse = np.unique(idx, return_inverse=True)
            x = self._rows(self._x, want, "inputs")[inverse]
            y = self._rows(self._y, want, "targets")[inverse]
        # Into a device buffer through pinned memory: one copy up each.
        self._mover.put(x, x_out, key="x")
        self._mover.put(y, y_out, key="y")

    def read(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Samples ``[start, stop)`` as new arrays (e.g. a validation set). Not collective."""
        idx = np.arange(start, stop, dtype=np.int64)
        x = np.empty((len(idx),) + self.input_shape, dtype=self._x.dtype)
        y = np.empty((len(idx),) + self.target_shape, dtype=self.target_dtype)
        if len(idx):
            self.gather(idx, x, y)
        return x, y

    def _rows(self, dset: Any, sorted_unique: np.ndarray, role: str) -> np.ndarray:
        self.rows_read[role] += len(sorted_unique)
        data = dset[sorted_unique]
        return data.reshape(len(sorted_unique), -1) if data.ndim == 1 else data

    def close(self) -> None:
        """Close the file. Collective over ``comm``."""
        if self._file is not None:
            file, self._file = self._file, None
            if self.driver == "mpio":
                assert self.comm is not None
                with hdf5_deadline(self.comm, "HDF5 File close (mpio)"):
                    file.close()
            else:
                file.close()
        if self.comm is not None:
            comm, self.comm = self.comm, None
            comm.free()

    def __enter__(self) -> HDF5Dataset:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        targets = self.targets or "next row"
        return (f"HDF5Dataset({self.path!r}, inputs={self.inputs!r}, targets={targets!r}, "
                f"samples={len(self)}, driver={self.driver!r})")



def _ranks(comm: Any) -> FlatComm:
    """The group that opens the file: ``comm`` as a [`FlatComm`][mpishard.comm.FlatComm] (a
    configuration's ``world``). Local.

    Raises:
        TypeError: ``comm`` is None in a job of more than one process.
    """
    if isinstance(comm, ShardingConfiguration):
        return comm.world
    if comm is None:
        world = from_comm(None, "MPI.COMM_WORLD")
        if world.size > 1:
            raise TypeError(
                f"HDF5Dataset opens its file collectively: pass comm= the ranks that train "
                f"(the ShardingConfiguration, or a communicator); MPI.COMM_WORLD, of "
                f"{world.size} processes here, is not assumed")
        return world
    return from_comm(comm, "data")


#: The datasets opened by this process, in order, to close at exit those still open.
_OPEN: list[weakref.ref] = []


@atexit.register
def _close_at_exit() -> None:
    """Close the datasets left open, in the order they were opened (the same on
    every rank: the closes of ``mpio`` files pair up). Python's ``atexit``
    handlers run before mpi4py ends MPI, so the collective close still can."""
    while _OPEN:
        dataset = _OPEN.pop(0)()
        if dataset is not None:
            dataset.close()
