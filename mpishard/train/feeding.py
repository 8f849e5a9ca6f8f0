"""Feeding the loop: this rank's rows of each global batch, and the data position.

A dataset (an ``(x, y)`` pair, a [`Dataset`][mpishard.protocols.Dataset] or a
[`CollectiveDataset`][mpishard.protocols.CollectiveDataset]) is read through the resumable
sampler (`mpishard.data.sampler`); a [`BatchStream`][mpishard.data.BatchStream] one
global batch per step, as it comes. The rules (epochs are a total, the data
position wins, data may grow, streams) are on the docs site's training-loop page.
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Iterator
from typing import Any, NamedTuple

from ..comm.stuck import reading_data_source
from ..data import (
    ArrayDataset,
    BatchStream,
    DataPositionWarning,
    SamplerState,
    ShardedSampler,
    position_conflicts,
    rank_rows,
    split_batch,
)
from ..protocols import CollectiveDataset, Dataset, Model, StrategyCore
from .options import Sampling

__all__ = ["Batch", "Feeder"]


class Batch(NamedTuple):
    """This rank's rows ``x``, ``y`` of a global batch of ``rows`` rows, which start
    at row ``start`` of it."""

    x: Any
    y: Any
    start: int
    rows: int


class Feeder:
    """This rank's rows of each global batch, into buffers made once, and the data
    position (``core.data_position``, kept current after every step).

    Building it opens the data at the core's data position, with every check
    agreed over the world (a ``ValueError`` on every rank). Collective over
    ``core.config.world``.
    """

    def __init__(self, core: StrategyCore, model: Model, data: Any, epochs: int | None,
                 batch_size: int | None, sampling: Sampling) -> None:
        self.core, self.model, self.data = core, model, data
        self.epochs, self.batch_size, self.sampling = epochs, batch_size, sampling
        self.stream = data if isinstance(data, BatchStream) else None
        # A pipelined model cuts each micro-batch again into its own micro-batches.
        self.pipeline = getattr(model, "micro_batches", 1)
        self.parts = core.accumulation_steps * self.pipeline
        self.open(sampling.batch_size_may_change)

    def open(self, may_change: bool) -> None:
        """Open the data at the core's data position, this rank's buffers for its
        rows (again after a recovery: the rows re-split over the survivors).
        Collective over the world."""
        core = self.core
        if self.stream is not None:
            self.state = SamplerState()   # a stream has no epochs: epoch 0
            self.position = _open_stream(core, self.stream, self.epochs, self.batch_size,
                                         self.sampling)
        else:
            self.dataset, self.collective, self.sampler, split = _open_dataset(
                core, self.data, self.epochs, self.batch_size, self.sampling, may_change,
                self.parts)
            self.local = split.local_size
            self.x, self.y = self.dataset.buffers(self.local, core.xp, core.dtype)
            self.state = self.sampler.state
            self.position = self.sampler.position()
        core.set_progress(data_position=self.position)

    @property
    def epoch(self) -> int:
        """Epochs complete (a stream: 0)."""
        return self.state.epoch

    @property
    def per_epoch(self) -> int | None:
        """Steps per epoch (None for a stream)."""
        return None if self.stream is not None else self.sampler.batches_per_epoch

    def finished(self) -> bool:
        """``epochs`` epochs are complete in total (never, for a stream)."""
        return self.stream is None and self.state.epoch >= self.epochs

    def next(self) -> Batch | None:
        """This rank's rows of the next global batch; None when a stream ended.
        A stream's batch is read only now (a stop before reads none). Collective
        over the world for a stream or a collective dataset; local otherwise."""
        core = self.core
        if self.stream is not None:
            try:
                got = reading_data_source(
                    self.stream.read, core.config.world, core.dp, core.xp, core.dtype,
                    batch_size=self.batch_size,
                    equal_parts=self.parts if self.pipeline > 1 else 1)
            finally:
                # A refused batch was read from the iterator too: the position
                # counts it (the stream's index is past it), as the caller's does.
                self.position["batches"] = self.stream.index
            return None if got is None else Batch(*got)
        rows = self.sampler.current_batch_size()
        lo, hi = rank_rows(rows, core.dp.size, core.dp.rank)
        n = hi - lo
        x, y = (self.x, self.y) if n == self.local else (self.x[:n], self.y[:n])
        # Through reading_data_source: a rank stuck in the user's data is named so.
        if self.collective:   # the rows come from the ranks that hold them
            reading_data_source(self.dataset.gather_batch,
                                self.sampler.batch_indices(0, rows), x, y)
        else:
            reading_data_source(self.dataset.gather, self.sampler.batch_indices(lo, hi), x, y)
        return Batch(x, y, lo, rows)

    def advance(self, rows: int) -> bool:
        """Move the data position past a trained batch of ``rows``; True when it
        completed an epoch. Local."""
        position = self.position
        if self.stream is not None:
            position["batches"] = self.stream.index
            position["samples_consumed"] += rows
            position["num_samples"] = position["samples_consumed"]
            position["batch_size"] = rows
            return False
        before = self.state.epoch
        self.sampler.advance()
        position["epoch"] = self.state.epoch
        position["samples_consumed"] = self.state.samples_consumed
        position["num_samples"] = self.sampler.num_samples   # grown data joins at an epoch
        return self.state.epoch != before


def _open_dataset(core: StrategyCore, data: Any, epochs: Any, batch_size: Any,
                  sampling: Sampling, batch_size_may_change: bool,
                  parts: int) -> tuple[Any, bool, ShardedSampler, Any]:
    """The dataset (an ``(x, y)`` pair wrapped), whether it is collective, the
    sampler at the core's data position, and the batch split, checked on every
    rank (warnings on rank 0). Collective over the world."""
    world, dp = core.config.world, core.dp
    collective = isinstance(data, CollectiveDataset)
    dataset, problem = data, None
    if isinstance(data, Iterator):   # unpacking it would consume a live stream
        problem = (f"data is an iterator ({type(data).__name__}): wrap an iterator of "
                   f"(inputs, targets) batches in mpishard.data.BatchStream")
    elif not (collective or isinstance(data, Dataset)):
        try:   # an (inputs, targets) pair; the same check on every rank
            dataset = ArrayDataset(*data)
        except (TypeError, ValueError) as exc:
            problem = (f"expecting an (inputs, targets) pair of arrays (or of lists of "
                       f"numbers, converted once), a Dataset, a LocalDataset or a "
                       f"BatchStream: {exc}")
    world.agree(problem, ValueError)
    problem, sampler, split = None, None, None
    # Every rank must see the same number of samples (a stream appended to on
    # one rank only would otherwise train different batches on each).
    lengths = (world.allreduce(len(dataset), op="min"), world.allreduce(len(dataset), op="max"))
    held = core.data_position
    try:
        if epochs is None or batch_size is None:
            raise ValueError(f"training on a {type(dataset).__name__} needs epochs and "
                             f"batch_size, got epochs={epochs!r}, batch_size={batch_size!r}")
        if held is not None and "batches" in held:
            raise ValueError(f"the data position is a stream's ({held['batches']} batches "
                             f"read): call new_pass() to train on a dataset")
        if lengths[0] != lengths[1]:
            raise ValueError(f"the ranks hold data of different lengths: {len(dataset)} "
                             f"samples here, between {lengths[0]} and {lengths[1]} over the "
                             f"world; every rank passes the same data (or a LocalDataset)")
        if collective and getattr(dataset.comm, "comm", None) is not dp.comm:
            raise ValueError(f"{type(dataset).__name__} exchanges rows over the "
                             f"{dataset.comm.name} group, but the strategy's data-parallel "
                             f"group is another: build it with the strategy's configuration")
        if (collective and held is not None and int(held["samples_consumed"]) > 0
                and int(held.get("num_samples", len(dataset))) != len(dataset)):
            # Rows added on any rank but the last shift the union's indices: the
            # rest of the epoch would repeat some samples and skip others.
            raise ValueError(f"the rank-local data changed from {held['num_samples']} to "
                             f"{len(dataset)} samples in the middle of epoch "
                             f"{held['epoch']}: finish the epoch on the rows it started "
                             f"with, or call new_pass()")
        split = split_batch(batch_size, dp.size, parts)
        if not sampling.drop_last and parts > core.accumulation_steps:
            raise ValueError("drop_last=False is not available for a pipelined model "
                             f"({parts // core.accumulation_steps} micro-batches): its "
                             f"micro-batches must be equal")
        if not isinstance(epochs, numbers.Integral) or epochs < 0:
            raise ValueError(f"epochs must be a non-negative integer, got {epochs!r}")
        sampler = _sampler(held, len(dataset), batch_size, sampling)
    except ValueError as exc:
        problem = str(exc)
    world.agree(problem, ValueError)
    if held is not None and world.rank == 0:
        for text in position_conflicts(held, seed=sampling.seed, shuffle=sampling.shuffle,
                                       batch_size=None if batch_size_may_change else batch_size):
            warnings.warn(f"optimize(): {text}", DataPositionWarning, stacklevel=5)
    assert sampler is not None and split is not None
    return dataset, collective, sampler, split


def _open_stream(core: StrategyCore, stream: BatchStream, epochs: Any, batch_size: Any,
                 sampling: Sampling) -> dict[str, int]:
    """The data position of a stream placed at the core's (batches before it
    skipped, or none): ``batches`` (the index of the next batch) and
    ``samples_consumed`` (the rows read before it), the other keys of a
    position (``epoch`` 0, ``num_samples`` = ``samples_consumed``, ``seed``
    and ``shuffle`` 0, ``batch_size`` the last batch's rows) for checkpoints.
    Collective over the world."""
    world = core.config.world
    held, problem = core.data_position, None
    seed, shuffle = sampling.seed, sampling.shuffle
    if epochs is not None:
        problem = (f"a BatchStream has no epochs: it trains one step per batch until it "
                   f"ends (or max_steps, a stop); got epochs={epochs!r}, expecting None")
    elif seed is not None or shuffle is not None:
        problem = (f"a BatchStream yields its batches in its own order: seed and shuffle "
                   f"do not apply (got seed={seed!r}, shuffle={shuffle!r})")
    elif batch_size is not None and (not isinstance(batch_size, numbers.Integral)
                                     or batch_size < 1):
        problem = f"batch_size must be a positive integer or None, got {batch_size!r}"
    elif held is not None and "batches" not in held:
        problem = (f"the data position is a dataset's (epoch {held['epoch']}, "
                   f"{held['samples_consumed']} samples in): call new_pass() to train on "
                   f"a stream")
    world.agree(problem, ValueError)
    at = None if held is None else int(held["batches"])
    index = stream.start(at, world)
    consumed = 0 if held is None else int(held["samples_consumed"])
    last = int(held["batch_size"]) if held is not None else int(batch_size or 0)
    return {"epoch": 0, "samples_consumed": consumed, "seed": 0, "batch_size": last,
            "num_samples": consumed, "shuffle": 0, "batches": index}


def _sampler(position: dict[str, int] | None, num_samples: int, batch_size: int,
             sampling: Sampling) -> ShardedSampler:
    """A sampler at the core's data position (its epoch finishing over the
    samples it started with; more samples join at the next epoch), or at the
    start of epoch 0."""
    seed = 0 if sampling.seed is None else sampling.seed
    shuffle = True if sampling.shuffle is None else sampling.shuffle
    if position is None:
        return ShardedSampler(num_samples, batch_size, seed=seed, shuffle=shuffle,
                              drop_last=sampling.drop_last)
    if batch_size > num_samples:
        raise ValueError(f"global batch size {batch_size} is larger than the dataset "
                         f"({num_samples} samples)")
    return ShardedSampler.from_position(position, batch_size, sampling.drop_last, seed=seed,
                                        shuffle=shuffle, num_samples=num_samples)
