"""The per-dataset checksum: a positional sum that ranks compute piece by piece.

Take a tensor's bytes in C order, little-endian, as 64-bit words ``W_0, W_1,
...`` (the last one zero-padded), and compute::

    total    = sum(W_q)            mod 2**64
    weighted = sum((q + 1) * W_q)  mod 2**64

Both are linear in the words, and a word is the sum of its elements' bits
shifted into place (a float32 element ``i`` is ``u_i << 32 * (i % 2)`` of word
``i // 2``). So the checksum of a tensor is the sum of the checksums of any
pieces that partition it, even pieces that split a word: every rank checksums
what it wrote (or read), using the *global* position of its elements, and one
``Allreduce`` adds them up. ``total`` changes with any single altered element;
``weighted`` also changes when data lands at the wrong place (a shard written at
a wrong offset, a transposed block). It guards against corruption, not tampering.

Computed chunk by chunk in cache: a chunk of ``R * K`` words is viewed as an
``R x K`` matrix whose row sums ``r`` and column sums ``c`` (two vectorised
integer reductions) give ``sum(W) = sum(r)`` and
``sum(j * W_j) = K * (0..R-1) . r + (0..K-1) . c``: no per-word multiplication.
About 13 GB/s on one core of the machine this was written on, whatever the
dtype. Pure: no MPI.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from .blocks import Block, block_shape, block_start, is_contiguous_run

__all__ = [
    "ALGORITHM",
    "Checksum",
    "block_checksum",
    "run_checksum",
]

#: Name stored in every file, so that another algorithm can come later.
ALGORITHM = "words64-sum-weighted"

_MASK = (1 << 64) - 1
_K = 256                      # a chunk is an _R x _K matrix of 64-bit words:
_R = 256                      # 512 KiB, in L2 cache
_CHUNK = _R * _K
_RAMP = np.arange(_CHUNK, dtype=np.uint64)


class Checksum(NamedTuple):
    """``(total, weighted)``, both integers in ``[0, 2**64)``."""

    total: int = 0
    weighted: int = 0

    def __add__(self, other: tuple) -> Checksum:  # type: ignore[override]
        return Checksum((self.total + other[0]) & _MASK, (self.weighted + other[1]) & _MASK)

    def to_array(self) -> np.ndarray:
        return np.array([self.total, self.weighted], dtype=np.uint64)

    @classmethod
    def from_array(cls, a: Sequence[int]) -> Checksum:
        return cls(int(a[0]) & _MASK, int(a[1]) & _MASK)


def _elements(a: np.ndarray) -> np.ndarray:
    """``a`` raveled, as little-endian unsigned integers of its element width."""
    a = np.ravel(a)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    width = a.dtype.itemsize
    if width not in (1, 2, 4, 8):
        raise TypeError(f"cannot checksum elements of {width} bytes ({a.dtype})")
    return a.view(f"<u{width}")


def _words(words: np.ndarray, first_word: int) -> tuple[int, int]:
    """``(sum W, sum (q + 1) W)`` of 64-bit words whose first is word ``first_word``."""
    n = words.shape[0]
    scratch = None
    if n and words.ctypes.data % 8:   # unaligned: reduce aligned copies of the chunks
        scratch = np.empty(min(n, _CHUNK), dtype=np.uint64)
    total = weighted = 0
    for start in range(0, n, _CHUNK):
        c = words[start:start + _CHUNK]
        k = c.shape[0]
        if scratch is not None:
            np.copyto(scratch[:k], c)
            c = scratch[:k]
        if k == _CHUNK:
            m = c.reshape(_R, _K)
            rows = m.sum(axis=1)
            s = int(rows.sum())
            d = _K * int(np.dot(_RAMP[:_R], rows)) + int(np.dot(_RAMP[:_K], m.sum(axis=0)))
        else:   # the last, short chunk
            s = int(c.sum())
            d = int(np.dot(c, _RAMP[:k]))
        # sum((first + start + j + 1) * W_j) = (first + start + 1) * sum(W) + sum(j * W_j);
        # NumPy's unsigned sums and dots wrap modulo 2**64, as the definition does.
        total += s
        weighted += (first_word + start + 1) * s + d
    return total, weighted


def run_checksum(a: np.ndarray, first: int) -> Checksum:
    """Checksum of consecutive elements ``a`` (raveled in C order) whose first has
    global element index ``first``."""
    u = _elements(a)
    n, width = u.shape[0], u.dtype.itemsize
    per = 8 // width                  # elements per 64-bit word
    total = weighted = 0

    def single(value: int, i: int) -> None:   # one element of a word shared with others
        nonlocal total, weighted
        c = value << (8 * width * (i % per))
        total += c
        weighted += (i // per + 1) * c

    head = min(n, (-first) % per)
    for j in range(head):
        single(int(u[j]), first + j)
    body = (n - head) // per * per
    if body:
        t, w = _words(u[head:head + body].view("<u8"), (first + head) // per)
        total += t
        weighted += w
    for j in range(head + body, n):
        single(int(u[j]), first + j)
    return Checksum(total & _MASK, weighted & _MASK)


def block_checksum(a: np.ndarray, block: Block, shape: Sequence[int]) -> Checksum:
    """Checksum of the hyperslab ``block`` of a tensor of ``shape``, held in ``a``
    (an array of the block's shape)."""
    bshape = block_shape(block)
    if tuple(np.shape(a)) != bshape:
        raise ValueError(f"expecting an array of the block's shape {bshape}, got {np.shape(a)}")
    if math.prod(bshape) == 0:
        return Checksum()
    if is_contiguous_run(block, shape):
        return run_checksum(a, block_start(block, shape))
    # A general hyperslab (a tensor-parallel column slice): one run per index of
    # the leading axes, up to the last axis that is not taken whole.
    d = max(i for i, (s, n) in enumerate(zip(block, shape)) if s.stop - s.start != n)
    out = Checksum()
    for lead in np.ndindex(*bshape[:d]):
        sub = tuple(slice(s.start + k, s.start + k + 1) for s, k in zip(block, lead)) + block[d:]
        out = out + run_checksum(a[lead], block_start(sub, shape))
    return out
