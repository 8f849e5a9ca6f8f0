"""``ShardingConfiguration``: which communicator to train on and how to split it."""

from __future__ import annotations

import numbers
import os
from dataclasses import InitVar, dataclass, field
from typing import Any

from .comm import Deadlines, FlatComm, ProcessGroups, from_comm, ulfm
from .comm.abort import install_abort_hook
from .comm.spares import SparePool
from .comm.stuck import register as register_ranks
from .errors import CommunicationError, MpiShardError, TopologyError
from .topology import Topology

__all__ = ["ShardingConfiguration", "default_spares"]


@dataclass
class ShardingConfiguration:
    """The parallel layout of a training job.

    ``comm`` may be any intra-communicator: a simulation that owns
    ``MPI.COMM_WORLD`` can give the library a sub-communicator of it. The groups
    are built by the constructor, collectively over ``comm``. Its calls on
    ``comm`` are two, both under the timeout: an ``MPI_Iallreduce`` of the
    ranks' arrival times, then ``MPI_Comm_idup``; every later call goes through
    the groups' communicators, so the library's messages never mix with the
    caller's. After a timeout in the first (``abort_on_exception=False``) its
    request stays pending on ``comm`` until the late ranks call the constructor
    too: their call completes it, reads from the arrival times that the others
    gave up, and raises as well, so the caller's next collective on ``comm``
    pairs up on every rank. (MPI cannot withdraw a collective: a rank of
    ``comm`` that never calls the constructor leaves ``comm`` unusable for
    collectives.)

    Messages name a process by its rank in ``MPI.COMM_WORLD`` ("world rank 3"),
    with its rank in a group of the library beside it; the library's top group
    (the ranks of ``comm``, [`world`][mpishard.config.ShardingConfiguration.world]) is the
    ``training`` group, ``comm`` itself before it is duplicated the ``MPI.COMM_WORLD`` group or the
    ``caller's`` group.

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
            past ``timeout`` raises [`CommunicationError`][mpishard.errors.CommunicationError]
            on the ranks that waited (the groups are unusable after it).
        timeout: seconds a call of the library may wait for the other ranks of
            a group before the job is aborted (or, with
            ``abort_on_exception=False``, a ``CommunicationError`` is raised) with
            a message naming the call, the group, the rank (world rank, host,
            rank in the group) and the deadline; the constructor's own
            collectives included (``None``: wait forever). Also the deadline of
            the other kinds of wait, unless they are given.
        data_timeout: seconds a [`BatchStream`][mpishard.data.BatchStream] step may wait
            for the slowest rank's next batch (its simulation); ``None``: forever;
            default: ``timeout``. See [`mpishard.comm.deadlines`][mpishard.comm.deadlines].
        io_timeout: seconds a wait for file I/O may last: the calls of a
            checkpoint save or load (the other ranks waiting while rank 0
            ``fsync``-s), HDF5's collective open and close (checkpoints,
            [`HDF5Dataset`][mpishard.data.HDF5Dataset]); ``None``: forever; default:
            ``timeout``.
        allow_tensor_across_nodes: accept, with a warning, a layout whose
            tensor-parallel groups cannot all stay inside one node (refused by
            default; see [`ProcessGroups`][mpishard.comm.ProcessGroups]).
        reproducible: train bit for bit the same at any data-parallel size, with
            DDP, ZeRO-2 or ZeRO-3, pipelined or not, across a resize or a resharded
            restart (see [Reproducible mode](../guide/reproducible.md)). Default off: the
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
            ([`mpishard.recovery.recover_in_place`][mpishard.recovery.recover_in_place]);
            ``"ulfm"``: the same, and an error where ULFM is not available; ``"off"``.
        evict_stuck: with ULFM on, a call past ``timeout`` SIGKILLs the ranks of
            its group on this host that did not arrive (stopped, looping,
            deadlocked) instead of aborting, and the survivors recover as from a
            death ([`mpishard.comm.ulfm.enable`][mpishard.comm.ulfm.enable]).
        spares: the last ``spares`` ranks of ``comm`` are spare ranks (ULFM only):
            in no training group, they wait in ``optimize()`` (sleeping, holding
            no model state) until ranks are lost, then take the lost ranks'
            places, coordinates and state, so the job goes on at full size
            ([`mpishard.recovery.spares`][mpishard.recovery.spares]); released at the
            end of ``optimize()``. On a spare the configuration is a placeholder
            (``is_spare``; its groups are the rank alone). Not carried over by
            ``dataclasses.replace``: a configuration made so has none. Not kept
            as an attribute: ``spare_pool`` holds them (``spare_pool.count``).
            None: ``MPISHARD_SPARES`` (``mpishard run --spares``) over
            ``MPI.COMM_WORLD``, 0 over a given ``comm``.

    Raises:
        TopologyError: sizes that do not divide the communicator's size, or a
            tensor group that would cross nodes; on every rank.
        ValueError: ``unit_rows`` not a positive integer or None;
            ``reproducible_sizes`` not positive integers or given with ``unit_rows``;
            a timeout that is not positive seconds or None; ``spares`` not an
            integer from 0 to the communicator's size - 1.
        MpiShardError: ``spares`` where fault tolerance (ULFM) is off or not available.
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
    data_timeout: float | str | None = "timeout"
    io_timeout: float | str | None = "timeout"
    spares: InitVar[int | None] = None
    topology: Topology = field(init=False)
    #: The spare ranks and the job's communicator over them and the training ranks
    #: (None: no spares were asked for).
    spare_pool: SparePool | None = field(init=False, default=None, repr=False)
    deadlines: Deadlines = field(init=False)
    _groups: ProcessGroups | None = field(init=False, default=None, repr=False)

    def __post_init__(self, spares: int | None = None) -> None:
        if self.unit_rows is not None:
            if (not isinstance(self.unit_rows, numbers.Integral)
                    or isinstance(self.unit_rows, bool) or self.unit_rows < 1):
                raise ValueError(f"unit_rows must be a positive integer or None, "
                                 f"got {self.unit_rows!r}")
            self.unit_rows = int(self.unit_rows)   # np.int64(48) -> 48
        if self.reproducible_sizes is not None:
            self.reproducible_sizes = _sizes(self.reproducible_sizes, self.unit_rows)
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, numbers.Integral) and not isinstance(value, bool):
                setattr(self, name, int(value))
        self.deadlines = Deadlines.build(self.timeout, self.data_timeout, self.io_timeout)
        given = self.comm is not None
        parent = from_comm(self.comm, "caller's", self.deadlines)
        if parent.is_world():
            parent.name = "MPI.COMM_WORLD"
        parent.abort_job = self.abort_on_exception
        # The first collective, under the timeout: a rank of ``comm`` that never
        # calls the constructor (busy elsewhere in a simulation) is named here, and
        # the message says what was waited for. After a timeout our request stays
        # pending on ``comm`` (MPI cannot withdraw a collective): a late rank's
        # call completes it, sees from the arrival times that the others gave up,
        # and fails too, without a second call on ``comm``, so that the caller's
        # next collective on ``comm`` pairs with theirs on every rank. Only once
        # every rank is known to be here is ``comm`` duplicated.
        with parent.during(_construction(given, parent.size)):
            peer = self.deadlines.peer
            parent.grace = 0.0 if peer is None else _ARRIVAL_GRACE
            try:
                spread = parent.arrival_spread()
            except CommunicationError as exc:   # the same error, with what it left
                exc.args = (f"{exc}; {_left_pending(given, parent.name)}", *exc.args[1:])
                raise
            if peer is not None and spread > peer:
                parent.abort(f"the last rank of the {parent.name} group called "
                             f"ShardingConfiguration() {spread:.1f} s after the first, past "
                             f"timeout={peer:g}: the first ranks gave up waiting ("
                             f"{parent.deadlines.explain('peer')})")
            # Without this activity: no group made below keeps it in its messages.
            world = parent.dup("training", context=False)
        self.comm = parent.comm
        # Not kept as ``self.spares``: ``dataclasses.replace`` (a configuration over
        # survivors) would split the spares off again.
        spares = _spares(default_spares() if spares is None and not given else spares or 0,
                         world)
        if spares:
            world = self._split_spares(world, spares)
            if self.is_spare:
                return
        self._build_groups(world)

    def _build_groups(self, world: FlatComm) -> None:
        """The layout over ``world`` (agreed: no rank hangs on arguments that differ),
        the groups, the ranks' names for a timeout, fault tolerance and the abort
        hook. Collective over ``world``."""
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

    def _split_spares(self, world: FlatComm, spares: int) -> FlatComm:
        """The training ranks' world, the last ``spares`` ranks set apart in
        ``spare_pool`` (fault tolerance required); on a spare, its placeholder
        groups over itself. Collective over ``world``."""
        wanted = ulfm.wanted(self.fault_tolerance, world)
        why = "" if wanted else ulfm.available()[1] or f"fault_tolerance={self.fault_tolerance!r}"
        world.agree(None if wanted else
                    f"spares={spares} needs fault tolerance (Open MPI 5 with ULFM, "
                    f"mpirun --with-ft ulfm) to promote them, but it is off: {why}",
                    MpiShardError)
        size = world.size - spares
        error = None
        try:   # the layout of the training ranks, checked on every rank
            self.topology = Topology.build(size, tp=self.tensor_parallel_size,
                                           pp=self.pipeline_parallel_size,
                                           dp=self.data_parallel_size)
        except TopologyError as exc:
            error = f"{exc} (of {world.size} ranks, {spares} are spares)"
        world.agree(error, TopologyError)
        self.spare_pool, world = SparePool.split(world, spares)
        if self.is_spare:
            self._groups = ProcessGroups.split(world, Topology.build(1))
            if self.abort_on_exception:
                install_abort_hook(self.spare_pool.job)
        return world

    @property
    def is_spare(self) -> bool:
        """This rank is a spare still waiting: its groups are itself alone, and
        ``optimize()`` waits until it is promoted or released."""
        return self.spare_pool is not None and self.spare_pool.waiting

    def release_spares(self) -> None:
        """Release the spares still waiting (their ``optimize()`` returns, never
        used); ``optimize()`` does it at its end. Point-to-point over the pool
        (every training rank calls it)."""
        if self.spare_pool is not None and not self.is_spare:
            self.spare_pool.release()

    @property
    def groups(self) -> ProcessGroups:
        """The process groups (``world``, ``dp``, ``tp``, ``pp``), one
        [`FlatComm`][mpishard.comm.FlatComm] each."""
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


#: Seconds past the timeout that the constructor's first wait goes on before it
#: gives up: more than the clocks of two nodes may differ, so that a late rank
#: reads the others' giving up from the arrival times (``FlatComm.arrival_spread``).
_ARRIVAL_GRACE = 0.5


def _construction(given: bool, size: int) -> str:
    """What the constructor's first collective waits for, for a timeout message."""
    if given:
        return (f"ShardingConfiguration(comm=...), which every one of the {size} ranks of "
                f"that communicator must call; a rank that does other work (a simulation) "
                f"must not be in it: pass comm= the communicator of the ranks that train")
    return (f"ShardingConfiguration() over MPI.COMM_WORLD (no comm= given), which every one "
            f"of its {size} ranks must call; where other ranks do other work (a "
            f"simulation), pass comm= the communicator of the ranks that train")


