"""Reading hyperslabs of a checkpoint on many ranks, each verified exactly once.

Loading has two collective steps:

1. `open_checkpoint`: rank 0 checks the seal (size and the digest of the
   HDF5 structure, `mpishard.checkpoint.container`) *before* HDF5 parses
   the file, then reads and checks the header (`read_info`)
   and broadcasts it; any problem is raised on every rank.
2. `read_blocks`: each rank opens the file read-only with HDF5's default
   driver (reads need no coordination, and a rank that fails cannot leave the
   others in a collective ``H5Fclose``), reads its requests straight into the
   caller's arrays, and checksums the ones marked ``verify`` in a helper thread
   while the next is read. The verified requests of all ranks must partition
   each dataset they touch; one ``Allreduce`` adds the partial checksums and
   every rank compares them with the file's.

The caller reads into staging arrays and commits them to the model only after
`read_blocks` returns, so a damaged file never leaves a half-loaded model.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..comm import FlatComm
from ..errors import CheckpointError
from .blocks import Block, block_shape, block_size
from .checksum import Checksum, block_checksum
from .collective import agree_error
from .container import verify_file
from .format import CheckpointInfo, TensorRecord, read_info

__all__ = ["ReadRequest", "open_checkpoint", "open_h5", "read_blocks", "read_info_local"]


@dataclass(frozen=True)
class ReadRequest:
    """Read ``record[block]`` into ``out`` (a C-contiguous host array of the
    block's shape and the record's dtype); ``verify`` marks the rank that
    checksums these elements."""

    record: TensorRecord
    block: Block
    out: np.ndarray
    verify: bool = True


def open_h5(path: str) -> Any:
    """``h5py.File(path, "r")`` without file locks (sealed files never change)."""
    import h5py

    try:
        return h5py.File(path, "r", locking=False)
    except (TypeError, ValueError):   # an HDF5 without the locking switch
        return h5py.File(path, "r")


def read_info_local(path: str | os.PathLike) -> CheckpointInfo:
    """Check the seal of ``path`` and read its header, in this process alone.

    Raises:
        FileNotFoundError: no such file.
        CheckpointError: anything wrong with it, naming the path.
    """
    name = os.fspath(path)
    verify_file(name)
    try:
        f = open_h5(name)
    except OSError as exc:
        raise CheckpointError(f"{name}: HDF5 cannot open it: {exc}") from None
    with f:
        return read_info(f, name)


def open_checkpoint(path: str | os.PathLike, comm: FlatComm | None) -> CheckpointInfo:
    """The checked header of ``path``, on every rank. Collective over ``comm``
    (``None``: this process alone).

    Raises:
        FileNotFoundError: no such file (on every rank).
        CheckpointError: truncated, damaged, foreign, unknown version (on every rank).
    """
    rank = 0 if comm is None else comm.rank
    info, error = None, None
    if rank == 0:
        try:
            info = read_info_local(path)
        except (CheckpointError, FileNotFoundError) as exc:
            error = exc
        except Exception as exc:   # never let one rank die alone
            error = CheckpointError(f"{os.fspath(path)}: cannot read: {exc}")
    agree_error(comm, error)
    if comm is not None:
        info = comm.bcast(info, root=0)
    return info


def _check(request: ReadRequest, path: str) -> str | None:
    r = request.record
    if len(request.block) != len(r.shape) or any(
            not (0 <= s.start <= s.stop <= n) for s, n in zip(request.block, r.shape)):
        return f"{path}: request outside {r.path} {r.shape}: {request.block}"
    if tuple(request.out.shape) != block_shape(request.block):
        return f"{path}: request buffer {request.out.shape} for block {block_shape(request.block)}"
    if np.dtype(request.out.dtype).newbyteorder("<").str != r.dtype:
        return f"{path}: request buffer {request.out.dtype} for {r.path} ({np.dtype(r.dtype).name})"
    if not request.out.flags.c_contiguous:
        return f"{path}: request buffer for {r.path} is not C-contiguous"
    return None


def read_blocks(info: CheckpointInfo, comm: FlatComm | None, requests: Sequence[ReadRequest],
                opener: Callable[[], Any] | None = None) -> None:
    """Read every rank's ``requests`` and verify the checksums. Collective over ``comm``
    (``None``: this process alone).

    ``opener`` returns the open h5py file (default: `open_h5` of ``info.path``).

    Raises:
        CheckpointError: on every rank, when a read fails anywhere or a dataset's
            checksum does not match (naming the file and the datasets), or when
            the verified requests do not cover a dataset exactly once.
    """
    path = info.path
    paths = list(info.tensors)
    index = {p: i for i, p in enumerate(paths)}
    error: BaseException | None = None
    for req in requests:
        problem = None if req.record.path in index else f"{path}: no dataset {req.record.path}"
        problem = problem or _check(req, path)
        if problem:
            error = CheckpointError(problem)
            break
    rank = 0 if comm is None else comm.rank
    counts = np.zeros(len(paths), dtype=np.int64)
    sums = [Checksum()] * len(paths)
    if error is None:
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mpishard-checksum")
        futures = []
        try:
            f = opener() if opener is not None else open_h5(path)
            try:
                dsets: dict[str, Any] = {}
                for req in requests:
                    if block_size(req.block) == 0:
                        continue
                    d = dsets.get(req.record.path)
                    if d is None:
                        d = dsets[req.record.path] = f[req.record.path]
                    d.read_direct(req.out, source_sel=req.block if req.block else None)
                    if req.verify:
                        i = index[req.record.path]
                        counts[i] += block_size(req.block)
                        futures.append((i, pool.submit(block_checksum, req.out, req.block,
                                                       req.record.shape)))
            finally:
                f.close()
            for i, fut in futures:
                sums[i] = sums[i] + fut.result()
        except Exception as exc:
            error = CheckpointError(f"{path}: reading failed on rank {rank}: {exc}")
        finally:
            pool.shutdown(wait=True)
    agree_error(comm, error)
    table = np.array([s.to_array() for s in sums], dtype=np.uint64).reshape(len(paths), 2)
    if comm is not None and comm.size > 1:
        comm.Allreduce(counts, slot="checkpoint-counts")
        # MPI_SUM on unsigned 64-bit integers wraps modulo 2**64, as the checksum does.
        comm.Allreduce(table, slot="checkpoint-checksums")
    partial = [p for p, c in zip(paths, counts) if c and c != info.tensors[p].size]
    if partial:
        raise CheckpointError(f"{path}: internal error: verified reads cover "
                              f"{partial[:3]} partly or twice")
    bad = [p for p, c, row in zip(paths, counts, table)
           if c and Checksum.from_array(row) != info.tensors[p].checksum]
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise CheckpointError(f"{path}: corrupt data: the checksum of {', '.join(bad[:3])}{more} "
                              f"does not match the one written")
