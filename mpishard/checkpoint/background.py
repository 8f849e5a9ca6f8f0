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
   as in the synchronous write; rank 0 creates ``<path>.tmp-<hex>`` with
   serial h5py: every dataset contiguous, allocated early, not filled, with
   its attributes and a zero ``checksum`` attribute, and reads each dataset's
   file offset (``dset.id.get_offset()``); the offsets and the name are
   broadcast, every rank opens the file (an error, on every rank, where it
   cannot: the ranks need one shared file system, as under ``mpio``);
2. a thread per rank writes the snapshot's bytes at those offsets with
   ``os.pwrite``, checksums them and ``fsync``s the file: POSIX only, no MPI,
   no HDF5, so it cannot disturb the training's communication, at any thread
   level MPI was initialised with (mpi4py asks for ``MPI_THREAD_MULTIPLE``; the
   library assumes nothing of it);
3. the commit, in the calling thread at the next save or load, at a step
   boundary of the training loop once every rank's thread is done
   (`poll_checkpoint`), at `wait_for_checkpoint` (``CheckpointManager.wait()``)
   and at the end of ``optimize()``: on a
   duplicate of the world made for this save, every rank's thread is joined, its
   failure agreed on (a failed save is raised on every rank, the temporary file
   removed), the partial checksums added (``Allreduce``); rank 0 writes them
   into the ``checksum`` attributes (same size: in place), seals the user
   block, ``fsync``s, renames the file to its name and ``fsync``s the folder.

Why not ``mpio`` for step 1: HDF5's collectives cannot be timed
(`mpishard.comm.watchdog`), and the data is not written by HDF5 at all, so
one rank creating the metadata alone (kilobytes) needs no MPI-IO and works
with an h5py built without MPI. Why pwrite rather than HDF5 in the thread:
h5py serialises every call behind one lock, so an HDF5 write in a thread would
stall any HDF5 use of the training thread (a data set read from an HDF5 file).