def _left_pending(given: bool, name: str) -> str:
    """What a timed-out arrival leaves on the caller's communicator, and what the
    program may still do with it (MPI cannot withdraw a collective)."""
    where = "the communicator passed as comm=" if given else name
    abort = "comm.Abort()" if given else "MPI.COMM_WORLD.Abort()"
    return (f"this rank's Iallreduce stays pending on {where} (MPI cannot withdraw a "
            f"collective). If the ranks that did not arrive call ShardingConfiguration() "
            f"later, their own ShardingConfiguration() call completes it and fails too, "
            f"and {where} pairs up again. If they never call it, no rank may call a "
            f"collective on {where} again (theirs would pair with this one: a hang, or "
            f"mixed data): use only point-to-point messages on it, then end the job with "
            f"{abort} (MPI_Finalize with a request pending is not valid MPI)")


def default_spares() -> int:
    """``spares`` when not given: ``MPISHARD_SPARES`` (set by ``mpishard run
    --spares``), else 0. Local."""
    text = os.environ.get("MPISHARD_SPARES", "").strip()
    return int(text) if text.isdigit() else 0


def _spares(spares: Any, world: FlatComm) -> int:
    """``spares`` as an int, checked (agreed over ``world``).

    Raises:
        ValueError: not an integer from 0 to ``world.size - 1``, on every rank.
    """
    ok = (isinstance(spares, numbers.Integral) and not isinstance(spares, bool)
          and 0 <= spares < world.size)
    world.agree(None if ok else f"spares must be an integer from 0 to {world.size - 1} (the "
                f"ranks but one), got {spares!r}", ValueError)
    return int(spares)


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
