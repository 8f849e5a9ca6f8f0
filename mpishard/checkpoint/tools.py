"""Looking into a checkpoint from one process: ``mpishard ckpt inspect`` and ``verify``."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ..errors import CheckpointError
from .blocks import block_shape, full_block, split_block
from .checksum import Checksum, block_checksum
from .format import CheckpointInfo, TensorRecord
from .read import open_h5, read_info_local

__all__ = ["inspect_checkpoint", "verify_checkpoint"]

_CHUNK_BYTES = 64 << 20


def _tensor_checksums(info: CheckpointInfo) -> dict[str, Checksum]:
    """Every dataset's checksum recomputed from its data, streamed in bounded chunks."""
    out: dict[str, Checksum] = {}
    buffer = np.empty(_CHUNK_BYTES // 8, dtype=np.float64)
    try:
        f = open_h5(info.path)
    except OSError as exc:
        raise CheckpointError(f"{info.path}: HDF5 cannot open it: {exc}") from None
    with f:
        for path, rec in info.tensors.items():
            dtype = np.dtype(rec.dtype)
            total = Checksum()
            d = f[path]
            for blk in split_block(full_block(rec.shape), _CHUNK_BYTES // dtype.itemsize):
                shape = block_shape(blk)
                n = int(np.prod(shape))
                if n == 0:
                    continue
                view = buffer.view(np.uint8)[:n * dtype.itemsize].view(dtype).reshape(shape)
                try:
                    d.read_direct(view, source_sel=blk if blk else None)
                except Exception as exc:
                    raise CheckpointError(f"{info.path}: reading {path} failed: {exc}") from None
                total = total + block_checksum(view, blk, rec.shape)
            out[path] = total
    return out


def verify_checkpoint(path: str | os.PathLike) -> CheckpointInfo:
    """Check everything about the file ``path`` in this process: seal, header, and
    every dataset's checksum (reading all the data). Returns its info.

    Raises:
        FileNotFoundError: no file at ``path``.
        CheckpointError: the first problem found, naming the file.
    """
    info = read_info_local(path)
    sums = _tensor_checksums(info)
    bad = [p for p, s in sums.items() if s != info.tensors[p].checksum]
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise CheckpointError(f"{info.path}: corrupt data: the checksum of "
                              f"{', '.join(bad[:3])}{more} does not match the one written")
    return info


def _tensor_row(rec: TensorRecord, ok: bool | None) -> dict[str, Any]:
    return {"path": rec.path, "shape": list(rec.shape), "dtype": np.dtype(rec.dtype).name,
            "checksum": [f"{rec.checksum.total:016x}", f"{rec.checksum.weighted:016x}"],
            "verified": ok}


def inspect_checkpoint(path: str | os.PathLike, verify: bool = True) -> dict[str, Any]:
    """What ``path`` holds, as a JSON-ready dict: header, layout, optimizer, data
    position, and each tensor's shape, dtype and checksum (recomputed and compared
    unless ``verify`` is False; ``"verified"`` is then None).

    Raises:
        FileNotFoundError: no file at ``path``.
        CheckpointError: a damaged seal or header (damaged *data* is reported
            per tensor instead, with ``"ok": False`` at the top).
    """
    info = read_info_local(path)
    sums = _tensor_checksums(info) if verify else {}
    rows = [_tensor_row(rec, (sums[p] == rec.checksum) if verify else None)
            for p, rec in info.tensors.items()]
    return {
        "path": info.path, "ok": all(r["verified"] is not False for r in rows),
        "format_version": info.format_version, "kind": info.kind,
        "library_version": info.library_version, "created": info.created,
        "step": info.step, "epoch": info.epoch, "layout": info.layout, "dtype": info.dtype,
        "parameters": info.parameter_count, "bytes": os.path.getsize(info.path),
        "schedule": info.schedule, "lr": info.lr, "settings": info.settings,
        "optimizer": info.optimizer, "state_names": info.state_names,
        "data": info.data, "architecture": info.architecture, "tensors": rows,
    }
