"""Hyperslabs of logical tensors: flat ranges cut into blocks, blocks cut into chunks.

A checkpoint stores every tensor at its logical (unsharded) shape, but ranks
hold pieces of the flat vector: a ZeRO shard is a range ``[start, stop)`` of a
tensor's elements in C order, which is not a rectangular hyperslab. It is a
union of at most ``2 * ndim - 1`` of them (`flat_blocks`), and each of
those is also a contiguous run of the tensor's C order, so it is written with
one contiguous I/O request and checksummed as one run.

A *block* is a tuple of ``slice`` objects with explicit ``start`` and ``stop``
(step 1), one per dimension, so that its shape is the shape of the local
array that holds it. Pure arithmetic: nothing here imports MPI or h5py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = [
    "Block",
    "block_shape",
    "block_size",
    "block_start",
    "flat_blocks",
    "full_block",
    "is_contiguous_run",
    "share_of_block",
    "split_block",
]

Block = tuple  # tuple[slice, ...], one slice per dimension


def full_block(shape: Sequence[int]) -> Block:
    """The block that covers a whole tensor of ``shape``."""
    return tuple(slice(0, int(s)) for s in shape)


def block_shape(block: Block) -> tuple[int, ...]:
    return tuple(s.stop - s.start for s in block)


def block_size(block: Block) -> int:
    return math.prod(block_shape(block))


def block_start(block: Block, shape: Sequence[int]) -> int:
    """The C-order index of the block's first element in a tensor of ``shape``."""
    index = 0
    for s, dim in zip(block, shape):
        index = index * int(dim) + s.start
    return index


def is_contiguous_run(block: Block, shape: Sequence[int]) -> bool:
    """True when the block's elements are consecutive in the tensor's C order.

    That is so when, after the first dimension the block spans more than one
    index of, every later dimension is taken whole.
    """
    spread = False
    for s, dim in zip(block, shape):
        if spread and (s.start != 0 or s.stop != dim):
            return False
        if s.stop - s.start > 1:
            spread = True
    return True


def flat_blocks(start: int, stop: int, shape: Sequence[int]) -> list[Block]:
    """Elements ``[start, stop)`` (C order) of a tensor of ``shape`` as hyperslabs.

    Returns at most ``2 * ndim - 1`` blocks, in C order, each a contiguous run:
    a partial row at each level on the way in, whole rows in the middle, a
    partial row at each level on the way out. Their concatenation, each block
    raveled, is the range. Example, shape ``(4, 5)``, range ``[3, 17)``::

        (0:1, 3:5)   (1:3, 0:5)   (3:4, 0:2)

    Raises:
        ValueError: the range is not inside the tensor.
    """
    shape = tuple(int(s) for s in shape)
    size = math.prod(shape)
    if not 0 <= start <= stop <= size:
        raise ValueError(f"range [{start}, {stop}) is not inside a tensor of "
                         f"{size} elements (shape {shape})")
    if start == stop:
        return []
    if not shape:
        return [()]
    return _blocks(start, stop, shape)


def _blocks(start: int, stop: int, shape: tuple[int, ...]) -> list[Block]:
    if len(shape) == 1:
        return [(slice(start, stop),)]
    inner = math.prod(shape[1:])
    rest = shape[1:]
    r0, o0 = divmod(start, inner)
    r1, o1 = divmod(stop, inner)
    if r0 == r1:  # inside one row
        return [(slice(r0, r0 + 1),) + b for b in _blocks(o0, o1, rest)]
    out: list[Block] = []
    if o0:
        out += [(slice(r0, r0 + 1),) + b for b in _blocks(o0, inner, rest)]
        r0 += 1
    if r1 > r0:
        out.append((slice(r0, r1),) + full_block(rest))
    if o1:
        out += [(slice(r1, r1 + 1),) + b for b in _blocks(0, o1, rest)]
    return out


def split_block(block: Block, max_elements: int) -> list[Block]:
    """Cut ``block`` along its first dimension of extent > 1 into blocks of at
    most about ``max_elements`` elements (never smaller than one index of that
    dimension). Bounds the memory of a chunk and gives writes and checksums
    something to overlap; each part of a contiguous run is a contiguous run.
    """
    if max_elements < 1:
        raise ValueError(f"expecting max_elements >= 1, got {max_elements}")
    shape = block_shape(block)
    total = math.prod(shape)
    if total <= max_elements:
        return [block]
    axis = next(i for i, n in enumerate(shape) if n > 1)
    per_index = total // shape[axis]
    step = max(1, max_elements // per_index)
    s = block[axis]
    return [block[:axis] + (slice(a, min(a + step, s.stop)),) + block[axis + 1:]
            for a in range(s.start, s.stop, step)]


def share_of_block(block: Block, parts: int, part: int) -> Block | None:
    """Part ``part`` of ``parts`` of ``block``, cut along its first axis of extent > 1
    into contiguous runs of indices (the longer parts first), or None when that
    part is empty.

    For data that ``parts`` ranks hold alike (a tensor-parallel slice replicated
    over the data-parallel group): each rank writes and verifies its share, so
    that no rank moves the whole block.
    """
    if parts < 1 or not 0 <= part < parts:
        raise ValueError(f"expecting 0 <= part < parts, got part={part}, parts={parts}")
    shape = block_shape(block)
    axis = next((i for i, n in enumerate(shape) if n > 1), None)
    if axis is None:   # a single element: the first part takes it
        return block if part == 0 and math.prod(shape) else None
    s = block[axis]
    base, extra = divmod(s.stop - s.start, parts)
    lo = s.start + part * base + min(part, extra)
    hi = lo + base + (part < extra)
    if lo == hi:
        return None
    return block[:axis] + (slice(lo, hi),) + block[axis + 1:]
