"""Tensor shards: which slice of which logical tensor a rank holds (pure metadata).

[`TensorShard`][mpishard.nn.TensorShard] says which slice of which *logical* (unpartitioned) tensor
a rank holds, and whether every rank of the tensor-parallel group holds the same
full tensor (``replicated``). Checkpoints write logical tensors from these
records; a global gradient norm counts each logical element once by summing over
[`owned_ranges`][mpishard.nn.owned_ranges]. Nothing here imports a layer, so layers can name it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..flat import ParamLayout, Range, split_range

__all__ = ["TensorShard", "owned_ranges", "split_range", "tensor_shards"]


# -- tensor shards: pure metadata ---------------------------------------------------


@dataclass(frozen=True)
class TensorShard:
    """The part of one logical tensor that a rank holds.

    Attributes:
        logical_name: the tensor's name in the unpartitioned model.
        logical_shape: its shape there.
        index: one ``slice(start, stop)`` per axis: this rank's tensor is
            ``logical[index]``.
        replicated: every rank of the tensor-parallel group holds this same full
            tensor (a norm must count it once; one rank writes it). Serial
            models: always True.
    """

    logical_name: str
    logical_shape: tuple[int, ...]
    index: tuple[slice, ...]
    replicated: bool

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the local tensor."""
        return tuple(s.stop - s.start for s in self.index)

    @classmethod
    def full(cls, name: str, shape: Sequence[int]) -> TensorShard:
        """The whole tensor, replicated."""
        shape = tuple(int(n) for n in shape)
        return cls(name, shape, tuple(slice(0, n) for n in shape), True)

    @classmethod
    def split(cls, name: str, shape: Sequence[int], axis: int, parts: int,
              rank: int) -> TensorShard:
        """Rank ``rank``'s piece of axis ``axis`` cut in ``parts``
        ([`split_range`][mpishard.flat.split_range])."""
        shape = tuple(int(n) for n in shape)
        r = split_range(shape[axis], parts, rank)
        index = tuple(slice(r.start, r.stop) if a == axis else slice(0, n)
                      for a, n in enumerate(shape))
        return cls(name, shape, index, parts == 1)

    def renamed(self, name: str) -> TensorShard:
        return dataclasses.replace(self, logical_name=name)


def tensor_shards(model: Any) -> dict[str, TensorShard]:
    """The shard record of every tensor of ``model``'s layout, by local name.

    Uses ``model.tensor_shards()`` when the model has it; any other
    [`Model`][mpishard.protocols.Model] holds every tensor in full (serial).
    """
    method = getattr(model, "tensor_shards", None)
    if method is not None:
        return method()
    return {s.name: TensorShard.full(s.name, s.shape) for s in model.layout}


def owned_ranges(layout: ParamLayout, shards: dict[str, TensorShard],
                 tp_rank: int) -> list[Range]:
    """World ranges of the tensors this tensor-parallel rank *owns*, merged.

    A rank owns its slices of split tensors, and the replicated tensors if it
    is tensor-parallel rank 0. Summing squares over the owned ranges and then
    over the tensor-parallel group counts every logical element exactly once
    (gradient clipping); writing them writes every element of a checkpoint once.
    """
    ranges: list[Range] = []
    for spec in layout:
        if shards[spec.name].replicated and tp_rank != 0:
            continue
        r = spec.range
        if ranges and ranges[-1].stop == r.start:
            ranges[-1] = Range(ranges[-1].start, r.stop)
        elif len(r):
            ranges.append(r)
    return ranges
