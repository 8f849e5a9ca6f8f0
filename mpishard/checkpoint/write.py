"""Writing logical tensors from many ranks into one sealed HDF5 file, atomically.

The unit every strategy speaks is a `Piece`: a hyperslab (block) of one
logical tensor that this rank holds and is the designated writer of. Replicated
data must be given by exactly one rank (the coverage check below catches a
gap or an overlap). A data-parallel rank gives its share of the flat vectors
(`mpishard.checkpoint.state`); a tensor-parallel rank will give its
slice of a split weight; a pipeline stage only its layers' tensors. Every rank
declares the tensors it knows (each a
[`TensorRecord`][mpishard.checkpoint.TensorRecord]); the union, in one order
agreed by all, is what the file holds, because HDF5 creates datasets collectively.

Order of a save (collective over ``comm``), by driver:

``direct`` (what ``"auto"`` chooses; `lay_out`, `file_runs`, `pwrite_runs`,
`seal_laid_out`, shared with the asynchronous save of
`mpishard.checkpoint.background`):

1. agree on the datasets and check that the pieces cover each dataset
   exactly once: one ``allgather`` of every rank's declarations, the elements
   its pieces give each dataset and its own problem, from which every rank
   finds the same answer (`plan_datasets`);
2. rank 0 alone creates ``<path>.tmp-<random>`` with serial h5py: every
   dataset contiguous, 4 KiB aligned, allocated but not filled (the file is
   sparse until written), a zero ``checksum`` attribute on each; it broadcasts
   the name and every dataset's file offset, then writes the groups'
   attributes while the others go on (keeping the file open until the seal),
   and every rank opens the file (a failure there is agreed on at the seal);
3. each rank writes its pieces' bytes at those offsets with ``os.pwrite``
   (16 MiB calls, each after a run's first starting on a 4 KiB page of the
   file; a flat vector's share is one run per tensor, merged across tensors
   where they are adjacent in the file and in memory; a replicated vector's
   shares end on pages, so no two ranks write one page of a large dataset),
   while a helper thread checksums them, then ``fsync``s (but rank 0, whose
   seal's ``fsync`` covers the file); no MPI-IO, no HDF5 in the data path;
4. one ``Allreduce`` adds the partial checksums and counts the ranks that
   failed (the failure is exchanged only when one did); rank 0 puts the
   checksums in place (same size: the file's layout does not move) and
   closes the file (its one metadata write), seals the user block, fsyncs,
   renames to ``path`` and fsyncs the folder; one agreement on that outcome.
   Six collectives with the agreement on the model and the duplicate of the
   communicator.

Why: the writes are the same system calls as file-per-process POSIX writes of
the same bytes, into one file; HDF5 only ever handles the metadata, on one
rank. Measured against file-per-process and ``numpy.save`` in
``benchmarks/bench_checkpoint_write.py`` (the guide's Checkpoints page).

``mpio`` (parallel HDF5) and ``serial`` (through rank 0, for ranks without a
shared file system to write into):

1. as above;
2. rank 0 picks a temporary name ``<path>.tmp-<random>`` next to ``path``;
3. ``mpio``: all ranks create the file and every dataset with the same
   arguments in the same order, then write their pieces with independent
   I/O. ``serial``: ranks send their pieces to rank 0
   (buffer messages, double-buffered), which writes them;
4. meanwhile a helper thread checksums the rank's pieces (HDF5 releases the
   GIL during I/O); one ``Allreduce`` adds the partial checksums;
5. checksums and attributes are written, the file is closed by all;
6. rank 0 seals the user block, fsyncs, renames to ``path`` and fsyncs the
   folder. A rank that dies before this leaves only the temporary file behind.

All three write the same file: datasets, attributes, checksums and seal
(``tests/mpi/test_checkpoint_direct.py``).

Every message between the ranks goes through a
[`FlatComm`][mpishard.comm.FlatComm] under its timeout, so a rank that does not
take part is named with the call and the group; HDF5's own collectives (step 3,
``mpio``) are entered behind a timed barrier and under a deadline
([`hdf5_deadline`][mpishard.comm.hdf5_deadline]).
"""

from __future__ import annotations

import io
import json
import os
import secrets
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..comm import FlatComm, hdf5_deadline
from ..errors import CheckpointError
from .blocks import Block, block_shape, block_size, split_block
from .checksum import Checksum, block_checksum
from .collective import DRIVERS, agree_error, resolve_driver
from .container import seal_file, seal_image, userblock_size_for
from .format import TensorRecord, check_tensor_name

__all__ = [
    "CHUNK_BYTES",
    "DRIVERS",
    "LaidOut",
    "Piece",
    "TEMP_MARK",
    "aligned_chunks",
    "block_runs",
    "choose_driver",
    "file_runs",
    "lay_out",
    "plan_datasets",
    "pwrite_runs",
    "seal_laid_out",
    "write_checkpoint_file",
    "write_image",
]

