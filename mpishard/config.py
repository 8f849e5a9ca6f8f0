"""``ShardingConfiguration``: which communicator to train on and how to split it."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any

from .comm import FlatComm, ProcessGroups, from_comm, ulfm
from .comm.abort import install_abort_hook
from .comm.stuck import register as register_ranks
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
        abort_on_exception: install an exception hook that calls ``MPI_Abort``
            when a rank dies of an uncaught exception, so the other ranks do not
            wait in a collective forever. ``MPI_Abort`` ends every process of
            the job, ranks outside ``comm`` (a simulation) included. With False
            the library never aborts: an exception is the caller's, and a call
            past ``timeout`` raises :class:`~mpishard.errors.CommunicationError`
            on the ranks that waited (the groups are unusable after it).
        timeout: seconds any MPI call of the library may take before the job is
            aborted (or, with ``abort_on_exception=False``, a
            ``CommunicationError`` is raised) with a message naming the call,
            the group and the rank (world rank, host, rank in the group); the
            constructor's own collectives included
            (``None``: wait forever).
        allow_tensor_across_nodes: accept, with a warning, a layout whose
            tensor-parallel groups cannot all stay inside one node (refused by
            default; see :class:`~mpishard.comm.ProcessGroups`).
        reproducible: train bit for bit the same at any data-parallel size, with
            DDP or ZeRO-2, pipelined or not, across a resize or a resharded
            restart (see :mod:`mpishard.parallel.repro`). Default off: the
            default mode's speed is unchanged.
        unit_rows: rows per unit of work in reproducible mode (a unit is rows
            ``[u * unit_rows, (u + 1) * unit_rows)`` of the global batch, computed
            alone on whatever rank holds it). ``None``: ``B // gcd(B, 24)`` for a
            global batch of ``B`` rows, so ``gcd(B, 24)`` units and any
            data-parallel size dividing that works (1, 2, 3, 4, 6, 8, 12, 24
            when 24 divides ``B``). A dataset's short last batch of an epoch
            (``drop_last=False``) runs in units of one row.
        reproducible_sizes: in reproducible mode, the data-parallel sizes (times
            the gradient-accumulation steps) whose bits must agree, such as
            ``(1, 2, 4)``: a global batch of ``B`` rows is then cut into
            ``gcd(B, lcm(sizes))`` units instead of ``gcd(B, 24)``. Fewer, larger
            units cost less (one forward/backward and one gradient per unit on
            each rank: at the largest size each rank computes one unit); other
            sizes are refused when they cut a unit. ``None``: all divisors of 24.
        fault_tolerance: ``"auto"`` (default): where the job runs under Open MPI 5
            started with ``mpirun --with-ft ulfm``, the groups return errors
            (``mpi4py.MPI.Exception``) when a rank dies instead of ending the job,
            so the survivors can go on in place
            (:func:`mpishard.recovery.recover_in_place`); ``"ulfm"``:
            the same, and an error where ULFM is not available; ``"off"``.
        evict_stuck: with ULFM on, a call past ``timeout`` SIGKILLs the ranks of
            its group on this host that did not arrive (stopped, looping,
            deadlocked) instead of aborting, and the survivors recover as from a
            death (:func:`mpishard.comm.ulfm.enable`).

    Raises:
        TopologyError: sizes that do not divide the communicator's size, or a
            tensor group that would cross nodes; on every rank.
        ValueError: ``unit_rows`` not a positive integer or None,
            ``reproducible_sizes`` not positive integers or given with ``unit_rows``.
    """

    comm: Any = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = -1
    abort_on_exception: bool = True
    timeout: float | None = None
    allow_tensor_across_nodes: bool = False
    reproducible: bool = False
    unit_rows: int | None = None
    reproducible_sizes: tuple[int, ...] | None = None
    fault_tolerance: str = "auto"
    evict_stuck: bool = False
    topology: Topology = field(init=False)
    _groups: ProcessGroups | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        if self.unit_rows is not None and (not isinstance(self.unit_rows, int)
                                           or isinstance(self.unit_rows, bool)
                                           or self.unit_rows < 1):
            raise ValueError(f"unit_rows must be a positive integer or None, "
                             f"got {self.unit_rows!r}")
        if self.reproducible_sizes is not None:
            self.reproducible_sizes = _sizes(self.reproducible_sizes, self.unit_rows)
        given = self.comm is not None
        parent = from_comm(self.comm, "parent", self.timeout)
        parent.abort_job = self.abort_on_exception
        # The first collective, under the timeout: a rank of ``comm`` that never
        # calls the constructor (busy elsewhere in a simulation) is named here, and
        # the message says what was waited for. A barrier on the temporary parent
        # object, so that no group made below keeps this activity in its messages.
        with parent.during(_construction(given, parent.size)):
            parent.barrier()
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
        self._groups = ProcessGroups.split(
            world, self.topology, allow_tensor_across_nodes=self.allow_tensor_across_nodes)
        # Each rank's pid and host, to name a stuck rank at a timeout (comm/stuck.py).
        register_ranks(world)
        if ulfm.wanted(self.fault_tolerance, world):
            g = self._groups
            ulfm.enable([g.world, g.dp, g.tp, g.pp], evict_stuck=self.evict_stuck)
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


def _construction(given: bool, size: int) -> str:
    """What the constructor's first collective waits for, for a timeout message."""
    if given:
        return (f"ShardingConfiguration(comm=...), which every one of the {size} ranks of "
                f"that communicator must call; a rank that does other work (a simulation) "
                f"must not be in it: pass comm= the communicator of the ranks that train")
    return (f"ShardingConfiguration() over MPI.COMM_WORLD (no comm= given), which every one "
            f"of its {size} ranks must call; where other ranks do other work (a "
            f"simulation), pass comm= the communicator of the ranks that train")


def _sizes(sizes: Any, unit_rows: int | None) -> tuple[int, ...]:
    """``reproducible_sizes`` as a tuple of ints.

    Raises:
        ValueError: not a non-empty sequence of positive integers, or given with
            ``unit_rows`` (which fixes the units itself).
    """
    try:
        values = list(sizes)
    except TypeError:
        values = None
    if not values or not all(isinstance(v, numbers.Integral) and not isinstance(v, bool)
                             and v >= 1 for v in values):
        raise ValueError(f"reproducible_sizes must be data-parallel sizes (positive "
                         f"integers) such as (1, 2, 4), got {sizes!r}")
    if unit_rows is not None:
        raise ValueError(f"give unit_rows ({unit_rows}) or reproducible_sizes "
                         f"({tuple(int(v) for v in values)}), not both: each sets the units")
    return tuple(int(v) for v in values)
