"""Agreeing on an error across ranks, and choosing how a file is written."""

from __future__ import annotations

import os
import sys

from ..comm import FlatComm
from ..errors import CheckpointError

__all__ = ["DRIVERS", "DRIVER_ENV", "agree_error", "resolve_driver"]

#: Environment variable that chooses the driver of ``"auto"``: ``direct``, ``mpio`` or ``serial``.
DRIVER_ENV = "MPISHARD_CHECKPOINT_DRIVER"
#: The drivers a checkpoint write takes (``"auto"``: `resolve_driver` decides).
DRIVERS = ("auto", "direct", "mpio", "serial")

# Exceptions that travel between ranks as themselves; anything else arrives as
# a CheckpointError carrying the original type's name.
_PASSED = {cls.__name__: cls for cls in (CheckpointError, FileNotFoundError, ValueError,
                                         TypeError)}
_warned: list[str] = []


def agree_error(comm: FlatComm | None, error: BaseException | None) -> None:
    """Raise on every rank of ``comm`` the error of the lowest rank that has one.

    Every rank passes its own finding (``None`` when all is well). The message is
    the failing rank's, unchanged (messages name the file; a rank-local failure
    says its rank itself); its type is kept for
    [`CheckpointError`][mpishard.errors.CheckpointError], ``FileNotFoundError``, ``ValueError`` and
    ``TypeError`` and becomes [`CheckpointError`][mpishard.errors.CheckpointError] otherwise, on
    every rank alike. ``None``: this process alone. Collective over ``comm``, under its timeout.

    (The agreement is [`FlatComm.first_finding`][mpishard.comm.FlatComm.first_finding], as under
    [`FlatComm.agree`][mpishard.comm.FlatComm.agree], which raises one type and prefixes the rank;
    the checkpoint's callers catch ``FileNotFoundError`` and its messages already name the file and
    the rank where that matters.)
    """
    if comm is None or comm.size == 1:
        if error is not None:
            raise _portable(error) from error
        return
    portable = _portable(error) if error is not None else None
    found = comm.first_finding(None if portable is None else
                               (type(portable).__name__, str(portable)))
    if found is None:
        return
    first, _, (kind, text) = found
    if comm.rank == first:
        raise portable from error
    raise _PASSED[kind](text)


def _portable(error: BaseException) -> Exception:
    if type(error).__name__ in _PASSED and type(error) is _PASSED[type(error).__name__]:
        return error  # type: ignore[return-value]
    return CheckpointError(f"{type(error).__name__}: {error}")


def resolve_driver(driver: str, size: int, rank: int = 0) -> str:
    """The driver a checkpoint write with ``driver`` uses: ``"direct"`` (rank 0
    lays the file out, every rank ``pwrite``s its bytes into it), ``"mpio"``
    (parallel HDF5) or ``"serial"`` (ranks send to rank 0, which writes).

    ``driver`` is ``"auto"``, ``"direct"``, ``"mpio"`` or ``"serial"``; with
    ``"auto"`` the environment variable `DRIVER_ENV` decides if set, else
    ``"direct"`` (it needs no MPI-IO: any h5py, one shared file system). An HDF5
    driver for one process is ``"serial"`` (no MPI-IO needed). Being forced
    through rank 0 prints one line on stderr once. Local.

    Raises:
        ValueError: an unknown driver, or ``"mpio"`` with an h5py built without MPI.
    """
    chosen = driver
    if driver == "auto":
        chosen = os.environ.get(DRIVER_ENV, "").strip().lower() or "auto"
    if driver not in DRIVERS or chosen not in DRIVERS:
        source = DRIVER_ENV if driver == "auto" and driver in DRIVERS else "driver"
        raise ValueError(f"{source} must be one of {', '.join(map(repr, DRIVERS))}, "
                         f"got {chosen!r}")
    if chosen in ("auto", "direct"):
        return "direct"
    import h5py

    if chosen == "mpio" and not h5py.get_config().mpi:
        raise ValueError("driver 'mpio' needs h5py built with MPI; this h5py has no MPI support")
    if size == 1:
        return "serial"
    if chosen == "serial":
        _warn_once(f"checkpoints are written through rank 0 ({DRIVER_ENV} or "
                   f"driver='serial')", rank)
    return chosen


def _warn_once(text: str, rank: int) -> None:
    """One line on stderr, from rank 0 of the writing communicator, once per process."""
    if text in _warned:
        return
    _warned.append(text)
    if rank == 0:
        sys.stderr.write(f"mpishard: warning: {text}\n")
        sys.stderr.flush()
