"""Pure rank arithmetic of the (data, tensor, pipeline) grid; no MPI here.

The grid order is ``tp-dp-pp``: tensor parallel innermost, so that the ranks of a
tensor group are neighbours (same node, fastest link); pipeline outermost::

    rank = (pp_rank * dp + dp_rank) * tp + tp_rank

Worked example, 8 ranks, tp=2, dp=2, pp=2::

    rank      0 1 2 3 4 5 6 7
    tp_rank   0 1 0 1 0 1 0 1
    dp_rank   0 0 1 1 0 0 1 1
    pp_rank   0 0 0 0 1 1 1 1

    tensor groups   {0,1} {2,3} {4,5} {6,7}
    data groups     {0,2} {1,3} {4,6} {5,7}
    pipeline groups {0,4} {1,5} {2,6} {3,7}

Stage 0 holds ranks 0-3 and stage 1 ranks 4-7.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from .errors import TopologyError

__all__ = ["Coordinates", "Topology"]


@dataclass(frozen=True)
class Coordinates:
    """Where one rank sits in the grid."""

    dp: int
    tp: int
    pp: int


@dataclass(frozen=True)
class Topology:
    """A ``world = dp * tp * pp`` grid in ``tp-dp-pp`` order (see the module doc)."""

    world: int
    dp: int
    tp: int
    pp: int

    @classmethod
    def build(cls, world: int, tp: int = 1, pp: int = 1, dp: int = -1) -> Topology:
        """Check the sizes against ``world`` and fill in ``dp = -1`` ("what is left").

        Raises:
            TopologyError: a size is not a positive integer, or the sizes do not
                multiply to ``world``; the message names the numbers.
        """
        for name, value in (("world size", world), ("tensor_parallel_size", tp),
                            ("pipeline_parallel_size", pp)):
            if (not isinstance(value, numbers.Integral) or isinstance(value, bool)
                    or value < 1):
                raise TopologyError(f"{name} must be a positive integer, got {value!r}")
        if (not isinstance(dp, numbers.Integral) or isinstance(dp, bool)
                or (dp < 1 and dp != -1)):
            raise TopologyError(
                f"data_parallel_size must be a positive integer or -1, got {dp!r}")
        world, tp, pp, dp = int(world), int(tp), int(pp), int(dp)   # NumPy integers too
        if dp == -1:
            if world % (tp * pp):
                raise TopologyError(
                    f"world size {world} is not divisible by tensor_parallel_size {tp} "
                    f"* pipeline_parallel_size {pp} = {tp * pp}")
            dp = world // (tp * pp)
        elif dp * tp * pp != world:
            raise TopologyError(
                f"data_parallel_size {dp} * tensor_parallel_size {tp} * "
                f"pipeline_parallel_size {pp} = {dp * tp * pp}, expecting the world "
                f"size {world}")
        return cls(world=world, dp=dp, tp=tp, pp=pp)

    def coordinates(self, rank: int) -> Coordinates:
        """The (dp, tp, pp) coordinates of ``rank``."""
        self._check_rank(rank)
        tp_rank = rank % self.tp
        dp_rank = (rank // self.tp) % self.dp
        pp_rank = rank // (self.tp * self.dp)
        return Coordinates(dp=dp_rank, tp=tp_rank, pp=pp_rank)

    def rank(self, dp: int, tp: int, pp: int) -> int:
        """The rank at coordinates (dp, tp, pp)."""
        if not (0 <= dp < self.dp and 0 <= tp < self.tp and 0 <= pp < self.pp):
            raise TopologyError(
                f"coordinates dp={dp} tp={tp} pp={pp} outside the grid "
                f"dp={self.dp} tp={self.tp} pp={self.pp}")
        return (pp * self.dp + dp) * self.tp + tp

    def data_group(self, rank: int) -> list[int]:
        """Ranks that hold the same model shard as ``rank`` (same tp and pp)."""
        c = self.coordinates(rank)
        return [self.rank(d, c.tp, c.pp) for d in range(self.dp)]

    def tensor_group(self, rank: int) -> list[int]:
        """Ranks that split the same layers with ``rank`` (same dp and pp)."""
        c = self.coordinates(rank)
        return [self.rank(c.dp, t, c.pp) for t in range(self.tp)]

    def pipeline_group(self, rank: int) -> list[int]:
        """Ranks that hold the successive stages of ``rank``'s replica (same dp and tp)."""
        c = self.coordinates(rank)
        return [self.rank(c.dp, c.tp, p) for p in range(self.pp)]

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world:
            raise TopologyError(f"rank {rank} outside a world of size {self.world}")
