"""``ShardingConfiguration``: which communicator to train on and how to split it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mpi4py import MPI

from .errors import TopologyError, agree
from .groups import ProcessGroups
from .topology import Topology

__all__ = ["ShardingConfiguration"]


@dataclass
class ShardingConfiguration:
    """The parallel layout of a training job.

    ``comm`` may be any intra-communicator: a simulation that owns
    ``MPI.COMM_WORLD`` can give the library a sub-communicator of it. The groups
    are built on first use (:attr:`groups`), collectively over ``comm``.

    Args:
        comm: parent communicator; ``MPI.COMM_WORLD`` by default.
        tensor_parallel_size: ranks that split each layer.
        pipeline_parallel_size: stages the layers are cut into.
        data_parallel_size: replicas; ``-1`` means world / (tp * pp).
        abort_on_exception: install an exception hook that calls ``Abort`` on
            ``comm`` when a rank dies of an uncaught exception, so the other ranks
            do not wait in a collective forever.
        timeout: seconds a collective may take before the job is aborted with a
            message naming it (``None``: wait forever).

    Raises:
        TopologyError: sizes that do not divide the communicator's size, on every rank.
    """

    comm: Any = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = -1
    abort_on_exception: bool = True
    timeout: float | None = None
    topology: Topology = field(init=False)
    _groups: ProcessGroups | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        if self.comm is None:
            self.comm = MPI.COMM_WORLD
        if not isinstance(self.comm, MPI.Intracomm) or self.comm == MPI.COMM_NULL:
            raise TypeError(f"expecting an MPI intra-communicator, got {self.comm!r}")
        # Every rank computes the same thing from the same arguments; should the
        # arguments differ between ranks, the agreement below still lets no rank hang.
        error = None
        try:
            self.topology = Topology.build(
                self.comm.Get_size(), tp=self.tensor_parallel_size,
                pp=self.pipeline_parallel_size, dp=self.data_parallel_size)
        except TopologyError as exc:
            error = str(exc)
        agree(self.comm, error, TopologyError)
        mine = (self.topology.dp, self.topology.tp, self.topology.pp)
        if self.comm.Get_size() > 1:
            same = self.comm.allreduce(mine == self.comm.bcast(mine, root=0), op=MPI.LAND)
            agree(self.comm, None if same else
                  f"layout (dp, tp, pp) = {mine} differs between ranks", TopologyError)
        self.data_parallel_size = self.topology.dp
        if self.abort_on_exception:
            from .abort import install_abort_hook

            install_abort_hook(self.comm)

    @property
    def groups(self) -> ProcessGroups:
        """The process groups, split on first use. Collective over ``comm`` then."""
        if self._groups is None:
            self._groups = ProcessGroups.split(self.comm, self.topology)
        return self._groups

    def free(self) -> None:
        """Free the groups, if they were made. Collective over ``comm``."""
        if self._groups is not None:
            self._groups.free()
            self._groups = None