Measured (``benchmarks/bench_async_checkpoint.py``, 2 ranks on a loaded 2-core
machine; the numbers are on the guide's Checkpoints page): for a 25 M-parameter
MLP the call blocks 1.2 times as long as a plain copy of the rank's state (the
rest is the file's creation and the agreements, tens of milliseconds, which
the helper thread's copy overlaps), a fifth to a quarter of the synchronous
save, and a window of 100 steps with one asynchronous checkpoint lost 7%
against 33% with a synchronous one (DDP, medians).
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
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..backend import is_device_array
from ..comm import FlatComm
from ..errors import CheckpointError
from .blocks import Block
from .collective import agree_error
from .container import seal_file, userblock_size_for
from .format import TensorRecord
from .write import (
    _ALIGN,
    _ALIGN_THRESHOLD,
    CHUNK_BYTES,
    LIBVER,
    TEMP_MARK,
    Piece,
    _checksums,
    _fsync_folder,
    _remove_quietly,
    _set_attrs,
    _with_order,
    plan_datasets,
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
        self.copies.clear()
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

    def start(self) -> None:
        """Start copying the NumPy arrays taken."""
        if self.copies:
            self.thread = threading.Thread(target=self._copy, name="mpishard-snapshot",
                                           daemon=True)
            self.thread.start()

    def _copy(self) -> None:
        try:
            for out, a in self.copies:
                np.copyto(out, a)
        except BaseException as exc:   # raised by finish
            self.error = exc

    def finish(self) -> None:
        """Wait for the copies (the caller may change the arrays afterwards)."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        self.copies.clear()
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


# --- runs: where a piece's bytes go in the file ----------------------------------

def block_runs(block: Block, shape: Sequence[int], itemsize: int) -> list[tuple[int, int]]:
    """``(byte offset in the dataset, byte length)`` of the C-order runs of
    ``block`` of a contiguous dataset of ``shape``, in the block's C order."""
    if not shape:
        return [(0, itemsize)]
    d = len(shape) - 1
    while d > 0 and block[d].start == 0 and block[d].stop == shape[d]:
        d -= 1
    inner = int(np.prod(shape[d + 1:], dtype=np.int64))
    strides = [int(np.prod(shape[j + 1:], dtype=np.int64)) for j in range(len(shape))]
    length = (block[d].stop - block[d].start) * inner * itemsize
    if length == 0:
        return []
    outer = [range(s.start, s.stop) for s in block[:d]]
    runs = []
    for index in np.ndindex(*[len(r) for r in outer]) if outer else [()]:
        at = sum((outer[j][i]) * strides[j] for j, i in enumerate(index))
        runs.append(((at + block[d].start * strides[d]) * itemsize, length))
    return runs


def _root(a: np.ndarray) -> np.ndarray:
    """The array that owns ``a``'s memory (the last ndarray of its ``base`` chain)."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def _address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


def _writes(chunks: Sequence[Piece], offsets: dict[str, int]) -> list[tuple[int, memoryview]]:
    """``(file offset, bytes)`` of every run of ``chunks``, adjacent runs merged
    where their bytes are adjacent in the same snapshot buffer too."""
    merged: list[list[Any]] = []   # [file offset, address, length, owner]
    for c in chunks:
        owner = _root(c.data)
        address = _address(c.data)
        for offset, length in block_runs(c.block, c.tensor.shape, c.data.dtype.itemsize):
            start = offsets[c.tensor.path] + offset
            last = merged[-1] if merged else None
            if (last is not None and last[3] is owner and last[0] + last[2] == start
                    and last[1] + last[2] == address):
                last[2] += length
            else:
                merged.append([start, address, length, owner])
            address += length
    out = []
    for start, address, length, owner in merged:
        raw = owner.reshape(-1).view(np.uint8)
        at = address - _address(raw)
        out.append((start, memoryview(raw[at:at + length])))
    return out


# --- the pending save ----------------------------------------------------------------

@dataclass
class _Pending:
    final: str
    tmp: str
    comm: FlatComm | None
    rank: int
    ordered: list[TensorRecord]
    extents: list[tuple[int, int]]
    userblock: int
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
                           ready: Callable[[], None] | None = None) -> str:
    """Create the file of ``tensors`` at a temporary name next to ``path`` and
    start writing this rank's ``pieces`` (host arrays nobody changes until the
    commit: a `Snapshot`'s) in a thread, once ``ready()`` (the snapshot's
    `Snapshot.finish`, called before this returns or raises) is done. Collective
    over ``comm`` (None: this process alone), under its timeout; the save runs
    on a duplicate of it.
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
        pending = _start(final, private, tensors, pieces, attrs, durable, tuple(order_groups))
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
           order_groups: tuple) -> _Pending:
    size = 1 if comm is None else comm.size
    rank = 0 if comm is None else comm.rank
    loose = next((p.tensor.path for p in pieces if not p.data.flags.c_contiguous), None)
    ordered, index = plan_datasets(
        final, comm, size, tensors, pieces,
        f"{final}: a piece of {loose} is not contiguous in memory" if loose else None)
    ub = userblock_size_for(len(ordered))
    created = None
    if rank == 0:
        created = _create_file(final, ordered, _with_order(attrs, ordered, order_groups), ub)
    created = comm.bcast(created, root=0) if size > 1 else created
    tmp, offsets, error = created
    agree_error(comm, CheckpointError(error) if error else None)
    fd, error = None, None
    try:
        fd = os.open(tmp, os.O_WRONLY)
    except OSError as exc:
        error = CheckpointError(f"{final}: rank {rank} cannot open the temporary file {tmp} "
                                f"that rank 0 created ({exc.strerror}): an asynchronous save "
                                f"needs a file system shared by the ranks")
    try:
        agree_error(comm, error)
    except BaseException:
        if fd is not None:
            os.close(fd)
        if rank == 0:
            _remove_quietly(tmp)
        raise
    chunks = list(pieces)
    writes = _writes(chunks, {t.path: offsets[i] for i, t in enumerate(ordered)})
    extents = [(offsets[i], t.size * np.dtype(t.dtype).itemsize)
               for i, t in enumerate(ordered) if t.size]
    done = threading.Event()
    pending = _Pending(final, tmp, comm, rank, list(ordered), extents, ub, durable,
                       threading.Thread(), done)
    pending.thread = threading.Thread(target=_work, args=(pending, fd, writes, chunks, index),
                                      name="mpishard-checkpoint-write", daemon=True)
    return pending


