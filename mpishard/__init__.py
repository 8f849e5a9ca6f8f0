"""mpishard: MPI-native DDP, ZeRO-2, tensor, pipeline and elastic training of flat-vector models."""

from ._version import __version__
from .config import ShardingConfiguration
from .errors import CheckpointError, CommunicationError, MpiShardError, TopologyError
from .flat import ParamLayout, Range
from .groups import ProcessGroups
from .topology import Topology

__all__ = [
    "CheckpointError",
    "CommunicationError",
    "MpiShardError",
    "ParamLayout",
    "ProcessGroups",
    "Range",
    "ShardingConfiguration",
    "Topology",
    "TopologyError",
    "__version__",
]
