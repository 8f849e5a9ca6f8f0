"""The asynchronous save: a snapshot in the call, the write in a thread, the commit later.

``save_checkpoint(..., asynchronous=True)`` returns once this rank has copied
its part of the training state (its share of the parameters, its part of the
optimizer state; the step, data position and schedule are attributes) into a
`Snapshot`: host buffers kept from one save to the next (pinned host memory for
CuPy arrays), so no save after the first allocates them again. The file is
then written while training goes on, and made visible by a *commit* at the next
call that may hold a collective.

Order of an asynchronous save (collective over the whole job):

1. the call: the previous pending save is committed first (`settle`); the
   snapshot is copied (CuPy arrays at once; NumPy arrays by a helper thread,
   ``np.copyto`` only, while the calling thread goes on below, joined before
   the call returns); the datasets are agreed on and their coverage checked
   as in the synchronous write (one ``allgather``); rank 0 creates
   ``<path>.tmp-<hex>`` with serial h5py: every dataset contiguous, allocated
   early, not filled, with a zero ``checksum`` attribute, and reads each
   dataset's file offset (``dset.id.get_offset()``); the offsets and the name
   are broadcast, rank 0 writes the groups' attributes (the file stays open
   until the commit), every rank opens the file (a rank that cannot fails the
   save at the commit, on every rank: the ranks need one shared file system,
   as under ``mpio``). Four collectives in all, with the agreement on the
   model and the save's duplicate of the world;
2. a thread per rank writes the snapshot's bytes at those offsets with
   ``os.pwrite``, checksums them and ``fsync``s the file: POSIX only, no MPI,
   no HDF5, so it cannot disturb the training's communication, at any thread
   level MPI was initialised with (mpi4py asks for ``MPI_THREAD_MULTIPLE``; the
   library assumes nothing of it);
3. the commit, in the calling thread at the next save or load, at a step
   boundary of the training loop once every rank's thread is done
   (`poll_checkpoint`), at `wait_for_checkpoint` (``CheckpointManager.wait()``)
   and at the end of ``optimize()``: on a
   duplicate of the world made for this save, every rank's thread is joined,
   the partial checksums and the count of failed ranks added (one
   ``Allreduce``; where it is not zero the failure is exchanged and raised on
   every rank, the temporary file removed); rank 0 writes the checksums
   into the ``checksum`` attributes (same size: in place), closes the file
   (its one metadata write), seals the user block, ``fsync``s, renames the
   file to its name and ``fsync``s the folder, and says whether it worked.

Why not ``mpio`` for step 1: HDF5's collectives cannot be timed
(`mpishard.comm.watchdog`), and the data is not written by HDF5 at all, so
one rank creating the metadata alone (kilobytes) needs no MPI-IO and works
with an h5py built without MPI. Why pwrite rather than HDF5 in the thread:
h5py serialises every call behind one lock, so an HDF5 write in a thread would
stall any HDF5 use of the training thread (a data set read from an HDF5 file).

Measured (``benchmarks/bench_async_checkpoint.py``, 2 ranks on a loaded 2-core
machine; the numbers are on the guide's Checkpoints page): for a 25 M-parameter
MLP the call blocks 1.2 to 1.8 times as long as a plain copy of the rank's
state (the rest is rank 0's layout of the file and the agreements, tens of
milliseconds; the layout ran three times as slow under ``tracemalloc`` until
the call's memory phase stopped tracing), a fifth to a tenth of the
synchronous save; the throughput lost over 100 steps with one asynchronous
checkpoint is below the machine's noise there.
Hence the choice of the simplest protocol that keeps every collective in the
calling thread: one small collective at the call and one at the commit.

The file is the synchronous save's: same format version, attributes, layout
(contiguous, 4 KiB aligned), checksums and seal, so readers, resharding and
``mpishard ckpt inspect/verify`` take it as any other. A kill at any moment
leaves at most a ``*.tmp-*`` file, which is never listed and which
``CheckpointManager`` removes; the previous checkpoint is untouched. A save
whose commit never comes (the process ends first) likewise leaves only the
temporary file.

Test hook: ``MPISHARD_ASYNC_CHECKPOINT_SLOW="<bytes>,<seconds>"`` makes the
thread write in pieces of ``<bytes>`` with a pause of ``<seconds>`` after each
(a kill test needs a write that lasts).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..backend import is_device_array
from ..comm import FlatComm
from ..errors import CheckpointError
from .format import TensorRecord
from .write import (
    LaidOut,
    Piece,
    _checksums,
    _remove_quietly,
    file_runs,
    lay_out,
    pwrite_runs,
    seal_laid_out,
)

__all__ = [
    "SLOW_ENV",
    "after_commit",
    "discard_checkpoint",
    "Snapshot",
    "pending_checkpoint",
    "poll_checkpoint",
    "settle",
    "start_background_write",
    "wait_for_checkpoint",
]

#: Test hook: ``"<bytes>,<seconds>"``, write in pieces of ``<bytes>``, pausing after each.
SLOW_ENV = "MPISHARD_ASYNC_CHECKPOINT_SLOW"


class Snapshot:
    """Host copies of arrays, in buffers kept from one save to the next.

    `take` gives the ``k``-th array of a save the ``k``-th buffer (made, or made
    again, only when its size or dtype changes): a CuPy array is copied at once
    into pinned host memory; a NumPy array is copied by `start`, in a helper
    thread (``np.copyto``, no MPI, no HDF5) while the calling thread agrees on
    and creates the file, and `finish` waits for it. Local.
    """

    def __init__(self) -> None:
        self.buffers: list[np.ndarray] = []
        self.used = 0
        self.copies: list[tuple[np.ndarray, Any]] = []
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def begin(self) -> None:
        self.used = 0
        self.copies = []
        self.error = None

    def take(self, a: Any) -> np.ndarray:
        """The buffer that holds (after `finish`) a host copy of ``a``."""
        k, self.used = self.used, self.used + 1
        device = is_device_array(a)
        if k == len(self.buffers):
            self.buffers.append(_host_buffer(a, device))
        elif self.buffers[k].shape != a.shape or self.buffers[k].dtype != a.dtype:
            self.buffers[k] = _host_buffer(a, device)
        out = self.buffers[k]
        if device:
            a.get(out=out)   # blocking: the copy is complete on return
        else:
            self.copies.append((out, a))
        return out

    def start(self, background: bool = True) -> None:
        """Start copying the NumPy arrays taken in a helper thread, or
        (``background=False``) leave them to `copy_now` or `finish`."""
        if self.copies and background:
            self.thread = threading.Thread(target=self._copy, name="mpishard-snapshot",
                                           daemon=True)
            self.thread.start()

    def _copy(self) -> None:
        try:
            for out, a in self.copies:
                np.copyto(out, a)
        except BaseException as exc:   # raised by finish
            self.error = exc
        self.copies = []

    def copy_now(self) -> None:
        """Copy, in the calling thread, what no helper thread copies (a failure
        is raised by `finish`)."""
        if self.thread is None and self.copies:
            self._copy()

    def finish(self) -> None:
        """Wait for the copies (the caller may change the arrays afterwards)."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        self.copy_now()
        self.copies = []
        if self.error is not None:
            error, self.error = self.error, None
            raise CheckpointError(f"copying the snapshot failed: {error}")


