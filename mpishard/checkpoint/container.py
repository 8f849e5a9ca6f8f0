"""The seal in the HDF5 user block: file size and a digest of everything but raw data.

HDF5 reserves the first bytes of a file, the *user block*, for the
application and never reads them, so a plain ``h5py.File(path)`` opens a sealed
file as any other. The writer puts there, after the file is closed::

    offset  size  field
         0    16  magic  b"\\x89MPISHARD\\r\\n\\x1a\\n\\0\\0\\0"
        16     4  seal version (1)
        20     4  header size (80)
        24     8  file size in bytes
        32     8  user block size (a power of two >= 4096)
        40     8  number E of raw-data extents
        48    32  BLAKE2b-256 digest
        80  16*E  extents: (file offset, length) of every dataset's raw data, sorted

The digest covers the whole user block (with the digest field zeroed) and every
byte of the file outside the raw-data extents: the superblock, object headers,
B-trees, heaps, attributes, free space. A reader checks the size and the digest
*before* HDF5 parses anything, so a truncated file or a flipped byte in HDF5's
own structures is a clean error instead of a crash inside libhdf5. Raw data is
left out because it is large and already covered, dataset by dataset, by the
positional checksums (`mpishard.checkpoint.checksum`) that are verified
as it is read; sealing a 1 GiB checkpoint therefore reads a few kilobytes.

Pure: files and bytes only, no MPI, no h5py.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Callable, Iterable, Sequence

from ..errors import CheckpointError

__all__ = [
    "HDF5_SIGNATURE",
    "MAGIC",
    "seal_file",
    "seal_image",
    "userblock_size_for",
    "verify_file",
    "verify_image",
]

MAGIC = b"\x89MPISHARD\r\n\x1a\n\0\0\0"
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
_VERSION = 1
_HEADER = struct.Struct("<16sIIQQQ32s")
_EXTENT = struct.Struct("<QQ")
_DIGEST_AT = 48
_MIN_USERBLOCK = 4096
_READ = 8 << 20

Extents = Sequence[tuple[int, int]]
Reader = Callable[[int, int], bytes]


def userblock_size_for(extents: int) -> int:
    """The user block for ``extents`` raw-data extents: a power of two >= 4096."""
    need = _HEADER.size + _EXTENT.size * extents
    size = _MIN_USERBLOCK
    while size < need:
        size *= 2
    return size


def _normalise(extents: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    return sorted((int(o), int(n)) for o, n in extents if int(n) > 0)


def _gaps(extents: list[tuple[int, int]], start: int, end: int) -> Iterable[tuple[int, int]]:
    """The ``(offset, length)`` regions of ``[start, end)`` outside ``extents``."""
    at = start
    for offset, length in extents:
        if offset > at:
            yield at, offset - at
        at = max(at, offset + length)
    if end > at:
        yield at, end - at


def _digest(userblock: bytes, read: Reader, extents: list[tuple[int, int]], size: int) -> bytes:
    h = hashlib.blake2b(digest_size=32)
    zeroed = bytearray(userblock)
    zeroed[_DIGEST_AT:_DIGEST_AT + 32] = bytes(32)
    h.update(zeroed)
    for offset, length in _gaps(extents, len(userblock), size):
        for at in range(offset, offset + length, _READ):
            n = min(_READ, offset + length - at)
            chunk = read(at, n)
            if len(chunk) != n:
                raise CheckpointError(f"short read: {len(chunk)} of {n} bytes at offset {at}")
            h.update(chunk)
    return h.digest()


def _userblock(size: int, userblock_size: int, extents: list[tuple[int, int]],
               digest: bytes = bytes(32)) -> bytes:
    if _HEADER.size + _EXTENT.size * len(extents) > userblock_size:
        raise ValueError(f"{len(extents)} extents do not fit a user block of "
                         f"{userblock_size} bytes")
    head = _HEADER.pack(MAGIC, _VERSION, _HEADER.size, size, userblock_size, len(extents), digest)
    table = b"".join(_EXTENT.pack(o, n) for o, n in extents)
    return (head + table).ljust(userblock_size, b"\0")


def seal_file(path: str | os.PathLike, userblock_size: int, extents: Iterable[tuple[int, int]],
              durable: bool = True) -> None:
    """Write the seal into the user block of the closed HDF5 file ``path``.

    ``extents`` are the ``(file offset, length)`` of the datasets' raw data.
    With ``durable`` the file is ``fsync``-ed afterwards.
    """
    ext = _normalise(extents)
    fd = os.open(path, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        blank = _userblock(size, userblock_size, ext)
        digest = _digest(blank, lambda at, n: os.pread(fd, n, at), ext, size)
        block = _userblock(size, userblock_size, ext, digest)
        if os.pwrite(fd, block, 0) != len(block):
            raise OSError(f"short write of the user block of {path}")
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)


def seal_image(image: bytearray, userblock_size: int, extents: Iterable[tuple[int, int]]) -> None:
    """`seal_file` for an HDF5 file image held in memory (modified in place)."""
    ext = _normalise(extents)
    size = len(image)
    view = memoryview(image)
    blank = _userblock(size, userblock_size, ext)
    digest = _digest(blank, lambda at, n: bytes(view[at:at + n]), ext, size)
    image[:userblock_size] = _userblock(size, userblock_size, ext, digest)


def _verify(name: str, size: int, read: Reader) -> int:
    """Check a sealed image; return its user block size. ``name`` goes in messages."""
    if size == 0:
        raise CheckpointError(f"{name}: empty file (0 bytes), not a checkpoint")
    first = read(0, min(size, _MIN_USERBLOCK))
    if not first.startswith(MAGIC):
        if any(read(at, 8) == HDF5_SIGNATURE for at in _signature_offsets(size)):
            raise CheckpointError(f"{name}: an HDF5 file, but not an mpishard checkpoint "
                                  f"(no mpishard seal in its user block)")
        if size < len(MAGIC) and MAGIC.startswith(first):
            raise CheckpointError(f"{name}: truncated to {size} bytes")
        raise CheckpointError(f"{name}: not an mpishard checkpoint (neither the mpishard "
                              f"seal nor an HDF5 signature at its start)")
    if size < _MIN_USERBLOCK:
        raise CheckpointError(f"{name}: truncated to {size} bytes, inside its user block")
    _, version, header, recorded, ub, count, digest = _HEADER.unpack_from(first)
    if version != _VERSION or header != _HEADER.size:
        raise CheckpointError(f"{name}: seal version {version} (header {header} bytes) is not "
                              f"supported; this library reads version {_VERSION}")
    if size != recorded:
        what = "truncated" if size < recorded else "longer than written"
        raise CheckpointError(f"{name}: {what}: {size} bytes, the writer recorded {recorded}")
    if ub < _MIN_USERBLOCK or ub & (ub - 1) or ub > size:
        raise CheckpointError(f"{name}: corrupt seal: user block size {ub}")
    if _HEADER.size + _EXTENT.size * count > ub:
        raise CheckpointError(f"{name}: corrupt seal: {count} extents do not fit its user block")
    block = read(0, ub)
    extents = [_EXTENT.unpack_from(block, _HEADER.size + _EXTENT.size * k) for k in range(count)]
    at = ub
    for offset, length in extents:
        if offset < at or offset + length > size or length == 0:
            raise CheckpointError(f"{name}: corrupt seal: raw-data extent ({offset}, {length}) "
                                  f"is out of order or outside the file")
        at = offset + length
    if _digest(block, read, extents, size) != digest:
        raise CheckpointError(f"{name}: corrupt: the digest of its HDF5 structure does not "
                              f"match the one written (damaged or modified after it was written)")
    return ub


def _signature_offsets(size: int) -> list[int]:
    """Where HDF5 looks for its superblock: 0, 512, 1024, 2048, ..."""
    out, at = [0], 512
    while at + 8 <= size:
        out.append(at)
        at *= 2
    return out


def verify_file(path: str | os.PathLike) -> int:
    """Check the seal of ``path``; return its user block size.

    Reads the user block and the HDF5 structure (not the raw data).

    Raises:
        FileNotFoundError: no such file.
        CheckpointError: empty, truncated, extended, foreign or damaged, with the path.
    """
    name = os.fspath(path)
    try:
        fd = os.open(name, os.O_RDONLY)
    except FileNotFoundError:
        raise FileNotFoundError(f"no checkpoint at {name}") from None
    except OSError as exc:
        raise CheckpointError(f"{name}: cannot open: {exc.strerror}") from None
    try:
        return _verify(name, os.fstat(fd).st_size, lambda at, n: os.pread(fd, n, at))
    except OSError as exc:
        raise CheckpointError(f"{name}: cannot read: {exc}") from None
    finally:
        os.close(fd)


def verify_image(image: bytes | bytearray | memoryview, name: str = "<bytes>") -> int:
    """`verify_file` for an image in memory; ``name`` is used in messages."""
    view = memoryview(image).cast("B")
    return _verify(name, len(view), lambda at, n: bytes(view[at:at + n]))