def _create_file(final: str, ordered: Sequence[TensorRecord], attrs: dict[str, dict[str, Any]],
                 ub: int) -> tuple[str | None, list[int], str | None]:
    """Rank 0: the temporary file with every dataset allocated; its name, the
    datasets' offsets, and the problem (a message) or None."""
    folder = os.path.dirname(final)
    if not os.path.isdir(folder):
        return None, [], f"{final}: folder {folder} does not exist"
    if not os.access(folder, os.W_OK | os.X_OK):
        return None, [], f"{final}: folder {folder} is not writable"
    tmp = f"{final}{TEMP_MARK}{secrets.token_hex(4)}"
    try:
        import h5py

        with h5py.File(tmp, "w", userblock_size=ub, libver=LIBVER, locking=False,
                       alignment_threshold=_ALIGN_THRESHOLD, alignment_interval=_ALIGN) as f:
            dsets = _create_early(f, ordered, attrs)
            offsets = [int(dsets[t.path].id.get_offset() or 0) if t.size else 0
                       for t in ordered]
        return tmp, offsets, None
    except Exception as exc:
        _remove_quietly(tmp)
        return None, [], f"{final}: cannot create {tmp}: {exc}"


def _create_early(f: Any, ordered: Sequence[TensorRecord],
                  attrs: dict[str, dict[str, Any]]) -> dict:
    """`write._create` with the space of every dataset allocated at once (so it
    has its offset) and a zero ``checksum`` attribute to fill in at the commit."""
    import h5py

    for g in sorted({t.group for t in ordered} | {g for g in attrs if g != "/"}):
        f.require_group(g)
    dsets = {}
    for t in ordered:
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
        dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
        d = f.create_dataset(t.path, shape=t.shape, dtype=np.dtype(t.dtype), dcpl=dcpl)
        d.attrs["checksum"] = np.zeros(2, dtype=np.uint64)
        dsets[t.path] = d
    for g in sorted(attrs):
        _set_attrs(f if g == "/" else f[g], attrs[g])
    return dsets


def _slow() -> tuple[int, float] | None:
    text = os.environ.get(SLOW_ENV, "").strip()
    if not text:
        return None
    piece, pause = text.split(",")
    return max(1, int(piece)), float(pause)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        if n <= 0:
            raise OSError(f"pwrite wrote {n} bytes at offset {offset}")
        data, offset = data[n:], offset + n


def _work(pending: _Pending, fd: int, writes: Sequence[tuple[int, memoryview]],
          chunks: Sequence[Piece], index: dict[str, int]) -> None:
    """The thread: write, checksum, fsync. No MPI, no HDF5."""
    try:
        if pending.error is not None:
            return
        slow = _slow()
        step = CHUNK_BYTES if slow is None else slow[0]
        for offset, data in writes:
            for at in range(0, len(data), step):
                _pwrite_all(fd, data[at:at + step], offset + at)
                if slow is not None:
                    time.sleep(slow[1])
        sums = _checksums(chunks, index, len(pending.ordered))
        pending.sums = np.array([s.to_array() for s in sums],
                                dtype=np.uint64).reshape(len(pending.ordered), 2)
        if pending.durable:
            os.fsync(fd)
    except BaseException as exc:   # reported at the commit, on every rank
        pending.error = CheckpointError(f"{pending.tmp}: the background write failed on rank "
                                        f"{pending.rank}: {exc}")
    finally:
        try:
            os.close(fd)
        except OSError:
            pass
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
    comm = pending.comm
    pending.thread.join()
    try:
        agree_error(comm, pending.error)
    except BaseException:
        if pending.rank == 0:
            _remove_quietly(pending.tmp)
        raise
    table = pending.sums
    if comm is not None and comm.size > 1:
        comm.Allreduce(table, slot="checkpoint-checksums")
    error = None
    if pending.rank == 0:
        try:
            _seal(pending, table)
        except Exception as exc:
            error = CheckpointError(f"{pending.final}: sealing or renaming failed: {exc}")
            _remove_quietly(pending.tmp)
    agree_error(comm, error)


def _seal(pending: _Pending, table: np.ndarray) -> None:
    """Rank 0: checksums in place, the seal, fsync, rename, fsync of the folder."""
    import h5py

    with h5py.File(pending.tmp, "r+", locking=False) as f:
        for t, row in zip(pending.ordered, table):
            f[t.path].attrs.modify("checksum", row)
    seal_file(pending.tmp, pending.userblock, pending.extents, durable=pending.durable)
    os.replace(pending.tmp, pending.final)
    if pending.durable:
        _fsync_folder(os.path.dirname(pending.final))


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
    if pending.rank == 0:
        _remove_quietly(pending.tmp)
    return pending.final


def wait_for_checkpoint() -> str | None:
    """Wait for the save in flight and commit it (see `settle`). Collective over
    the job that started it. Returns the path committed, or None."""
    return settle()
