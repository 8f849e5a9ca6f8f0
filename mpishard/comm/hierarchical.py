"""Gradient reductions in two levels, inside each node and then across nodes.

A flat ring allreduce of ``n`` elements over ``P = N * L`` ranks (``N`` nodes of
``L``) sends ``2 (P-1)/P n`` elements per rank, all at the speed of the slowest
link, the network. [`HierarchicalComm`][mpishard.comm.hierarchical.HierarchicalComm] does

1. a reduce-scatter inside the node: local rank ``j`` holds piece ``j`` (``n/L``
   elements) summed over its node (shared memory);
2. an allreduce of that piece across the nodes, with the ranks that hold piece
   ``j`` on the other nodes: ``2 (N-1)/N n/L`` elements per rank over the network,
   ``L`` times less than flat;
3. an allgather of the pieces inside the node.

ZeRO-2's reduce to shards is (1) on the send buffer packed by local rank, then a
reduce-scatter across nodes in place of (2)-(3): the rank on node ``k`` with
local rank ``j`` ends with its own segment, whatever its group rank (ranks placed
by slot or round robin alike).

It has the call signatures of the [`FlatComm`][mpishard.comm.FlatComm] buffer calls
that the strategies use for gradients (``Allreduce``, ``Iallreduce``,
``Reduce_scatter``, ``Ireduce_scatter``), so a strategy holds either as its
reduction communicator; [`choose`][mpishard.comm.hierarchical.choose] measures them at attach (and a
ring of point-to-point messages, [`RingComm`][mpishard.comm.ring.RingComm]) and keeps the
fastest.
Sums give the flat result to rounding (another order of addition), not bit for bit.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from ..backend import array_namespace
from ..flat import shard_ranges
from .communicator import FlatComm, Handle
from .nodes import NodeMap
from .reducer import Reducer
from .ring import RING_MIN_ELEMENTS, RingComm
from .timing import agree_on_faster, reduce_once, time_alternatives

__all__ = ["REDUCTIONS", "HierarchicalComm", "choose"]

#: What `choose` picks between.
REDUCTIONS = ("flat", "hierarchical", "ring")


class HierarchicalComm:
    """Two-level sums over ``group`` (a [`FlatComm`][mpishard.comm.FlatComm] whose ranks span
    nodes).

    Builds three communicators (collective over ``group``): the node's ranks of
    the group twice (the reduce-scatters and the allgathers each get their own,
    so that a bucket's allgather never meets another bucket's reduce-scatter out
    of order) and the ranks with the same local rank on every node. The levels
    need the same number of the group's ranks on every node (`usable`);
    otherwise, and for a group on one node or with one rank per node (where the
    levels are the flat call), every call is the group's own.

    Non-blocking calls return a handle (``test()``, ``wait()``) whose stages
    start in the order the calls were made, on every rank: a later call's stage
    waits until every earlier call has started that stage.
    """

    def __init__(self, group: FlatComm) -> None:
        self.group = group
        self.name, self.rank, self.size, self.timeout = (group.name, group.rank, group.size,
                                                         group.timeout)
        self.node = group.split_shared(f"{group.name} inside node (reduce-scatter)")
        self.cross = group.split(self.node.rank, group.rank, f"{group.name} across nodes")
        self.gather = self.node.dup(f"{group.name} inside node (allgather)")
        self.nodes, self.per_node = self.cross.size, self.node.size
        # Where each group rank sits: (its node's index = its rank across nodes,
        # its rank inside the node). Any placement works if every node holds the
        # same number L of the group's ranks.
        where = group.allgather((self.cross.rank, self.node.rank, self.per_node))
        self.usable = len({per for _, _, per in where}) == 1
        self._rank_at = {(k, j): r for r, (k, j, _) in enumerate(where)}
        self.two_levels = self.usable and self.nodes > 1 and self.per_node > 1
        self._pending: deque[_Staged] = deque()
        self._scratch: dict[Any, Any] = {}
        self._plans: dict[Any, Any] = {}

    def describe(self) -> str:
        """``2 nodes x 2 ranks``, or why the reduction stays flat."""
        if not self.usable:
            return "flat (the nodes hold different numbers of the group's ranks)"
        return f"{self.nodes} nodes x {self.per_node} ranks"

    # --- the calls of FlatComm ---------------------------------------------------
    def Allreduce(self, buf: Any, slot: Any = "allreduce", op: str = "sum") -> None:
        """Sum ``buf`` in place over the group, in two levels. Collective over the group."""
        if not self.two_levels or op != "sum":
            self.group.Allreduce(buf, slot, op=op)
            return
        # Blocking stages (MPI's blocking collectives measured up to 2x faster than
        # its non-blocking ones here), once the calls made before have completed.
        self._drain()
        counts, piece, mine = self._allreduce_parts(buf, slot)
        self.node.Reduce_scatter(buf, piece, counts, slot=(slot, "rs"))
        self.cross.Allreduce(piece, slot=(slot, "x"))
        mine[...] = piece
        self.gather.Allgatherv(buf, counts, slot=(slot, "ag"))

    def Iallreduce(self, buf: Any, slot: Any = "allreduce",
                   finish: Callable[[], None] | None = None, op: str = "sum") -> Any:
        """Start summing ``buf`` in place over the group. Collective over the group."""
        if not self.two_levels or op != "sum":
            return self.group.Iallreduce(buf, slot, finish, op=op)
        counts, piece, mine = self._allreduce_parts(buf, slot)

        def place() -> None:
            mine[...] = piece

        stages = [
            lambda: self.node.Ireduce_scatter(buf, piece, counts, slot=(slot, "rs")),
            lambda: self.cross.Iallreduce(piece, slot=(slot, "x"), finish=place),
            lambda: self.gather.Iallgatherv(buf, counts, (slot, "ag"), finish),
        ]
        return self._start(stages)

    def Reduce_scatter(self, sendbuf: Any, recvbuf: Any, counts: list[int],
                       slot: Any = "reduce_scatter") -> None:
        """Sum ``sendbuf`` over the group, rank ``i`` keeping piece ``i`` of
        ``counts[i]`` elements in ``recvbuf``. Collective over the group."""
        if not self.two_levels:
            self.group.Reduce_scatter(sendbuf, recvbuf, counts, slot)
            return
        self._drain()
        packed, column, columns, mine = self._reduce_scatter_parts(sendbuf, counts, slot)
        self.node.Reduce_scatter(packed, column, columns, slot=(slot, "rs"))
        self.cross.Reduce_scatter(column, recvbuf, mine, slot=(slot, "x"))

    def Ireduce_scatter(self, sendbuf: Any, recvbuf: Any, counts: list[int],
                        slot: Any = "reduce_scatter",
                        finish: Callable[[], None] | None = None) -> Any:
        """Start [`Reduce_scatter`][mpishard.comm.hierarchical.HierarchicalComm.Reduce_scatter].
        Collective over the group."""
        if not self.two_levels:
            return self.group.Ireduce_scatter(sendbuf, recvbuf, counts, slot, finish)
        packed, column, columns, mine = self._reduce_scatter_parts(sendbuf, counts, slot)
        stages = [
            lambda: self.node.Ireduce_scatter(packed, column, columns, slot=(slot, "rs")),
            lambda: self.cross.Ireduce_scatter(column, recvbuf, mine, slot=(slot, "x"),
                                               finish=finish),
        ]
        return self._start(stages)

    def communicators(self) -> list[FlatComm]:
        """The communicators made here: inside the nodes (two) and across. Local."""
        return [self.node, self.cross, self.gather]

    def free(self) -> None:
        """Finish what is pending and free the communicators. Collective over the group."""
        self._drain()
        for comm in (self.gather, self.cross, self.node):
            comm.free()

    # --- the pieces of a call -----------------------------------------------------
    def _allreduce_parts(self, buf: Any, slot: Any) -> tuple[list[int], Any, Any]:
        """Counts by local rank, this rank's scratch piece, and its place in ``buf``."""
        counts = self._plan(("allreduce", buf.size), lambda: _counts(buf.size, self.per_node))
        j = self.node.rank
        start = sum(counts[:j])
        return counts, self._buffer((slot, "piece"), counts[j], buf), \
            buf[start:start + counts[j]]

    def _reduce_scatter_parts(self, sendbuf: Any, counts: list[int], slot: Any):
        """``sendbuf`` packed by local rank, this rank's column buffer, the column
        sizes, and the counts of its column by node."""
        if len(counts) != self.size:
            raise ValueError(f"expecting {self.size} counts, got {len(counts)}")
        moves, columns = self._plan(("reduce_scatter", tuple(counts)),
                                    lambda: _pack_plan(counts, self._rank_at, self.nodes,
                                                       self.per_node))
        j = self.node.rank
        packed = self._buffer((slot, "packed"), sum(columns), sendbuf)
        column = self._buffer((slot, "column"), columns[j], sendbuf)
        # Column j (the segments of local rank j on every node, node by node) is
        # contiguous in ``packed``: what rank j sums inside the node.
        for dst, src, n in moves:
            packed[dst:dst + n] = sendbuf[src:src + n]
        return packed, column, columns, [counts[self._rank_at[k, j]] for k in range(self.nodes)]

    def _drain(self) -> None:
        if self._pending:
            self._progress(until=self._pending[-1])

    # --- stages in order ------------------------------------------------------------
    def _start(self, stages: list[Callable[[], Handle]]) -> _Staged:
        op = _Staged(self, stages)
        self._pending.append(op)
        self._progress()
        return op

    def _progress(self, until: _Staged | None = None) -> None:
        """Advance the pending calls in the order they were made; block on those up
        to ``until``. A stage starts only after every earlier call started it."""
        blocking = until is not None
        # Stage s of a call uses the same communicator in every kind of call: it may
        # start once EVERY earlier call has started its stage s (or has none). So the
        # limit is the least stage not yet started by any earlier call with stages
        # left (a call with all its stages started no longer holds the others back).
        before = None
        for op in self._pending:
            while True:
                if op.handle is not None:
                    if blocking:
                        op.handle.wait()
                    elif not op.handle.test():
                        break
                    else:
                        op.handle.wait()   # done: runs its completion step
                    op.handle = None
                if op.started == len(op.stages):
                    break
                if before is not None and before <= op.started:
                    break
                op.handle = op.stages[op.started]()
                op.started += 1
            if op.started < len(op.stages):
                before = op.started if before is None else min(before, op.started)
            if op is until:
                blocking = False
        while self._pending and self._pending[0].done:
            self._pending.popleft()

    # --- buffers --------------------------------------------------------------------
    def _buffer(self, key: Any, size: int, like: Any) -> Any:
        """A reusable buffer of ``size`` elements like ``like`` (grow-only, per slot)."""
        key = (key, np.dtype(like.dtype).str, type(like))
        have = self._scratch.get(key)
        if have is None or have.size < size:
            have = array_namespace(like).empty(max(size, 1), dtype=like.dtype)
            self._scratch[key] = have
        return have[:size]

    def _plan(self, key: Any, make: Callable[[], Any]) -> Any:
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = make()
        return plan


