"""ZeRO-2's and ZeRO-3's state put back together after a lost rank, exactly, with
nothing read from disk.

A ZeRO-2 rank is the only holder of its shard of the optimizer state, and, between
its update and the parameter ``Allgatherv``, of its shard's new parameters; a
ZeRO-3 rank of its shard of the parameters at all times. Two copies keep the run
exact when it dies (ULFM, [`mpishard.recovery`][mpishard.recovery]):

* ``ShardBuddy``: each rank keeps its right neighbour's shard (parameters and
  optimizer state) as of the last two completed steps, refreshed after every step;
* [`keep_previous_step`][mpishard.parallel.placement.GatheredAfterStep.keep_previous_step]
  of a sharded placement: each rank keeps its own shard as it was before its last update.

A death anywhere in a step then leaves the survivors one of two consistent points:
the step every survivor completed (the state as it is, the lost shards from their
copies), or the step before it (a survivor that had updated takes its shard back
from before the update; the lost shards come from the older copies).
``zero2_candidates`` says which of them the survivors of one data-parallel
group can rebuild; ``sharded_pieces`` is what a survivor holds of one of them
(its shard, a lost neighbour's copy), moved shard to shard to the new split by
[`resplit`][mpishard.recovery.resplit] (no rank holds the whole vector);
``zero2_rebuild`` puts the whole stage vectors together instead (3D layouts,
[`mpishard.recovery.replicas`][mpishard.recovery.replicas]). The survivors then
train the interrupted step again, over fewer ranks.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from ..backend import to_numpy
from ..comm import FlatComm
from ..flat import Range
from ..protocols import RecoverableCore

__all__ = ["ShardBuddy", "sharded_pieces", "zero2_candidates", "zero2_rebuild"]

#: The tag of the buddy copies' messages over the data-parallel group.
_BUDDY_TAG = 0x4255


class ShardBuddy:
    """ZeRO-2's buddy copy: each data-parallel rank also keeps the shard of the
    next rank (``(r + 1) % n``), its parameters and its optimizer state, as of the
    last two completed steps, so that a lost rank's shard survives with its left
    neighbour and [`recover_in_place`][mpishard.recovery.recover_in_place] goes on
    exactly, whatever the point of the step where the rank died.

    Building it turns on the placement's
    [`keep_previous_step`][mpishard.parallel.placement.GatheredAfterStep.keep_previous_step]
    and sends the first copies (collective over ``strategy.dp``).

    Costs: memory, per rank, two copies of a neighbour's shard of the parameters
    and of the state, and one copy of its own (Adam, float64: 3 x 3 x ``params / n``
    x 8 bytes; ``nbytes``); time, one exchange of the state shard with each
    neighbour per step and two local copies of a shard (``seconds``: the total
    so far). Under ZeRO-2 the parameters are not sent: each rank copies its
    neighbour's shard out of the full vector the ``Allgatherv`` just rebuilt;
    under ZeRO-3, which holds no full vector, the parameter shard is exchanged
    with the state. The copies are host (NumPy) arrays whatever the state's
    array library: a device (CuPy) shard is sent through the group's staging
    (or directly, CUDA-aware MPI) and kept in host memory, so the device holds
    no more than before.
    """

    def __init__(self, strategy: RecoverableCore) -> None:
        self.strategy = strategy
        self.dp = strategy.dp
        n, r = self.dp.size, self.dp.rank
        self.rank, self.size = r, n
        self.holds = (r + 1) % n          # whose shard the copies are
        self.sharded = strategy.placement.sharded     # the shards and their state
        length = len(self.sharded.shards[self.holds])
        dtype = strategy.dtype
        self.active = n > 1
        self.copies = [{"params": np.zeros(length if self.active else 0, dtype=dtype),
                        **{name: np.zeros(length if self.active else 0, dtype=value.dtype)
                           for name, value in strategy.state.items()}} for _ in range(2)]
        self.steps = [-1, -1]       # the step each copy holds (-1: none, or being received)
        self.completed = -1         # the last step exchanged (sent and received) here
        self.seconds = 0.0
        self._dropped = 0           # bytes the copies held before ``keep_only``
        if self.active:
            strategy.placement.keep_previous_step()
            self.exchange()

    @property
    def step(self) -> int:
        """The newest step a copy holds (-1: none)."""
        return max(self.steps)

    @property
    def nbytes(self) -> int:
        """Bytes of the copies (the neighbour's two and the own one before the update)."""
        own = self.sharded.previous
        return max(self._dropped,
                   sum(v.nbytes for copy in self.copies for v in copy.values())
                   + (sum(v.nbytes for v in own.values()) if own else 0))

    def copy_of(self, step: int) -> dict[str, Any] | None:
        """The copy of the neighbour's shard at ``step``, or None. Local."""
        return self.copies[self.steps.index(step)] if step in self.steps else None

    def keep_only(self, step: int) -> None:
        """Drop every copy but the one of ``step`` (a recovery moves that one
        from here; the others are not needed any more); ``nbytes`` still says
        what they cost. Local."""
        self._dropped = self.nbytes
        self.copies = [copy if self.steps[k] == step else {}
                       for k, copy in enumerate(self.copies)]
        self.steps = [s if s == step else -1 for s in self.steps]

    def exchange(self) -> None:
        """After a step: send my state shard to the left neighbour, receive the
        right one's into the older copy, and copy the right one's parameters
        from the full vector (ZeRO-3: exchange them as the state). Nothing is
        sent after a skipped step (the state did not change). Collective over the
        data-parallel group (neighbours only)."""
        step = self.strategy.step_count
        if not self.active or step == self.completed:
            return
        t0 = time.perf_counter()
        k = 0 if self.steps[0] <= self.steps[1] else 1     # the older copy
        self.steps[k] = -1                                  # until it is whole
        copy = self.copies[k]
        left = (self.rank - 1) % self.size
        handles = []
        sent = dict(self.strategy.state)
        held_range, params = self.strategy.parameter_shard()
        whole = held_range == Range(0, self.strategy.layout.size)
        if not whole:
            sent["params"] = params          # ZeRO-3: no full vector to copy it from
        for i, (name, value) in enumerate(sent.items()):
            handles.append(self.dp.Irecv(copy[name], self.holds, _BUDDY_TAG + i))
            handles.append(self.dp.Isend(value, left, _BUDDY_TAG + i, slot=("buddy", i)))
        if whole:
            held = self.sharded.shards[self.holds]
            copy["params"][...] = to_numpy(params[held.start:held.stop])
        for handle in handles:
            handle.wait()
        self.steps[k] = self.completed = step
        self.seconds += time.perf_counter() - t0


def own_parameters(strategy: RecoverableCore) -> Any:
    """This rank's shard of the parameters (a view): of the whole vector under
    ZeRO-2, the shard itself under ZeRO-3. Local."""
    held, params = strategy.parameter_shard()
    shard = strategy.placement.owned()
    return params[shard.start - held.start:shard.stop - held.start]


def _report(strategy: RecoverableCore, buddy: ShardBuddy | None
            ) -> tuple[int, int, int, int, tuple]:
    """What a survivor can give: its old dp rank, its step, the step its shard's
    copy from before the update holds (-1: none), whose shard its buddy copies
    are, and the steps they hold."""
    usable = (buddy is not None and buddy.active and buddy.strategy is strategy
              and buddy.size == strategy.dp.size)
    sharded = strategy.placement.sharded
    before = sharded.previous_step if sharded.previous is not None else -1
    if before != strategy.step_count - 1:
        before = -1                 # an older copy: not the step before this one
    return (strategy.dp.rank, strategy.step_count, before,
            buddy.holds if usable else -1, tuple(buddy.steps) if usable else ())


def zero2_candidates(strategy: RecoverableCore, buddy: ShardBuddy | None,
                     group: FlatComm) -> set[int]:
    """The steps at which the whole ZeRO-2 state of ``strategy.dp`` can be rebuilt
    exactly from the survivors in ``group`` (every survivor of ``strategy.dp``,
    which may be revoked: it is not used), with ``zero2_rebuild``: the newest
    step any survivor reached, or the one before, where every survivor holds its
    own shard at that step and every lost shard has a copy at that step on a
    survivor. Empty when none can (no buddy, two neighbours lost). Collective over
    ``group``."""
    every = group.allgather(_report(strategy, buddy))
    n = strategy.dp.size
    lost = set(range(n)) - {e[0] for e in every}
    newest = max(e[1] for e in every)
    found = set()
    for step in (newest, newest - 1):
        own = all(count == step or before == step for _, count, before, _, _ in every)
        copied = all(any(holds == r and step in steps for _, _, _, holds, steps in every)
                     for r in lost)
        if step >= 0 and own and copied:
            found.add(step)
    return found


def sharded_pieces(strategy: RecoverableCore, buddy: ShardBuddy | None, group: FlatComm,
                   step: int) -> list[tuple[Range, dict[str, Any]]]:
    """What this survivor holds of the sharded parameters and state at ``step``
    (one of ``zero2_candidates``): its own shard (as it is, or its copy from
    before the update) and the buddy copy of a lost neighbour's, as
    ``(world range, arrays by name)`` for
    [`resplit`][mpishard.recovery.resplit.resplit]; nothing whole. Collective
    over ``group`` (every survivor of ``strategy.dp``)."""
    every = group.allgather(_report(strategy, buddy))
    lost = set(range(strategy.dp.size)) - {e[0] for e in every}
    sharded = strategy.placement.sharded
    own = {"params": own_parameters(strategy), **strategy.state}
    if strategy.step_count != step:
        own = sharded.previous
    pieces = [(sharded.shard, own)]
    if buddy is not None and buddy.holds in lost and buddy.holds != strategy.dp.rank:
        xp = strategy.xp     # the copy is in host memory: to the state's library
        copy = {name: xp.asarray(value) for name, value in buddy.copy_of(step).items()}
        pieces.append((sharded.shards[buddy.holds], copy))
    if buddy is not None:
        buddy.keep_only(step)
    if own is not sharded.previous:
        sharded.previous = None   # the copy from before the update is not needed
    return pieces


def zero2_rebuild(strategy: RecoverableCore, buddy: ShardBuddy | None, group: FlatComm,
                  step: int) -> tuple[Any, dict[str, Any]]:
    """The whole parameters and optimizer state of ``strategy.dp`` at ``step`` (one
    of ``zero2_candidates``), full length, on every member of ``group``. Each
    survivor gives its own shard (as it is, or its copy from before the update)
    and the copy of a lost neighbour's; every byte comes from exactly one rank, so
    a bitwise OR puts them together with no rounding (``-0.0`` and NaN payloads
    kept). Collective over ``group``."""
    every = group.allgather(_report(strategy, buddy))
    lost = set(range(strategy.dp.size)) - {e[0] for e in every}
    sharded = strategy.placement.sharded
    shard = sharded.shard
    own = {"params": own_parameters(strategy), **strategy.state}
    if strategy.step_count != step:
        own = sharded.previous
    copy = None
    if buddy is not None and buddy.holds in lost and buddy.holds != strategy.dp.rank:
        copy = buddy.copy_of(step)
    xp, size = strategy.xp, strategy.layout.size
    full = {}
    for name, value in own.items():
        whole = xp.zeros(size, dtype=value.dtype)
        whole[shard.start:shard.stop] = value
        if copy is not None:   # host memory: to the state's library
            held = sharded.shards[buddy.holds]
            whole[held.start:held.stop] = xp.asarray(copy[name])
        group.Allreduce(whole.view(xp.uint8), slot=("rebuild", name), op="bor")
        full[name] = whole
    params = full.pop("params")
    return params, full
