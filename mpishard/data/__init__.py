"""Training data: the resumable sampler, in-memory and streaming datasets, and
rows that stay on the ranks that made them.

* `mpishard.data.sampler`: global batches of a shuffled epoch that do not
  depend on the number of ranks; the data position; the growth rule.
* [`ArrayDataset`][mpishard.data.ArrayDataset] (arrays every rank holds),
  [`StreamingDataset`][mpishard.data.StreamingDataset] (one that grows by
  [`append`][mpishard.data.StreamingDataset.append]).
* [`LocalDataset`][mpishard.data.LocalDataset]: the union of the rows each rank holds, each batch's
  rows moved by ``Alltoallv`` as it needs them.
* [`HDF5Dataset`][mpishard.data.hdf5.HDF5Dataset]: samples in an HDF5 file, each rank reading only
  its rows.
* [`BatchStream`][mpishard.data.BatchStream]: global batches as they arrive (a simulation's
  snapshots), one optimizer step each, until the iterator ends.
"""

from ..errors import DataPositionWarning
from .arrays import ArrayDataset, StreamingDataset
from .hdf5 import HDF5Dataset, parse_data_spec
from .local import LocalDataset
from .sampler import (
    BatchSplit,
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
    "HDF5Dataset",
    "LocalDataset",
    "SamplerState",
    "ShardedSampler",
    "StreamingDataset",
    "parse_data_spec",
    "position_conflicts",
    "rank_rows",
    "split_batch",
]