class _Staged:
    """One hierarchical call: its stages, how many have started, the current one."""

    __slots__ = ("owner", "stages", "started", "handle")

    def __init__(self, owner: HierarchicalComm, stages: list[Callable[[], Handle]]) -> None:
        self.owner, self.stages, self.started, self.handle = owner, stages, 0, None

    @property
    def done(self) -> bool:
        return self.started == len(self.stages) and self.handle is None

    def test(self) -> bool:
        """Progress every pending call; True when this one has completed."""
        if not self.done:
            self.owner._progress()
        return self.done

    def wait(self, *, timed: bool = True) -> None:
        """Complete this call (and those started before it). ``timed`` is accepted
        for [`Handle`][mpishard.comm.Handle]'s signature; the stages are timed."""
        if not self.done:
            self.owner._progress(until=self)


def _counts(n: int, parts: int) -> list[int]:
    return [len(r) for r in shard_ranges(n, parts)]


def _pack_plan(counts: list[int], rank_at: dict[tuple[int, int], int], nodes: int,
               per_node: int):
    """Copies ``(dst, src, n)`` that order the segments by local rank, then node
    (``rank_at[node, local]`` is the group rank there); and the column sizes by
    local rank."""
    displs = np.concatenate(([0], np.cumsum(counts[:-1]))).astype(int).tolist()
    moves, dst = [], 0
    columns = []
    for j in range(per_node):
        size = 0
        for k in range(nodes):
            r = rank_at[k, j]
            if counts[r]:
                moves.append((dst, displs[r], counts[r]))
            dst += counts[r]
            size += counts[r]
        columns.append(size)
    return moves, columns


