"""Splitting global batches across data-parallel ranks; the resumable sampler.

The sampler's order depends only on ``(seed, epoch)`` and the global batch size,
never on the number of ranks: global batch ``b`` of an epoch is the same set of
samples whichever world trains on it, and data-parallel rank ``r`` of ``N`` takes
rows ``[r * B/N, (r + 1) * B/N)`` of it. A serial run on the global batch and a
distributed run therefore see the same data, and a job resized between steps
(elastic training, a restart at another size) goes on without repeating or
skipping a sample within the epoch: the position is counted in samples.

**Growing data** (samples streamed in while training runs): the data may grow,
never shrink, between ``optimize()`` calls; new samples are appended after the
existing ones. Each epoch covers the samples present when it starts: an epoch
in progress finishes over its ``num_samples`` in its own order, and the next
one shuffles all of them. The position records the current epoch's
``num_samples``, so a restore goes on exactly there.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..errors import DataPositionWarning

__all__ = ["BatchSplit", "DataPositionWarning", "SamplerState", "ShardedSampler",
           "position_conflicts", "rank_rows", "split_batch"]



@dataclass(frozen=True)
class BatchSplit:
    """How one global batch is cut: per rank, then per micro-batch."""

    global_size: int
    ranks: int
    micro_batches: int

    @property
    def local_size(self) -> int:
        return self.global_size // self.ranks

    @property
    def micro_size(self) -> int:
        return self.local_size // self.micro_batches

    def local_range(self, rank: int) -> tuple[int, int]:
        """Rows of the global batch that data-parallel ``rank`` trains on."""
        return rank * self.local_size, (rank + 1) * self.local_size


def split_batch(global_size: int, ranks: int, micro_batches: int = 1) -> BatchSplit:
    """Check that a global batch splits evenly and say how.

    Raises:
        ValueError: the global batch does not divide into ``ranks`` equal local
            batches of ``micro_batches`` equal micro-batches each.
    """
    if not isinstance(global_size, (int, np.integer)) or global_size < 1:
        raise ValueError(f"batch size must be a positive integer, got {global_size!r}")
    if micro_batches < 1:
        raise ValueError(f"micro-batches must be at least 1, got {micro_batches}")
    parts = ranks * micro_batches
    if global_size % parts:
        raise ValueError(
            f"global batch size {global_size} does not split across {ranks} data-parallel "
            f"rank(s) x {micro_batches} micro-batch(es): expecting a multiple of {parts}")
    return BatchSplit(int(global_size), ranks, micro_batches)


@dataclass
class SamplerState:
    """Where a sampler is: what a checkpoint stores under ``/data``."""

    epoch: int = 0
    samples_consumed: int = 0   # within the epoch, counted in samples, not batches
    seed: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


class ShardedSampler:
    """Global batches of a shuffled epoch; each rank asks for its rows.

    Args:
        num_samples: size of the dataset.
        batch_size: global batch size.
        seed: shuffle seed; epoch ``e`` uses the permutation of ``(seed, e)``.
        shuffle: ``False`` keeps the dataset order.
        drop_last: ``True`` (the default) drops the last incomplete batch of an
            epoch, so every step sees a full global batch and the loss is the mean
            over exactly ``batch_size`` samples; ``False`` makes it a last, short
            batch ([`current_batch_size`][mpishard.data.ShardedSampler.current_batch_size] says how
            long).
    """

    def __init__(self, num_samples: int, batch_size: int, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = True) -> None:
        if batch_size > num_samples:
            raise ValueError(f"global batch size {batch_size} is larger than the dataset "
                             f"({num_samples} samples)")
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.state = SamplerState(seed=seed)
        self._order = np.empty(num_samples, dtype=np.int64)
        self._order_epoch = -1
        self._available = num_samples   # samples in the data; the next epoch covers them

    @property
    def batches_per_epoch(self) -> int:
        if self.drop_last:
            return self.num_samples // self.batch_size
        return -(-self.num_samples // self.batch_size)

    def order(self, epoch: int) -> np.ndarray:
        """The sample order of ``epoch`` (cached: one permutation per epoch)."""
        if self._order_epoch != epoch:
            if self.shuffle:
                rng = np.random.default_rng([self.state.seed, epoch])
                self._order[:] = rng.permutation(self.num_samples)
            else:
                self._order[:] = np.arange(self.num_samples)
            self._order_epoch = epoch
        return self._order

    def remaining_in_epoch(self) -> int:
        """Global batches left in the current epoch (a short last one counted
        unless ``drop_last``)."""
        left = self.num_samples - self.state.samples_consumed
        return left // self.batch_size if self.drop_last else -(-left // self.batch_size)

    def current_batch_size(self) -> int:
        """Samples in the current global batch: ``batch_size``, or fewer for the
        last batch of an epoch when not ``drop_last``."""
        return min(self.batch_size, self.num_samples - self.state.samples_consumed)

    def batch_indices(self, start: int, stop: int) -> np.ndarray:
        """Indices of rows ``[start, stop)`` of the current global batch (a view)."""
        s = self.state.samples_consumed
        return self.order(self.state.epoch)[s + start:s + stop]

    def advance(self) -> None:
        """Move past the current global batch; roll over to the next epoch at its end."""
        self.state.samples_consumed += self.current_batch_size()
        self.roll_over()

    def roll_over(self) -> None:
        """Start the next epoch if no batch is left in this one (also after a
        restore at another batch size, where the rest may be shorter than a batch)."""
        if self.remaining_in_epoch() == 0:
            self.state.epoch += 1
            self.state.samples_consumed = 0
            self._resize()   # samples that arrived during the epoch join from here

    def load_state(self, state: SamplerState | dict[str, int]) -> None:
        if isinstance(state, dict):
            state = SamplerState(int(state["epoch"]), int(state["samples_consumed"]),
                                 int(state["seed"]))
        self.state = SamplerState(state.epoch, state.samples_consumed, state.seed)
        self._order_epoch = -1

    def position(self) -> dict[str, int]:
        """The data position as a strategy's ``data_position`` holds it (and a
        checkpoint stores under ``/data``): epoch, samples_consumed, seed,
        batch_size, num_samples, shuffle, all ints."""
        s = self.state
        return {"epoch": s.epoch, "samples_consumed": s.samples_consumed, "seed": s.seed,
                "batch_size": self.batch_size, "num_samples": self.num_samples,
                "shuffle": int(bool(self.shuffle))}

    @classmethod
    def from_position(cls, position: dict[str, int], batch_size: int,
                      drop_last: bool = True, *, seed: int = 0, shuffle: bool = True,
                      num_samples: int | None = None) -> ShardedSampler:
        """A sampler at ``position`` (a strategy's ``data_position``), with global
        batch ``batch_size``. The position is counted in samples, so a new batch
        size (an elastic resize under ``scale-lr``) neither repeats nor skips a
        sample of the epoch. ``seed``, ``shuffle`` and ``num_samples`` (the data's
        size now) stand in for keys the position lacks (an older or hand-made
        one); a larger ``num_samples`` is growth ([`grow`][mpishard.data.ShardedSampler.grow]).

        Raises:
            ValueError: ``num_samples`` is smaller than the position's epoch covers.
        """
        have = int(position.get("num_samples", num_samples if num_samples is not None else 0))
        sampler = cls(have, batch_size, seed=int(position.get("seed", seed)),
                      shuffle=bool(position.get("shuffle", shuffle)), drop_last=drop_last)
        sampler.load_state({"epoch": int(position["epoch"]),
                            "samples_consumed": int(position["samples_consumed"]),
                            "seed": sampler.state.seed})
        if num_samples is not None:
            sampler.grow(num_samples)
        sampler.roll_over()
        return sampler

    def grow(self, num_samples: int) -> None:
        """The data now holds ``num_samples`` (appended after the old ones). The
        epoch in progress keeps its own samples and order; the new size takes
        effect when the next epoch starts (at once if this one has not started).

        Raises:
            ValueError: fewer samples than the current epoch covers.
        """
        if num_samples < self.num_samples:
            raise ValueError(
                f"the data has {num_samples} samples but the data position (restored "
                f"from a checkpoint, or left by an earlier optimize()) counts "
                f"{self.num_samples} in its epoch: data may only grow; call new_pass() "
                f"to start over on other data")
        self._available = num_samples
        if self.state.samples_consumed == 0:
            self._resize()

    def _resize(self) -> None:
        if self._available != self.num_samples:
            self.num_samples = self._available
            self._order = np.empty(self.num_samples, dtype=np.int64)
            self._order_epoch = -1


def rank_rows(rows: int, ranks: int, rank: int) -> tuple[int, int]:
    """The part ``[lo, hi)`` of ``rows`` rows that ``rank`` of ``ranks`` takes: as
    even as possible (sizes differ by at most one), so a
    batch that divides evenly gives every rank ``rows // ranks`` rows."""
    return rank * rows // ranks, (rank + 1) * rows // ranks


def position_conflicts(position: dict[str, Any], *, seed: int | None,
                       shuffle: bool | None, batch_size: int | None) -> list[str]:
    """What an ``optimize()`` call asks for that differs from the data position it
    continues (restored from a checkpoint, or left by an earlier call), each with
    what is used instead. Arguments passed as None (not given) and keys the
    position lacks (an older checkpoint: unknown) are not compared."""
    found = []
    if seed is not None and "seed" in position and int(position["seed"]) != int(seed):
        found.append(f"seed={seed} differs from the data position's seed "
                     f"{int(position['seed'])}: the pass goes on with seed "
                     f"{int(position['seed'])} (call new_pass() to start one with seed={seed})")
    if (shuffle is not None and "shuffle" in position
            and bool(position["shuffle"]) != bool(shuffle)):
        found.append(f"shuffle={bool(shuffle)} differs from the data position's "
                     f"shuffle={bool(position['shuffle'])}: the pass goes on with "
                     f"shuffle={bool(position['shuffle'])} (call new_pass() to change it)")
    if (batch_size is not None and "batch_size" in position
            and int(position["batch_size"]) != int(batch_size)):
        found.append(f"batch_size={batch_size} differs from the data position's global "
                     f"batch {int(position['batch_size'])}: training goes on with "
                     f"batch_size={batch_size} from sample {int(position['samples_consumed'])} "
                     f"of epoch {int(position['epoch'])} (the position is counted in "
                     f"samples, so none is repeated or skipped), but the steps differ from "
                     f"those of a run that kept {int(position['batch_size'])}")
    return found
