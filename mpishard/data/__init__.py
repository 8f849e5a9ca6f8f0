"""Training data: the resumable sampler, in-memory and streaming datasets, and
rows that stay on the ranks that made them.

* :mod:`~mpishard.data.sampler`: global batches of a shuffled epoch that do not
  depend on the number of ranks; the data position; the growth rule.
* :class:`ArrayDataset` (arrays every rank holds), :class:`StreamingDataset`
  (one that grows by :meth:`~StreamingDataset.append`).
* :class:`LocalDataset`: the union of the rows each rank holds, each batch's
  rows moved by ``Alltoallv`` as it needs them.
* :class:`BatchStream`: global batches as they arrive (a simulation's
  snapshots), one optimizer step each, until the iterator ends.
"""

from .arrays import ArrayDataset, StreamingDataset
from .local import LocalDataset
from .sampler import (
    BatchSplit,
    DataPositionWarning,
    SamplerState,
    ShardedSampler,
    position_conflicts,
    rank_rows,
    split_batch,
)
from .stream import BatchStream

__all__ = [
    "ArrayDataset",
    "BatchSplit",
    "BatchStream",
    "DataPositionWarning",
    "LocalDataset",
    "SamplerState",
    "ShardedSampler",
    "StreamingDataset",
    "position_conflicts",
    "rank_rows",
    "split_batch",
]