def choose(group: FlatComm, elements: int, dtype: Any, xp: Any, kind: str = "allreduce",
           record: dict[str, Any] | None = None, repeats: int = 3,
           nodes: NodeMap | None = None, blocking: bool = False,
           margin: float = 0.1, ring: bool = True,
           agree: FlatComm | None = None) -> Reducer:
    """The fastest [`Reducer`][mpishard.comm.reducer.Reducer] for buckets of
    ``elements``: ``group`` itself, a
    [`HierarchicalComm`][mpishard.comm.hierarchical.HierarchicalComm] over it or a
    [`RingComm`][mpishard.comm.ring.RingComm] over it, measured, not assumed.

    ``kind``: ``"allreduce"`` (DDP) or ``"reduce_scatter"`` (ZeRO-2). Each way's
    time is the slowest rank's best of ``repeats`` rounds (after one warm-up)
    that alternate the ways, so every rank returns the same choice; another way
    than the group's own calls (more calls, more buffers) must be faster by
    ``margin`` (10 %) to be chosen, so that noise does not flip a tie from run
    to run; ``blocking`` measures the blocking calls (for reductions after the
    backward), otherwise the non-blocking ones (during it). The two levels are
    tried only where they exist (not on one node, with one rank per node or
    uneven nodes; with ``nodes``, the world's
    [`NodeMap`][mpishard.comm.NodeMap], the same on every rank, a job on one
    node does not even build their communicators); the ring only on host
    (NumPy) buffers of at least `RING_MIN_ELEMENTS`,
    and not with ``ring=False`` (ZeRO-2, whose ``reduce_method`` chooses it).
    ``record`` receives ``{"choice", "flat", "hierarchical", "ring", "levels"}``
    (seconds, None for a way not tried). ``agree`` (the training group of a 3D
    layout, whose data groups hold copies of the replicated tensors) makes the
    choice alike over it, from every group's times
    (`agree_on_faster`); then every rank of ``agree``
    calls this, ``elements`` 0 where a stage has nothing to reduce. Collective
    over ``group`` (and ``agree``).
    """
    if kind not in ("allreduce", "reduce_scatter"):
        raise ValueError(f"kind must be 'allreduce' or 'reduce_scatter', got {kind!r}")
    info: dict[str, Any] = {"choice": "flat", "flat": None, "hierarchical": None,
                            "ring": None}
    if group.size == 1:    # the data groups of a job are alike: none agrees then
        info["levels"] = "one rank"
        if record is not None:
            record.update(info)
        return group
    ways = _candidates(group, elements, xp, nodes, ring, info)
    times: dict[str, float] = {}
    if len(ways) > 1:
        buf = xp.zeros(max(elements, group.size), dtype=dtype)
        counts = _counts(buf.size, group.size)
        recv = xp.zeros(counts[group.rank], dtype=dtype)
        times = time_alternatives(
            group, {way: (lambda c=c: reduce_once(c, kind, blocking, buf, recv, counts))
                    for way, c in ways.items()}, repeats)
        info.update(times)
    if agree is not None or times:    # one rule, over the group or the whole job
        info["choice"] = agree_on_faster(agree if agree is not None else group, times, "flat",
                                         ("hierarchical", "ring"), margin)
    for way, comm in ways.items():
        if way not in ("flat", info["choice"]):
            comm.free()
    if record is not None:
        record.update(info)
    return ways[info["choice"]]


def _candidates(group: FlatComm, elements: int, xp: Any, nodes: NodeMap | None, ring: bool,
                info: dict[str, Any]) -> dict[str, Any]:
    """[`choose`][mpishard.comm.hierarchical.choose]'s ways for ``group``: itself, its two levels
    where they exist, its ring where asked for host buckets large enough; ``info["levels"]`` says
    why the two levels are or are not there. Collective over ``group``."""
    ways: dict[str, Any] = {"flat": group}
    if elements <= 0:
        info["levels"] = "nothing to reduce"
    elif nodes is not None and nodes.nodes == 1:
        info["levels"] = "one node"
    else:
        hier = HierarchicalComm(group)
        info["levels"] = hier.describe()
        if hier.two_levels:
            ways["hierarchical"] = hier
        else:
            hier.free()
    if ring and xp is np and elements >= RING_MIN_ELEMENTS:
        ways["ring"] = RingComm(group)
    return ways