def _host_buffer(a: Any, device: bool) -> np.ndarray:
    if not device:
        return np.empty(a.shape, dtype=a.dtype)
    import cupyx

    return cupyx.empty_pinned(a.shape, dtype=a.dtype)


#: The one snapshot of this process (saves are collective and one at a time).
_SNAPSHOT = Snapshot()


def snapshot() -> Snapshot:
    """This process's `Snapshot`, ready for a new save (after `settle`)."""
    _SNAPSHOT.begin()
    return _SNAPSHOT


# --- the pending save ----------------------------------------------------------------

@dataclass
class _Pending:
    final: str
    laid: LaidOut
    comm: FlatComm | None
    rank: int
    durable: bool
    thread: threading.Thread
    done: threading.Event
    on_commit: list[Any] = field(default_factory=list)
    error: BaseException | None = None
    sums: np.ndarray | None = None


_PENDING: list[_Pending] = []


def pending_checkpoint() -> str | None:
    """The path of the save in flight on this process, or None. Local."""
    return _PENDING[0].final if _PENDING else None


def after_commit(hook: Any) -> None:
    """Run ``hook()`` (collective, in the calling thread) right after the save
    in flight is committed. Local."""
    if not _PENDING:
        raise RuntimeError("no asynchronous checkpoint is in flight")
    _PENDING[0].on_commit.append(hook)


def start_background_write(path: str | os.PathLike, comm: FlatComm | None,
                           tensors: Sequence[TensorRecord], pieces: Sequence[Piece],
                           attrs: dict[str, dict[str, Any]], *, durable: bool = True,
                           order_groups: Sequence[str] = (),
                           ready: Callable[[], None] | None = None,
                           meanwhile: Callable[[], None] | None = None) -> str:
    """Create the file of ``tensors`` at a temporary name next to ``path`` and
    start writing this rank's ``pieces`` (host arrays nobody changes until the
    commit: a `Snapshot`'s) in a thread, once ``ready()`` (the snapshot's
    `Snapshot.finish`, called before this returns or raises) is done;
    ``meanwhile()`` (`Snapshot.copy_now`) runs on ranks other than 0 while rank
    0 creates the file. Collective over ``comm`` (None: this process alone),
    under its timeout; the save runs on a duplicate of it.
    Returns the absolute path the file will have once committed.

    Raises:
        CheckpointError: on every rank, as ``write_checkpoint_file`` does for the
            datasets, the folder, the coverage, or creating and opening the file.
    """
    settle()
    final = os.path.abspath(os.fspath(path))
    size = 1 if comm is None else comm.size
    private = None
    try:
        private = comm.dup("checkpoint") if size > 1 else None
        pending = _start(final, private, tensors, pieces, attrs, durable, tuple(order_groups),
                         meanwhile)
    except BaseException:
        if private is not None:
            private.free()
        if ready is not None:
            ready()
        raise
    if ready is not None:
        try:
            ready()
        except BaseException as exc:   # this rank's snapshot is unusable: agreed at the commit
            pending.error = exc        # the thread only closes the file then
    _PENDING.append(pending)
    pending.thread.start()
    return final


