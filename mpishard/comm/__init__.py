"""The comm layer: every MPI call of the library, one ``FlatComm`` per group."""

from .communicator import OPS, FlatComm, Handle, from_comm, world_rank_and_host
from .cuda import cuda_aware, cuda_aware_reason
from .deadlines import Deadlines
from .devices import GpuChoice, choose_gpu, gpu_map
from .groups import ProcessGroups
from .info import mpi_library_info, reproducibility_info, reproducibility_line, world_rank
from .nodes import NodeMap, node_map
from .watchdog import hdf5_deadline

__all__ = ["OPS", "Deadlines", "FlatComm", "GpuChoice", "Handle", "NodeMap", "ProcessGroups",
           "choose_gpu", "cuda_aware", "cuda_aware_reason", "from_comm", "gpu_map",
           "hdf5_deadline", "mpi_library_info", "node_map", "reproducibility_info",
           "reproducibility_line", "world_rank",
           "world_rank_and_host"]
