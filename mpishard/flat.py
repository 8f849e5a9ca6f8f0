"""The flat parameter vector: named tensors as ranges of one 1-D array.

Every range of the flat vector is named once here:

* a tensor's **world range** (``layout.range(name)``): where a parameter lives;
* a **bucket** ([`bucket_ranges`][mpishard.flat.bucket_ranges]): a run of whole tensors that is
  reduced as one message; buckets are listed in backward order (the highest offsets
  first), because gradients become ready last layer first;
* a **shard** ([`shard_ranges`][mpishard.flat.shard_ranges]): the contiguous piece of the flat
  vector a ZeRO rank owns. Shards do not respect tensor boundaries.

Pure arithmetic: nothing here imports MPI.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "ParamLayout",
    "ParameterShard",
    "Range",
    "TensorSpec",
    "bucket_ranges",
    "buckets_of",
    "shard_ranges",
    "split_range",
    "unit_ranges",
]


class Range(NamedTuple):
    """Half-open range ``[start, stop)`` of a flat vector."""

    start: int
    stop: int

    def __len__(self) -> int:  # type: ignore[override]
        return max(0, self.stop - self.start)

    @property
    def size(self) -> int:
        return len(self)

    def intersect(self, other: Range) -> Range:
        """The overlap with ``other``; empty ranges are clamped to ``(x, x)``."""
        start = max(self.start, other.start)
        stop = min(self.stop, other.stop)
        return Range(start, max(start, stop))

    def shift(self, offset: int) -> Range:
        """The same range moved by ``-offset``: global to local coordinates."""
        return Range(self.start - offset, self.stop - offset)

    def slice(self) -> slice:
        return slice(self.start, self.stop)


@dataclass(frozen=True)
class TensorSpec:
    """One named tensor of a layout."""

    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def range(self) -> Range:
        return Range(self.offset, self.offset + self.size)


class ParamLayout:
    """Ordered names, shapes and offsets of the tensors in a flat vector.

    Tensors are laid out in the order they are added, which for the library's
    models is forward order; gradients are then written from the end of the
    vector towards its start during backward.
    """

    def __init__(self, tensors: Iterable[tuple[str, tuple[int, ...]]] = ()) -> None:
        self._specs: dict[str, TensorSpec] = {}
        self._size = 0
        for name, shape in tensors:
            self.add(name, shape)

    def add(self, name: str, shape: Iterable[int]) -> TensorSpec:
        """Append a tensor and return its spec."""
        shape = tuple(int(s) for s in shape)
        if name in self._specs:
            raise ValueError(f"tensor {name!r} is already in the layout")
        if any(s < 0 for s in shape):
            raise ValueError(f"tensor {name!r} has a negative dimension: {shape}")
        spec = TensorSpec(name, shape, self._size)
        self._specs[name] = spec
        self._size += spec.size
        return spec

    @property
    def size(self) -> int:
        """Number of elements in the flat vector."""
        return self._size

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._specs)

    def __len__(self) -> int:
        return len(self._specs)

    def __iter__(self) -> Iterator[TensorSpec]:
        return iter(self._specs.values())

    def __contains__(self, name: object) -> bool:
        return name in self._specs

    def __getitem__(self, name: str) -> TensorSpec:
        try:
            return self._specs[name]
        except KeyError:
            raise KeyError(f"no tensor {name!r} in the layout") from None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ParamLayout) and list(self) == list(other)

    def range(self, name: str) -> Range:
        """The world range of tensor ``name``."""
        return self[name].range

    def view(self, flat: Any, name: str, base: int = 0) -> Any:
        """A view of tensor ``name`` in ``flat`` (NumPy or CuPy), at its shape;
        ``flat[x - base]`` is element ``x`` of the vector (``base``: where a
        piece of it starts)."""
        spec = self[name]
        at = spec.offset - base
        return flat[at:at + spec.size].reshape(spec.shape)

    def views(self, flat: Any) -> dict[str, Any]:
        """Views of every tensor, by name."""
        return {s.name: self.view(flat, s.name) for s in self}

    def allocate(self, dtype: Any = np.float64, xp: Any = np) -> Any:
        """A zeroed flat vector for this layout."""
        return xp.zeros(self.size, dtype=dtype)

    def tensors_in(self, r: Range) -> list[TensorSpec]:
        """The tensors that overlap range ``r``, in layout order."""
        return [s for s in self if len(s.range.intersect(r))]

    def describe(self) -> list[dict[str, Any]]:
        """A list of ``{name, shape, offset, size}`` records (for metadata)."""
        return [{"name": s.name, "shape": list(s.shape), "offset": s.offset, "size": s.size}
                for s in self]


def unit_ranges(layout: ParamLayout) -> list[Range]:
    """World ranges of the layout's *units*: runs of tensors whose names share
    their first component (``"3.weight"``, ``"3.bias"`` and ``"3.attn.wq"`` are all
    unit ``"3"``).

    A unit is what one top-level layer writes in one go during backward (a
    composite layer such as a transformer block included); buckets never split
    one, so each layer's gradients land in exactly one bucket.
    """
    units: list[Range] = []
    prefix = None
    for spec in layout:
        head = spec.name.split(".", 1)[0]
        if units and head == prefix:
            units[-1] = Range(units[-1].start, spec.range.stop)
        else:
            units.append(spec.range)
        prefix = head
    return [u for u in units if len(u)]


def bucket_ranges(layout: ParamLayout, bucket_elements: int) -> list[Range]:
    """Cut the flat vector into buckets of whole units, in backward order.

    Walking the units ([`unit_ranges`][mpishard.flat.unit_ranges]) from the last to the first, the
    order their gradients become ready, units join the current bucket until it would
    exceed ``bucket_elements``; a unit larger than that gets a bucket of its own.

    Returns the buckets' world ranges, the one with the highest offsets first.
    """
    if bucket_elements < 1:
        raise ValueError(f"bucket size must be at least 1 element, got {bucket_elements}")
    return buckets_of(unit_ranges(layout), bucket_elements)


def buckets_of(units: list[Range], bucket_elements: int) -> list[Range]:
    """Buckets of whole ``units`` (contiguous ranges in layout order), in backward
    order: walking from the last unit, units join the current bucket until it
    would exceed ``bucket_elements``; a larger unit gets a bucket of its own.
    The rule of [`bucket_ranges`][mpishard.flat.bucket_ranges], for any units. Pure."""
    buckets: list[Range] = []
    stop = start = units[-1].stop if units else 0
    for unit in reversed(units):
        if start < stop and (stop - unit.start) > bucket_elements:
            buckets.append(Range(start, stop))
            stop = start
        start = unit.start
    if start < stop:
        buckets.append(Range(start, stop))
    return buckets


def split_range(n: int, parts: int, rank: int) -> Range:
    """Rank ``rank``'s piece of ``[0, n)`` cut into ``parts`` contiguous pieces.

    Pieces differ by at most one element, the longer ones first: 11 in 2 parts
    is ``[0, 6)`` and ``[6, 11)``. When ``parts`` divides ``n`` this is Megatron's
    ``[rank * n / parts, (rank + 1) * n / parts)``.

    Raises:
        ValueError: ``parts < 1`` or ``rank`` outside ``[0, parts)``.
    """
    if parts < 1 or not 0 <= rank < parts:
        raise ValueError(f"expecting 0 <= rank < parts, got rank={rank}, parts={parts}")
    base, extra = divmod(n, parts)
    start = rank * base + min(rank, extra)
    return Range(start, start + base + (rank < extra))


@dataclass(frozen=True)
class ParameterShard:
    """Build a model's parameters in ZeRO-3 shards: only data-parallel rank
    ``rank``'s shard of ``ranks``, ``shard_ranges(n, ranks)[rank]`` of its flat
    vector of ``n`` elements (the model's layout decides ``n``).

    Raises:
        ValueError: ``ranks < 1`` or ``rank`` outside ``[0, ranks)``.
    """

    rank: int
    ranks: int

    def __post_init__(self) -> None:
        if self.ranks < 1 or not 0 <= self.rank < self.ranks:
            raise ValueError(f"expecting 0 <= rank < ranks, got rank={self.rank}, "
                             f"ranks={self.ranks}")

    def range(self, n: int) -> Range:
        """This rank's shard of a vector of ``n`` elements."""
        return shard_ranges(n, self.ranks)[self.rank]


def shard_ranges(n: int, parts: int) -> list[Range]:
    """Split ``[0, n)`` into ``parts`` contiguous shards of ``ceil(n / parts)``.

    The last shards are shorter (or empty when ``n < parts``): the padding of a
    ZeRO partition is never materialised in parameter space, so it can never
    reach a parameter. Shard ``r`` belongs to data-parallel rank ``r``.
    """
    if parts < 1:
        raise ValueError(f"expecting at least 1 part, got {parts}")
    per = -(-n // parts) if n else 0
    return [Range(min(r * per, n), min((r + 1) * per, n)) for r in range(parts)]
