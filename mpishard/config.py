"""``ShardingConfiguration``: which communicator to train on and how to split it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .comm import FlatComm, ProcessGroups, from_comm
from .comm.abort import install_abort_hook
from .errors import TopologyError
from .topology import Topology

__all__ = ["ShardingConfiguration"]


@dataclass
class ShardingConfiguration:
    """The parallel layout of a training job.

    ``comm`` may be any intra-communicator: a simulation that owns
    ``MPI.COMM_WORLD`` can give the library a sub-communicator of it. The groups
    are built by the constructor, collectively over ``comm``: the library first
    duplicates ``comm`` (under the timeout), so its messages never mix with the
    caller's, and every later call goes through the groups' communicators.

    Args:
        comm: parent communicator; ``MPI.COMM_WORLD`` by default.
        tensor_parallel_size: ranks that split each layer.
        pipeline_parallel_size: stages the layers are cut into.
        data_parallel_size: replicas; ``-1`` means world / (tp * pp).
        abort_on_exception: install an exception hook that calls ``Abort`` on
            ``comm`` when a rank dies of an uncaught exception, so the other ranks
            do not wait in a collective forever.
        timeout: seconds any MPI call of the library may take before the job is
            aborted with a message naming the call, the group and the rank
            (``None``: wait forever).

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
        parent = from_comm(self.comm, "parent", self.timeout)
        self.comm = parent.comm
        world = parent.dup("world")
        # Every rank computes the same thing from the same arguments; should the
        # arguments differ between ranks, the agreement below still lets no rank hang.
        error = None
        try:
            self.topology = Topology.build(
                world.size, tp=self.tensor_parallel_size,
                pp=self.pipeline_parallel_size, dp=self.data_parallel_size)
        except TopologyError as exc:
            error = str(exc)
        world.agree(error, TopologyError)
        mine = (self.topology.dp, self.topology.tp, self.topology.pp)
        same = world.allreduce(mine == world.bcast(mine, root=0), op="land")
        world.agree(None if same else f"layout (dp, tp, pp) = {mine} differs between ranks",
                    TopologyError)
        self.data_parallel_size = self.topology.dp
        self._groups = ProcessGroups.split(world, self.topology)
        if self.abort_on_exception:
            install_abort_hook(world)

    @property
    def groups(self) -> ProcessGroups:
        """The process groups (``world``, ``dp``, ``tp``, ``pp``), one
        :class:`~mpishard.comm.FlatComm` each."""
        if self._groups is None:
            raise RuntimeError("this ShardingConfiguration was freed")
        return self._groups

    @property
    def world(self) -> FlatComm:
        """The library's communicator over all ranks of ``comm``."""
        return self.groups.world

    def free(self) -> None:
        """Free the groups. Collective over ``comm``."""
        if self._groups is not None:
            self._groups.free()
            self._groups = None