def _start(final: str, comm: FlatComm | None, tensors: Sequence[TensorRecord],
           pieces: Sequence[Piece], attrs: dict[str, dict[str, Any]], durable: bool,
           order_groups: tuple, meanwhile: Callable[[], None] | None = None) -> _Pending:
    rank = 0 if comm is None else comm.rank
    loose = next((p.tensor.path for p in pieces if not p.data.flags.c_contiguous), None)
    laid = lay_out(final, comm, tensors, pieces, attrs, order_groups,
                   f"{final}: a piece of {loose} is not contiguous in memory" if loose else None,
                   meanwhile)
    chunks = list(pieces)
    pending = _Pending(final, laid, comm, rank, durable, threading.Thread(), threading.Event())
    pending.error = laid.error   # a rank that cannot open the file: agreed at the commit
    pending.thread = threading.Thread(target=_work, args=(pending, file_runs(chunks, laid), chunks),
                                      name="mpishard-checkpoint-write", daemon=True)
    return pending


def _slow() -> tuple[int, float] | None:
    text = os.environ.get(SLOW_ENV, "").strip()
    if not text:
        return None
    piece, pause = text.split(",")
    return max(1, int(piece)), float(pause)


def _work(pending: _Pending, runs: Sequence[tuple[int, memoryview]],
          chunks: Sequence[Piece]) -> None:
    """The thread: write, checksum, fsync. No MPI, no HDF5."""
    laid = pending.laid
    try:
        if pending.error is not None:
            return
        slow = _slow()
        if slow is None:
            pwrite_runs(laid.fd, runs)
        else:
            pwrite_runs(laid.fd, runs, slow[0], lambda n: time.sleep(slow[1]))
        sums = _checksums(chunks, laid.index, len(laid.ordered))
        pending.sums = np.array([s.to_array() for s in sums],
                                dtype=np.uint64).reshape(len(laid.ordered), 2)
        if pending.durable:
            os.fsync(laid.fd)
    except BaseException as exc:   # reported at the commit, on every rank
        pending.error = CheckpointError(f"{laid.tmp}: the background write failed on rank "
                                        f"{pending.rank}: {exc}")
    finally:
        laid.close_fd()
        pending.done.set()


# --- the commit ----------------------------------------------------------------------

def settle() -> str | None:
    """Commit the save in flight, if any: wait for every rank's thread, agree,
    seal and rename. Collective over the job that started it. Returns the path
    committed, or None when none was in flight.

    Raises:
        CheckpointError: the save failed on some rank (on every rank; no file
            appears under its name, the previous checkpoints are untouched).
    """
    if not _PENDING:
        return None
    pending = _PENDING.pop()
    comm = pending.comm
    try:
        if comm is not None:
            with comm.during(f"commit of the asynchronous save of {pending.final}"), \
                    comm.deadline("io"):
                _commit(pending)
        else:
            _commit(pending)
    finally:
        if comm is not None:
            comm.free()
    for hook in pending.on_commit:
        hook()
    return pending.final


def _commit(pending: _Pending) -> None:
    pending.thread.join()
    seal_laid_out(pending.comm, pending.laid, pending.error, pending.sums, pending.durable)


def poll_checkpoint() -> str | None:
    """At a step boundary: commit the save in flight if every rank's thread is
    done, else nothing. Collective over the job that started it (one small
    ``Allreduce`` while a save is in flight; nothing otherwise). Returns the
    path committed, or None."""
    if not _PENDING:
        return None
    pending = _PENDING[0]
    comm = pending.comm
    if comm is not None and comm.size > 1:
        flag = _FLAG
        flag[0] = 1 if pending.done.is_set() else 0
        comm.Allreduce(flag, slot="checkpoint-poll", op="min")
        ready = bool(flag[0])
    else:
        ready = pending.done.is_set()
    return settle() if ready else None


_FLAG = np.zeros(1, dtype=np.int64)


def discard_checkpoint() -> str | None:
    """Drop the save in flight without a commit: wait for this rank's thread,
    remove the temporary file (rank 0) and forget the save's communicator
    without freeing it (after a lost rank it may hold a dead process). Local:
    for a recovery, where no collective over the old job can be held. No file
    appears under the save's name. Returns the path that was dropped, or None."""
    if not _PENDING:
        return None
    pending = _PENDING.pop()
    pending.thread.join()
    pending.laid.close()
    if pending.rank == 0:
        _remove_quietly(pending.laid.tmp)
    return pending.final


def wait_for_checkpoint() -> str | None:
    """Wait for the save in flight and commit it (see `settle`). Collective over
    the job that started it. Returns the path committed, or None."""
    return settle()