#: Pieces are written, sent and checksummed in chunks of at most this many bytes.
CHUNK_BYTES = 16 << 20
#: Temporary files are ``<final name>.tmp-<hex>``.
TEMP_MARK = ".tmp-"
#: HDF5 file format bounds: 1.8 object headers (dense attributes for long JSON),
#: nothing newer than 1.10 readers understand.
LIBVER = ("v108", "v110")
_ALIGN_THRESHOLD = 64 << 10   # datasets of 64 KiB and more start on a 4 KiB boundary
_ALIGN = 4096
_TAG = 7301


@dataclass(frozen=True)
class Piece:
    """``data`` (a host array of the block's shape) is ``tensor[block]``."""

    tensor: TensorRecord
    block: Block
    data: np.ndarray


def _split(piece: Piece, max_bytes: int) -> list[Piece]:
    itemsize = np.dtype(piece.tensor.dtype).itemsize
    parts = split_block(piece.block, max(1, max_bytes // itemsize))
    if len(parts) == 1:
        return [piece]
    out = []
    for part in parts:
        local = tuple(slice(p.start - b.start, p.stop - b.start) for p, b in zip(part, piece.block))
        out.append(Piece(piece.tensor, part, piece.data[local]))
    return out


def _piece_problem(p: Piece) -> str | None:
    t = p.tensor
    if len(p.block) != len(t.shape) or any(
            not (0 <= s.start <= s.stop <= n) for s, n in zip(p.block, t.shape)):
        return f"a piece of {t.path} lies outside its shape {t.shape}: {p.block}"
    if tuple(p.data.shape) != block_shape(p.block):
        return f"a piece of {t.path} holds shape {p.data.shape}, its block {block_shape(p.block)}"
    if np.dtype(p.data.dtype).newbyteorder("<").str != t.dtype:
        return f"a piece of {t.path} holds {p.data.dtype}, the tensor is {np.dtype(t.dtype).name}"
    if not isinstance(p.data, np.ndarray):
        return f"a piece of {t.path} is not a host (NumPy) array"
    return None


def _union(every: Sequence[Sequence[tuple]]) -> tuple[list[TensorRecord], str | None]:
    """The datasets all ranks declared, in an order every rank computes alike:
    groups in order of first appearance (rank 0 first), then by key and name."""
    groups: dict[str, int] = {}
    found: dict[str, TensorRecord] = {}
    for rank, decls in enumerate(every):
        for group, name, shape, dtype, key in decls:
            t = TensorRecord(group, name, tuple(shape), dtype, key)
            groups.setdefault(group, len(groups))
            old = found.setdefault(t.path, t)
            if old != t:
                return [], (f"ranks disagree on tensor {t.path}: {old.shape} {old.dtype} "
                            f"key {old.key} against {t.shape} {t.dtype} key {t.key} (rank {rank})")
    ordered = sorted(found.values(), key=lambda t: (groups[t.group], t.key, t.name))
    return ordered, None


def _checksums(pieces: Sequence[Piece], index: dict[str, int], count: int) -> list[Checksum]:
    sums = [Checksum()] * count
    for p in pieces:
        i = index[p.tensor.path]
        sums[i] = sums[i] + block_checksum(p.data, p.block, p.tensor.shape)
    return sums


def _set_attrs(obj: Any, attrs: dict[str, Any]) -> None:
    for key in sorted(attrs):
        obj.attrs[key] = attrs[key]


def _plan(final: str, tensors: Sequence[TensorRecord], pieces: Sequence[Piece],
          every: Sequence[Sequence[tuple]],
          ) -> tuple[list[TensorRecord], dict[str, int], str | None]:
    """The agreed datasets, their index, and this rank's problem with its pieces."""
    ordered, problem = _union(every)
    index = {t.path: i for i, t in enumerate(ordered)}
    if problem is None:
        problem = next(filter(None, (check_tensor_name(t.name) for t in ordered)), None)
    for p in pieces:
        if problem is None and p.tensor.path not in index:
            problem = f"a piece of {p.tensor.path}, which no rank declared"
        problem = problem or _piece_problem(p)
    return ordered, index, f"{final}: {problem}" if problem else None


def _with_order(attrs: dict[str, dict[str, Any]], ordered: Sequence[TensorRecord],
                groups: Sequence[str]) -> dict[str, dict[str, Any]]:
    out = {g: dict(a) for g, a in attrs.items()}
    for g in groups:
        out.setdefault(g, {})["order"] = json.dumps([t.name for t in ordered if t.group == g])
    return out


def _declarations(tensors: Sequence[TensorRecord]) -> list[tuple]:
    return [(t.group, t.name, tuple(t.shape), t.dtype, t.key) for t in tensors]


def write_image(tensors: Sequence[TensorRecord], pieces: Sequence[Piece],
                attrs: dict[str, dict[str, Any]], name: str = "<bytes>",
                order_groups: Sequence[str] = ()) -> bytes:
    """The sealed checkpoint file of `write_checkpoint_file`, built in memory
    by this process alone (``pieces`` must cover every tensor).

    Raises:
        CheckpointError: a name that cannot be stored, pieces that do not cover
            the tensors exactly once.
    """
    import h5py

    ordered, index, problem = _plan(name, tensors, pieces, [_declarations(tensors)])
    if problem:
        raise CheckpointError(problem)
    counts = [0] * len(ordered)
    for p in pieces:
        counts[index[p.tensor.path]] += block_size(p.block)
    bad = [t.path for t, c in zip(ordered, counts) if c != t.size]
    if bad:
        raise CheckpointError(f"{name}: the pieces do not cover {bad[:3]} exactly once")
    attrs = _with_order(attrs, ordered, order_groups)
    ub = userblock_size_for(len(ordered))
    buffer = io.BytesIO()
    with h5py.File(buffer, "w", userblock_size=ub, libver=LIBVER,
                   alignment_threshold=_ALIGN_THRESHOLD, alignment_interval=_ALIGN) as f:
        dsets = _create(f, ordered, attrs)
        for p in pieces:
            _write_block(dsets[p.tensor.path], p.block, p.data)
        table = np.array([c.to_array() for c in _checksums(pieces, index, len(ordered))],
                         dtype=np.uint64).reshape(len(ordered), 2)
        extents = _annotate(ordered, dsets, table)
    image = bytearray(buffer.getbuffer())
    seal_image(image, ub, extents)
    return bytes(image)


def write_checkpoint_file(path: str | os.PathLike, comm: FlatComm | None,
                          tensors: Sequence[TensorRecord],
                          pieces: Sequence[Piece], attrs: dict[str, dict[str, Any]], *,
                          driver: str = "auto", durable: bool = True,
                          order_groups: Sequence[str] = ()) -> str:
    """Write a sealed checkpoint file at ``path``, atomically. Collective over ``comm``
    (``None``: this process alone), under its timeout: the write runs on a
    duplicate of ``comm`` named "checkpoint", so its messages never meet the
    caller's, and HDF5's own collectives are entered only once every rank has
    arrived, with a deadline ([`hdf5_deadline`][mpishard.comm.hdf5_deadline]).

    ``driver``: ``"auto"`` (``"direct"`` unless `DRIVER_ENV` names another),
    ``"direct"``, ``"mpio"`` or ``"serial"`` (`choose_driver`; the module's
    docstring says what each does). ``tensors`` are the datasets this rank
    knows of, ``pieces`` what it writes;
    ``attrs`` maps a group (``"/"``, ``"params"``, ``"optimizer"``, ...) to its
    attributes, taken from rank 0. Each group of ``order_groups`` gets an attribute
    ``order``: the JSON list of its tensor names in the agreed order (which only
    all ranks together know, when pipeline stages hold different tensors).
    Returns the absolute path written.

    Raises:
        CheckpointError: on every rank, when the ranks disagree on the datasets,
            the pieces leave a gap or overlap, the folder is missing or not
            writable, or writing fails on any rank (the temporary file is removed
            and no file appears at ``path``).
        ValueError: an unknown ``driver``.
    """
    final = os.path.abspath(os.fspath(path))
    size = 1 if comm is None else comm.size
    rank = 0 if comm is None else comm.rank
    mode = choose_driver(driver, size, rank)
    # Our tags never meet the caller's (Idup: under the timeout).
    private = comm.dup("checkpoint") if size > 1 else None
    try:
        if mode == "direct":
            return _write_direct(final, private, tensors, pieces, attrs, durable,
                                 tuple(order_groups))
        return _write(final, private, rank, size, mode, tensors, pieces, attrs, durable,
                      tuple(order_groups))
    finally:
        if private is not None:
            private.free()


def choose_driver(driver: str, size: int, rank: int = 0) -> str:
    """The driver a write with ``driver`` uses: ``"direct"``, ``"mpio"`` or
    ``"serial"`` ([`resolve_driver`][mpishard.checkpoint.collective.resolve_driver],
    the one answer). Local.

    Raises:
        ValueError: an unknown driver, or ``"mpio"`` with an h5py built without MPI.
    """
    return resolve_driver(driver, size, rank)


def plan_datasets(final: str, comm: FlatComm | None, size: int,
                  tensors: Sequence[TensorRecord], pieces: Sequence[Piece],
                  local_problem: str | None = None) -> tuple[list[TensorRecord], dict]:
    """The file's datasets in order and their index by path, once every rank's
    declarations agree and the pieces cover each dataset exactly once (a
    ``CheckpointError`` on every rank otherwise, ``local_problem`` included).
    Collective over ``comm``: one ``allgather`` of every rank's declarations,
    the elements its pieces give each dataset and its own problem, from which
    every rank finds the same answer (no agreement after it)."""
    mine = (_declarations(tensors), _given(pieces), _own_problem(pieces, local_problem))
    every = comm.allgather(mine) if size > 1 else [mine]
    ordered, problem = _union([decls for decls, _, _ in every])
    index = {t.path: i for i, t in enumerate(ordered)}
    if problem is None:
        problem = next(filter(None, (check_tensor_name(t.name) for t in ordered)), None)
    for _, given, own in every:   # the lowest rank's problem, as agree_error
        if problem is not None:
            break
        undeclared = next((path for path in given if path not in index), None)
        problem = f"a piece of {undeclared}, which no rank declared" if undeclared else own
    if problem is not None:
        raise CheckpointError(problem if problem.startswith(final) else f"{final}: {problem}")
    counts = [0] * len(ordered)
    for _, given, _ in every:
        for path, n in given.items():
            counts[index[path]] += n
    bad = [(t.path, int(c), t.size) for t, c in zip(ordered, counts) if c != t.size]
    if bad:   # the same on every rank
        what = ", ".join(f"{p} ({c} of {n} elements)" for p, c, n in bad[:3])
        raise CheckpointError(f"{final}: the pieces do not cover each dataset exactly once: "
                              f"{what}{' ...' if len(bad) > 3 else ''}")
    return ordered, index


def _given(pieces: Sequence[Piece]) -> dict[str, int]:
    """The elements ``pieces`` give each dataset, by path (in order of first piece)."""
    given: dict[str, int] = {}
    for p in pieces:
        given[p.tensor.path] = given.get(p.tensor.path, 0) + block_size(p.block)
    return given


def _own_problem(pieces: Sequence[Piece], local_problem: str | None) -> str | None:
    """The first problem of this rank's pieces that needs no other rank, or
    ``local_problem``."""
    return next(filter(None, map(_piece_problem, pieces)), None) or local_problem


def _write(final: str, comm: FlatComm | None, rank: int, size: int, mode: str,
           tensors: Sequence[TensorRecord], pieces: Sequence[Piece],
           attrs: dict[str, dict[str, Any]], durable: bool, order_groups: tuple) -> str:
    # 1. the datasets, and whether the pieces fit them
    ordered, index = plan_datasets(final, comm, size, tensors, pieces)
    chunks = [c for p in pieces for c in _split(p, CHUNK_BYTES)]

    # 2. a temporary name, from rank 0, in a folder that exists
    tmp, error = None, None
    if rank == 0:
        folder = os.path.dirname(final)
        if not os.path.isdir(folder):
            error = CheckpointError(f"{final}: folder {folder} does not exist")
        elif not os.access(folder, os.W_OK | os.X_OK):
            error = CheckpointError(f"{final}: folder {folder} is not writable")
        tmp = f"{final}{TEMP_MARK}{secrets.token_hex(4)}"
    agree_error(comm, error)
    if size > 1:
        tmp = comm.bcast(tmp, root=0)
        attrs = comm.bcast(attrs if rank == 0 else None, root=0)
    attrs = _with_order(attrs, ordered, order_groups)

    # 3-5. create, write, checksum, close
    ub = userblock_size_for(len(ordered))
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mpishard-checksum")
    try:
        sums = pool.submit(_checksums, chunks, index, len(ordered))
        if mode == "mpio":
            extents, error = _write_mpio(tmp, comm, ub, ordered, chunks, attrs, sums, durable)
        else:
            extents, error = _write_serial(tmp, comm, rank, size, ub, ordered, chunks, attrs,
                                           sums, durable)
    finally:
        pool.shutdown(wait=True)

    # 6. seal, rename
    if error is None and rank == 0:
        try:
            seal_file(tmp, ub, extents, durable=durable)
            os.replace(tmp, final)
            if durable:
                _fsync_folder(os.path.dirname(final))
        except Exception as exc:   # OSError mostly; never let rank 0 fail alone
            error = CheckpointError(f"{final}: sealing or renaming failed: {exc}")
    if error is not None and rank == 0:
        _remove_quietly(tmp)
    agree_error(comm, error)
    return final


def _combined(comm: FlatComm | None, sums: Any, count: int) -> np.ndarray:
    """The rank's partial checksums added over ``comm``: ``(count, 2)`` uint64."""
    table = np.array([s.to_array() for s in sums.result()], dtype=np.uint64).reshape(count, 2)
    if comm is not None and comm.size > 1:
        # MPI_SUM on unsigned 64-bit integers wraps modulo 2**64, as the checksum does.
        comm.Allreduce(table, slot="checkpoint-checksums")
    return table


def _create(f: Any, ordered: Sequence[TensorRecord], attrs: dict[str, dict[str, Any]]) -> dict:
    """Groups, datasets and attributes, in one order (collective under mpio)."""
    groups = sorted({t.group for t in ordered} | {g for g in attrs if g != "/"})
    for g in groups:
        f.require_group(g)
    dsets = {}
    for t in ordered:
        # No fill: every element is written by some rank, and filling would
        # write the whole file twice.
        dsets[t.path] = f.create_dataset(t.path, shape=t.shape, dtype=np.dtype(t.dtype),
                                         fill_time="never")
    for g in sorted(attrs):
        _set_attrs(f if g == "/" else f[g], attrs[g])
    return dsets


def _annotate(ordered: Sequence[TensorRecord], dsets: dict,
              table: np.ndarray) -> list[tuple[int, int]]:
    """Write the checksum attributes; return the raw-data extents (for the seal).
    Collective under ``mpio`` (every rank writes the same attributes)."""
    extents = []
    for t, row in zip(ordered, table):
        d = dsets[t.path]
        d.attrs["checksum"] = row
        if t.size:
            extents.append((int(d.id.get_offset()), int(d.id.get_storage_size())))
    return extents


def _write_block(d: Any, block: Block, data: np.ndarray) -> None:
    d.write_direct(np.ascontiguousarray(data), dest_sel=block if block else None)


def _write_mpio(tmp: str, comm: FlatComm, ub: int, ordered: Sequence[TensorRecord],
                chunks: Sequence[Piece], attrs: dict, sums: Any, durable: bool):
    import h5py

    error = None
    # HDF5's collectives cannot be timed by FlatComm (h5py holds the GIL inside
    # them): each is entered after a timed barrier, under a deadline. The data
    # writes between them are independent I/O, as long as the data is, so no
    # deadline covers those; the Allreduce after them is timed.
    with hdf5_deadline(comm, "HDF5 File create (mpio)"):
        try:
            # The mpio driver needs the raw MPI communicator: the one handoff
            # of FlatComm.comm that the library allows (h5py's collectives are
            # HDF5's own; see hdf5_deadline).
            f = h5py.File(tmp, "w", driver="mpio", comm=comm.comm, userblock_size=ub,
                          libver=LIBVER, alignment_threshold=_ALIGN_THRESHOLD,
                          alignment_interval=_ALIGN)
        except Exception as exc:
            error = CheckpointError(f"{tmp}: cannot create on rank {comm.rank}: {exc}")
    agree_error(comm, error)
    extents: list[tuple[int, int]] = []
    writeback = _Writeback(tmp, durable)
    closed = False
    try:
        # Every rank completed the agreement just above: no barrier needed.
        with hdf5_deadline(comm, "HDF5 dataset create (mpio)", synchronize=False):
            dsets = _create(f, ordered, attrs)
        for c in chunks:   # independent I/O: no rank waits for another here
            if error is None:
                try:
                    _write_block(dsets[c.tensor.path], c.block, c.data)
                    writeback.wrote(c.data.nbytes)
                except Exception as exc:
                    error = CheckpointError(f"{tmp}: writing {c.tensor.path} failed on rank "
                                            f"{comm.rank}: {exc}")
        table = _combined(comm, sums, len(ordered))
        with hdf5_deadline(comm, "HDF5 File close (mpio)", synchronize=False):
            extents = _annotate(ordered, dsets, table)
            writeback.close()
            f.close()
            closed = True
    finally:
        writeback.close()
        if not closed:
            f.close()
    return extents, error


def _write_serial(tmp: str, comm: FlatComm | None, rank: int, size: int, ub: int,
                  ordered: Sequence[TensorRecord], chunks: Sequence[Piece], attrs: dict,
                  sums: Any, durable: bool):
    descriptors = [(c.tensor.path, tuple((s.start, s.stop) for s in c.block)) for c in chunks]
    every = comm.gather(descriptors, root=0) if size > 1 else [descriptors]
    if rank != 0:
        for c in chunks:
            data = np.ascontiguousarray(c.data)
            # Not under the timeout: rank 0 receives this piece only after writing
            # everything before it (its own share and the lower ranks'), which takes
            # as long as the data does. Rank 0's receives are timed, so a sender
            # that stops is still named there.
            comm.Isend(data, dest=0, tag=_TAG).wait(timed=False)
        _combined(comm, sums, len(ordered))
        return [], None
    import h5py

    error = None
    try:
        f = h5py.File(tmp, "w", userblock_size=ub, libver=LIBVER, locking=False,
                      alignment_threshold=_ALIGN_THRESHOLD, alignment_interval=_ALIGN)
        dsets = _create(f, ordered, attrs)
    except Exception as exc:
        f, dsets, error = None, {}, CheckpointError(f"{tmp}: cannot create: {exc}")
    writeback = _Writeback(tmp, durable and f is not None)

    def write(path: str, block: Block, data: np.ndarray) -> None:
        nonlocal error
        if error is None:
            try:
                _write_block(dsets[path], block, data)
                writeback.wrote(data.nbytes)
            except Exception as exc:
                error = CheckpointError(f"{tmp}: writing {path} failed: {exc}")

    try:
        for c in chunks:
            write(c.tensor.path, c.block, c.data)
        # The others' pieces, in their order; receive the next while writing one.
        # After a failure keep receiving: the senders must not be left waiting.
        queue = [(r, p, tuple(slice(a, b) for a, b in blk))
                 for r in range(1, size) for p, blk in every[r]]
        dtypes = {t.path: np.dtype(t.dtype) for t in ordered}
        largest = max((block_size(b) * dtypes[p].itemsize for _, p, b in queue), default=0)
        buffers = [np.empty(largest // 8 + 1, dtype=np.float64) for _ in range(2)]

        def post(k: int) -> tuple[Any, np.ndarray]:
            r, p, blk = queue[k]
            n = block_size(blk) * dtypes[p].itemsize
            view = buffers[k % 2].view(np.uint8)[:n].view(dtypes[p]).reshape(block_shape(blk))
            return comm.Irecv(view, source=r, tag=_TAG), view

        if queue:
            request, view = post(0)
            for k, (_, p, blk) in enumerate(queue):
                request.wait()
                current = view
                if k + 1 < len(queue):
                    request, view = post(k + 1)
                write(p, blk, current)
        table = _combined(comm, sums, len(ordered))
    finally:
        writeback.close()
    # Only rank 0 is here: capture its failures, so that every rank hears of them.
    extents: list[tuple[int, int]] = []
    if f is not None:
        try:
            if error is None:
                extents = _annotate(ordered, dsets, table)
        except Exception as exc:
            error = CheckpointError(f"{tmp}: writing checksums failed: {exc}")
        finally:
            try:
                f.close()
            except Exception as exc:
                error = error or CheckpointError(f"{tmp}: closing failed: {exc}")
    return extents, error


# --- direct: rank 0 lays the file out, every rank pwrites its bytes into it ----------

@dataclass
class LaidOut:
    """A temporary file that rank 0 created with every dataset contiguous,
    4 KiB aligned and allocated (not filled), a zero ``checksum`` attribute on
    each; ``offsets[i]`` is where ``ordered[i]``'s bytes go, ``fd`` this rank's
    descriptor of it (write only; -1 where it could not be opened: ``error``,
    raised on every rank at the seal); ``h5`` rank 0's open h5py file and its
    datasets in order, whose metadata is written once, at the seal."""

    final: str
    tmp: str
    ordered: list[TensorRecord]
    index: dict[str, int]
    offsets: list[int]
    userblock: int
    fd: int
    error: BaseException | None = None
    h5: Any = None

    def close_fd(self) -> None:
        """Close this rank's descriptor (no HDF5: a writer thread may). Local."""
        if self.fd >= 0:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = -1

    def close(self) -> None:
        """Close this rank's descriptor and (rank 0) the h5py file. Local."""
        self.close_fd()
        if self.h5 is not None:
            _close_quietly(self.h5[0])
        self.h5 = None

    @property
    def extents(self) -> list[tuple[int, int]]:
        """``(offset, bytes)`` of every non-empty dataset's raw data (for the seal)."""
        return [(o, t.size * np.dtype(t.dtype).itemsize)
                for o, t in zip(self.offsets, self.ordered) if t.size]


def lay_out(final: str, comm: FlatComm | None, tensors: Sequence[TensorRecord],
            pieces: Sequence[Piece], attrs: dict[str, dict[str, Any]],
            order_groups: Sequence[str], local_problem: str | None = None,
            meanwhile: Any = None) -> LaidOut:
    """Agree on the datasets (`plan_datasets`), let rank 0 create the file at
    a temporary name next to ``final`` (serial h5py: kilobytes of metadata, no
    MPI-IO), broadcast its name and offsets, and open it on every rank; the
    other ranks call ``meanwhile()`` (if given) while rank 0 creates the file.
    Collective over ``comm``: an ``allgather`` and a broadcast.

    Rank 0 broadcasts the offsets as soon as the datasets are allocated and
    writes the groups' attributes after it, while the others go on; it keeps
    the file open for the seal (one metadata write). A rank that cannot open
    the file, or rank 0 failing on the attributes, is ``LaidOut.error``,
    raised on every rank by `seal_laid_out` (no agreement here).

    Raises:
        CheckpointError: on every rank, as `plan_datasets` does, or when the
            folder is missing or the file cannot be created.
    """
    size = 1 if comm is None else comm.size
    rank = 0 if comm is None else comm.rank
    ordered, index = plan_datasets(final, comm, size, tensors, pieces, local_problem)
    ub = userblock_size_for(len(ordered))
    created, h5 = None, None
    if rank == 0:
        created, h5 = _create_file(final, ordered, ub)
    elif meanwhile is not None:
        meanwhile()
    created = comm.bcast(created, root=0) if size > 1 else created
    tmp, offsets, problem = created
    if problem:   # every rank has rank 0's message: no agreement needed
        raise CheckpointError(problem)
    error = None
    if rank == 0:   # rank 0's attributes, as under mpio, while the others write
        error = _finish_file(h5[0], tmp, _with_order(attrs, ordered, order_groups))
    fd = -1
    try:
        fd = os.open(tmp, os.O_WRONLY)
    except OSError as exc:   # agreed on with the write's outcome, at the seal
        error = error or CheckpointError(
            f"{final}: rank {rank} cannot open the temporary file {tmp} that rank 0 "
            f"created ({exc.strerror}): the ranks need a file system they share")
    return LaidOut(final, tmp, list(ordered), index, list(offsets), ub, fd, error, h5)


def _create_file(final: str, ordered: Sequence[TensorRecord],
                 ub: int) -> tuple[tuple[str | None, list[int], str | None], tuple | None]:
    """Rank 0: the temporary file with every dataset allocated (its groups'
    attributes come later, `_finish_file`): its name, the datasets' offsets and
    the problem (a message) or None; and the open h5py file with its datasets
    in order (None on a problem)."""
    folder = os.path.dirname(final)
    if not os.path.isdir(folder):
        return (None, [], f"{final}: folder {folder} does not exist"), None
    if not os.access(folder, os.W_OK | os.X_OK):
        return (None, [], f"{final}: folder {folder} is not writable"), None
    tmp = f"{final}{TEMP_MARK}{secrets.token_hex(4)}"
    f = None
    try:
        import h5py

        f = h5py.File(tmp, "w", userblock_size=ub, libver=LIBVER, locking=False,
                      alignment_threshold=_ALIGN_THRESHOLD, alignment_interval=_ALIGN)
        dsets = _create_early(f, ordered)
        offsets = [int(dsets[t.path].id.get_offset() or 0) if t.size else 0 for t in ordered]
        return (tmp, offsets, None), (f, [dsets[t.path] for t in ordered])
    except Exception as exc:
        _close_quietly(f)
        _remove_quietly(tmp)
        return (None, [], f"{final}: cannot create {tmp}: {exc}"), None


def _finish_file(f: Any, tmp: str, attrs: dict[str, dict[str, Any]]) -> BaseException | None:
    """Rank 0, while the others write: the groups' attributes (the file stays
    open for the checksums at the seal). The problem, or None."""
    try:
        for g in sorted(attrs):
            if g != "/":
                f.require_group(g)
            _set_attrs(f if g == "/" else f[g], attrs[g])
        return None
    except Exception as exc:
        return CheckpointError(f"{tmp}: writing the attributes failed: {exc}")


def _create_early(f: Any, ordered: Sequence[TensorRecord]) -> dict:
    """`_create` with the space of every dataset allocated at once (so it has
    its offset) and a zero ``checksum`` attribute to fill in at the seal."""
    import h5py

    for g in sorted({t.group for t in ordered}):
        f.require_group(g)
    dsets = {}
    for t in ordered:
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
        dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
        d = f.create_dataset(t.path, shape=t.shape, dtype=np.dtype(t.dtype), dcpl=dcpl)
        d.attrs["checksum"] = np.zeros(2, dtype=np.uint64)
        dsets[t.path] = d
    return dsets


def _close_quietly(f: Any) -> None:
    if f is not None:
        try:
            f.close()
        except Exception:
            pass


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


def file_runs(pieces: Sequence[Piece], laid: LaidOut) -> list[tuple[int, memoryview]]:
    """``(file offset, bytes)`` of every run of ``pieces`` (C-contiguous
    arrays), adjacent runs merged where their bytes are adjacent in the same
    array too."""
    merged: list[list[Any]] = []   # [file offset, address, length, owner]
    for c in pieces:
        owner = _root(c.data)
        address = _address(c.data)
        base = laid.offsets[laid.index[c.tensor.path]]
        for offset, length in block_runs(c.block, c.tensor.shape, c.data.dtype.itemsize):
            start = base + offset
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


def aligned_chunks(offset: int, length: int, piece: int = CHUNK_BYTES,
                   align: int = _ALIGN) -> list[tuple[int, int]]:
    """``(start, stop)`` byte ranges of a run of ``length`` bytes at file
    offset ``offset``, at most ``piece`` bytes each: a head up to the first
    ``align`` boundary of the file where the run starts between two, then
    pieces that all start on one (``piece`` a multiple of ``align``), so that
    only the run's first and last pages are written in part."""
    head = min(length, (-offset) % align) if piece % align == 0 else 0
    cuts = [0, head] if head else [0]
    cuts += range(head + piece, length, piece)
    return [(a, b) for a, b in zip(cuts, [*cuts[1:], length]) if b > a]


def pwrite_runs(fd: int, runs: Sequence[tuple[int, memoryview]], piece: int = CHUNK_BYTES,
                after: Any = None) -> None:
    """Write ``runs`` at their offsets, at most ``piece`` bytes per call, each
    call after a run's first starting on a 4 KiB boundary of the file
    (`aligned_chunks`); ``after(n)`` after each call that wrote ``n`` bytes.
    POSIX only: no MPI, no HDF5."""
    for offset, data in runs:
        for at, stop in aligned_chunks(offset, len(data), piece):
            chunk, where = data[at:stop], offset + at
            n = len(chunk)
            while len(chunk):
                wrote = os.pwrite(fd, chunk, where)
                if wrote <= 0:
                    raise OSError(f"pwrite wrote {wrote} bytes at offset {where}")
                chunk, where = chunk[wrote:], where + wrote
            if after is not None:
                after(n)


def seal_laid_out(comm: FlatComm | None, laid: LaidOut, error: BaseException | None,
                  table: np.ndarray | None, durable: bool) -> None:
    """After every rank wrote (or failed): add the partial checksums ``table``
    and a count of the ranks that failed (one ``Allreduce``; the failure
    itself, ``error`` or ``laid.error``, agreed on only when some rank has one),
    and let rank 0 put them in place, seal, rename to the final name and
    ``fsync`` the folder. Collective over ``comm``.

    Raises:
        CheckpointError: on every rank when some rank failed, or sealing did
            (the temporary file is removed; nothing appears at the final name).
    """
    rank = 0 if comm is None else comm.rank
    error = error or laid.error
    count = len(laid.ordered)
    full = np.zeros((count + 1, 2), dtype=np.uint64)
    if error is None and table is not None:
        full[:count] = table
    full[count, 0] = error is not None
    if comm is not None and comm.size > 1:
        # MPI_SUM on unsigned 64-bit integers wraps modulo 2**64, as the checksum does.
        comm.Allreduce(full, slot="checkpoint-checksums")
    if full[count, 0]:
        try:
            agree_error(comm, error)
        finally:
            if rank == 0:
                laid.close()
                _remove_quietly(laid.tmp)
    error = None
    if rank == 0:
        try:
            _seal(laid, full[:count], durable)
        except Exception as exc:
            error = CheckpointError(f"{laid.final}: sealing or renaming failed: {exc}")
            laid.close()
            _remove_quietly(laid.tmp)
    agree_error(comm, error)


def _seal(laid: LaidOut, table: np.ndarray, durable: bool) -> None:
    """Rank 0: checksums in place (the file's one metadata write, at its
    close), the seal, fsync, rename, fsync of the folder."""
    import h5py

    if laid.h5 is None:
        f = h5py.File(laid.tmp, "r+", locking=False)
        dsets = [f[t.path] for t in laid.ordered]
    else:
        (f, dsets), laid.h5 = laid.h5, None
    try:
        for d, row in zip(dsets, table):   # same type and size: in place
            h5py.h5a.open(d.id, b"checksum").write(np.ascontiguousarray(row))
    finally:
        f.close()
    seal_file(laid.tmp, laid.userblock, laid.extents, durable=durable)
    os.replace(laid.tmp, laid.final)
    if durable:
        _fsync_folder(os.path.dirname(laid.final))


def _write_direct(final: str, comm: FlatComm | None, tensors: Sequence[TensorRecord],
                  pieces: Sequence[Piece], attrs: dict[str, dict[str, Any]], durable: bool,
                  order_groups: tuple) -> str:
    """The synchronous direct write: `lay_out`, this rank's runs with ``pwrite``
    while a helper thread checksums them, ``fsync``, `seal_laid_out`."""
    dense = [p if p.data.flags.c_contiguous else Piece(p.tensor, p.block,
                                                       np.ascontiguousarray(p.data))
             for p in pieces]
    laid = lay_out(final, comm, tensors, dense, attrs, order_groups)
    rank = 0 if comm is None else comm.rank
    count = len(laid.ordered)
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mpishard-checksum")
    error, table = laid.error, None
    writeback = _Writeback(laid.tmp, durable and error is None)
    try:
        sums = pool.submit(_checksums, dense, laid.index, count)
        try:
            if error is not None:   # agreed on at the seal
                raise error
            pwrite_runs(laid.fd, file_runs(dense, laid), after=writeback.wrote)
            if durable and rank != 0:
                # Rank 0's data is made durable by the fsync of the seal (the
                # same file, from the same node): one fsync less there.
                os.fsync(laid.fd)
        except Exception as exc:
            error = error or CheckpointError(f"{laid.tmp}: writing failed on rank {rank}: "
                                             f"{exc}")
        try:
            table = np.array([s.to_array() for s in sums.result()],
                             dtype=np.uint64).reshape(count, 2)
        except Exception as exc:
            table = np.zeros((count, 2), dtype=np.uint64)
            error = error or CheckpointError(f"{laid.tmp}: checksumming failed: {exc}")
    finally:
        pool.shutdown(wait=True)
        writeback.close()
        laid.close_fd()
    seal_laid_out(comm, laid, error, table, durable)
    return final


def _sync_file_range() -> Any:
    """Linux's ``sync_file_range`` through ctypes, or None where there is none."""
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2
_WRITEBACK_BYTES = 32 << 20


class _Writeback:
    """For a durable save: start the kernel's write-back of the file every 32 MiB
    this rank writes, so that the disk works while the rank goes on writing and
    the final ``fsync`` finds little left to do (``sync_file_range``, as
    databases do; nothing where the call is missing)."""

    def __init__(self, path: str, enabled: bool) -> None:
        self.fd = None
        self.pending = 0
        if enabled and _SYNC_FILE_RANGE is not None:
            try:
                self.fd = os.open(path, os.O_RDONLY)
            except OSError:
                self.fd = None

    def wrote(self, nbytes: int) -> None:
        if self.fd is None:
            return
        self.pending += nbytes
        if self.pending >= _WRITEBACK_BYTES:
            self.pending = 0
            if _SYNC_FILE_RANGE(self.fd, 0, 0, _SYNC_FILE_RANGE_WRITE) != 0:
                self.close()   # not supported here: the fsync will do it all

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _fsync_folder(folder: str) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass   # some file systems refuse to fsync a folder; the rename is done
    finally:
        os.close(fd)


def _remove_quietly(path: str | None) -> None:
    if path:
        try:
            os.remove(path)
        except OSError:
            pass
