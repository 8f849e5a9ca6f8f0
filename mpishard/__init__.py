"""mpishard: MPI-native DDP, ZeRO-2, tensor, pipeline and elastic training of flat-vector models."""

from ._threads import limit_threads as _limit_threads

_limit_threads()   # before NumPy is imported below: see mpishard/_threads.py

from ._version import __version__  # noqa: E402
from .config import ShardingConfiguration  # noqa: E402
from .errors import CheckpointError, CommunicationError, MpiShardError, TopologyError  # noqa: E402
from .flat import ParamLayout, Range  # noqa: E402
from .groups import ProcessGroups  # noqa: E402
from .topology import Topology  # noqa: E402

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
