"""Parameter placements: where a core's parameters and optimizer state live over ``groups.dp``.

One of the two parts of a data-parallel core (the other is its
[gradient reduction][mpishard.parallel.reduction]):

* [`Replicated`][mpishard.parallel.placement.Replicated]: every rank holds the
  whole parameters and state and applies the whole update (DDP);
* [`GatheredAfterStep`][mpishard.parallel.placement.GatheredAfterStep]: each
  rank updates its shard with state of the shard's length, and an in-place
  ``Allgatherv`` rebuilds the whole parameters after the step (ZeRO-2);
* [`GatheredBeforeUse`][mpishard.parallel.placement.GatheredBeforeUse]: each
  rank holds only its shard of the parameters too, and the model's layers
  gather them a bucket at a time just before they run (ZeRO-3).

A placement updates from the reduction's summed gradient of the range it owns
([`owned`][mpishard.parallel.placement.Placement.owned]), names its
communicators and says how its state is put back over the survivors of a lost
rank ([`Placement.recovery`][mpishard.parallel.placement.Placement]).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator
from typing import Any

from ..backend import to_numpy
from ..comm import FlatComm, ulfm
from ..comm.buckets import GradientBuckets
from ..comm.gather import ParameterGather
from ..flat import Range, bucket_ranges, shard_ranges, unit_ranges
from ..protocols import BACKWARD, Optimizer, built_shard_of

__all__ = ["RECOVERY_KINDS", "GatheredAfterStep", "GatheredBeforeUse", "Placement", "Replicated",
           "ShardedState"]

#: How a placement's state is put back over the survivors of a lost rank:
#: ``"replicated"`` (every survivor holds it whole: one of them sends it) or
#: ``"sharded"`` (each rank held a shard: put together from the survivors'
#: shards and the buddy copies, [`mpishard.recovery.shardcopy`][mpishard.recovery.shardcopy]).
RECOVERY_KINDS = ("replicated", "sharded")


def _nbytes(arrays: Any) -> int:
    return int(sum(a.nbytes for a in arrays))


class Placement:
    """What the three placements share: the model, the data group, the state."""

    #: How the state is put back over survivors (one of ``RECOVERY_KINDS``).
    recovery = "replicated"
    #: The model's passes communicate over ``groups.dp`` (ZeRO-3's parameter
    #: gathers): reproducible mode then runs the same passes on every rank.
    lockstep = False
    #: The parameter buckets and their gathers (ZeRO-3's; None: none).
    gather: ParameterGather | None = None
    #: The gathers' communicator, a duplicate of ``groups.dp`` (None: none).
    comm: FlatComm | None = None

    def __init__(self, model: Any, dp: FlatComm, xp: Any) -> None:
        self.model, self.dp, self.xp = model, dp, xp
        self.layout = model.layout
        built = built_shard_of(model)   # built in shards: params is None
        values = model.params if built is None else built[1]
        self.dtype = values.dtype if values is not None else None
        self.state: dict[str, Any] = {}

    def owned(self) -> Range:
        """The world range whose parameters this rank updates."""
        return Range(0, self.layout.size)

    def communicators(self) -> list[FlatComm]:
        """The communicators this placement waits on. Local."""
        return [self.dp]

    def release(self) -> None:
        """Free what this placement made on its groups."""

    def waited(self) -> float:
        """Seconds spent waiting for parameter gathers so far (0: none)."""
        return 0.0

    def after_step(self) -> None:
        """After the update: make the parameters current where they are read."""

    def parameter_shard(self) -> tuple[Range, Any]:
        """The world range of the parameters this rank holds, and them. Local."""
        return Range(0, self.layout.size), self.model.params

    @contextlib.contextmanager
    def gathered_parameters(self) -> Iterator[Any]:
        """The whole parameter vector for the ``with`` block (the model's own)."""
        yield self.model.params

    def unshard(self, params: Any = None) -> Placement:
        """The placement that holds the model's whole vector from now on (``params``
        written into it where given): this one, except for
        [`GatheredBeforeUse`][mpishard.parallel.placement.GatheredBeforeUse]."""
        if params is not None:
            self.model.params[...] = params
        return self

    def digest(self) -> tuple[str, str, str]:
        """``(hash, who, what)`` to compare across ``groups.dp``: every replica's
        whole parameter vector."""
        params = to_numpy(self.model.params)
        return (hashlib.blake2b(params.tobytes(), digest_size=16).hexdigest(),
                "replicas", "parameter hash")

    def report(self) -> dict[str, int]:
        """Extra entries of ``memory_report`` (none)."""
        return {}

    def admit(self, grown: FlatComm, newcomers: list[int]) -> None:
        """Give the ranks ``newcomers`` of ``grown`` (the data group with spare
        ranks added) this placement's state: replicated state sent whole by an
        old rank, sharded state re-sharded over ``grown``. Collective over ``grown``.

        Raises:
            NotImplementedError: always, for now: spare ranks that join a running
                job are planned; a job that grows restarts from a checkpoint.
        """
        raise NotImplementedError(
            f"{type(self).__name__}.admit: giving the state to ranks that join a running "
            f"job is not implemented yet; a job that grows restarts from a checkpoint")


class Replicated(Placement):
    """Every data-parallel rank holds the whole parameters and optimizer state and
    applies the same update, so the replicas stay identical (DDP)."""

    def __init__(self, model: Any, dp: FlatComm, xp: Any, optimizer: Optimizer) -> None:
        super().__init__(model, dp, xp)
        self.state = optimizer.init_state(model.params.size, model.params.dtype, xp)

    def update(self, optimizer: Optimizer, gradient: Any, step: int, lr: float,
               grad_scale: float) -> None:
        """Apply the update from ``gradient`` (of ``owned``). Local."""
        optimizer.update(self.model.params, gradient, self.state, step, lr, grad_scale)

    def memory(self) -> dict[str, int]:
        return {"parameters": int(self.model.params.nbytes),
                "optimizer_state": _nbytes(self.state.values()), "buffers": 0}

    def optimizer_state_shard(self) -> tuple[Range, dict[str, Any]]:
        return Range(0, self.layout.size), self.state

    def synchronize_optimizer_state(self, note: Callable[[int], None]) -> dict[str, Any]:
        """The full optimizer state by name (held whole already)."""
        return dict(self.state)


class ShardedState:
    """A rank's shard of the optimizer state ([`shard_ranges`][mpishard.flat.shard_ranges]
    over ``groups.dp``), the update of the parameters' shard, and the copy of both
    from before the last update (``keep_previous_step``). Shared by the two
    sharded placements (a ZeRO-3 placement that unshards hands it on)."""

    def __init__(self, size: int, dtype: Any, dp: FlatComm, xp: Any,
                 optimizer: Optimizer) -> None:
        self.dp, self.xp = dp, xp
        self.shards = shard_ranges(size, dp.size)
        self.shard = self.shards[dp.rank]
        self.counts = [len(s) for s in self.shards]
        self.state = optimizer.init_state(len(self.shard), dtype, xp)
        #: This rank's shard of the parameters and state before the last update
        #: (keys ``"params"`` and the state's), or None: not kept.
        self.previous: dict[str, Any] | None = None
        #: The step ``previous`` holds.
        self.previous_step = -1

    def keep_previous_step(self, params_shard: Any) -> None:
        """From now on keep ``previous`` before each update. Local."""
        if self.previous is None:
            xp = self.xp
            self.previous = {"params": xp.empty_like(params_shard),
                             **{name: xp.empty_like(v) for name, v in self.state.items()}}

    def update(self, optimizer: Optimizer, params_shard: Any, gradient: Any, step: int,
               lr: float, grad_scale: float) -> None:
        if self.previous is not None:   # step is this update's already
            self.previous["params"][...] = params_shard
            for name, value in self.state.items():
                self.previous[name][...] = value
            self.previous_step = step - 1
        if len(self.shard):
            optimizer.update(params_shard, gradient, self.state, step, lr, grad_scale)

    def synchronize(self, size: int, note: Callable[[int], None]) -> dict[str, Any]:
        """The whole state on every rank. Collective over ``groups.dp``."""
        full = {}
        for name, shard in self.state.items():
            whole = self.xp.zeros(size, dtype=shard.dtype)
            whole[self.shard.start:self.shard.stop] = shard
            if self.dp.size > 1:
                self.dp.Allgatherv(whole, self.counts, slot=("state", name))
            full[name] = whole
        note(_nbytes(full.values()))
        return full

    def nbytes(self) -> tuple[int, int]:
        """``(state, previous)`` bytes."""
        previous = _nbytes(self.previous.values()) if self.previous is not None else 0
        return _nbytes(self.state.values()), previous


class GatheredAfterStep(Placement):
    """Each rank updates its shard of the parameters (a view of the model's whole
    vector) with state of the shard's length; an in-place ``Allgatherv`` over
    ``groups.dp`` rebuilds the whole vector after the step (ZeRO-2).

    Args:
        sharded: the state shard ([`ShardedState`][mpishard.parallel.placement.ShardedState]).
    """

    recovery = "sharded"

    def __init__(self, model: Any, dp: FlatComm, xp: Any, sharded: ShardedState) -> None:
        super().__init__(model, dp, xp)
        self.sharded = sharded
        self.state = sharded.state
        self.shard = sharded.shard
        self.params_shard = (model.params[self.shard.start:self.shard.stop]
                             if model.params is not None else None)   # ZeRO-3's: its store

    def owned(self) -> Range:
        return self.shard

    def update(self, optimizer: Optimizer, gradient: Any, step: int, lr: float,
               grad_scale: float) -> None:
        """Update this rank's shard from ``gradient`` (of ``owned``). Local."""
        self.sharded.update(optimizer, self.params_shard, gradient, step, lr, grad_scale)

    def after_step(self) -> None:
        """Every rank's new shard into every rank's vector. Collective over ``groups.dp``."""
        if self.dp.size > 1:
            self.dp.Allgatherv(self.model.params, self.sharded.counts)

    def keep_previous_step(self) -> None:
        """From now on keep this rank's shard of the parameters and of the state as
        they were before each update
        ([`ShardedState`][mpishard.parallel.placement.ShardedState]'s
        ``previous``), so that a step interrupted after some ranks updated can
        be undone exactly ([`mpishard.recovery.shardcopy`][mpishard.recovery.shardcopy]). Costs one
        more shard of each and one copy of them per step. Local."""
        self.sharded.keep_previous_step(self.params_shard)

    def memory(self) -> dict[str, int]:
        state, previous = self.sharded.nbytes()
        return {"parameters": int(self.model.params.nbytes), "optimizer_state": state,
                "buffers": previous}

    def optimizer_state_shard(self) -> tuple[Range, dict[str, Any]]:
        return self.shard, self.state

    def synchronize_optimizer_state(self, note: Callable[[int], None]) -> dict[str, Any]:
        return self.sharded.synchronize(self.layout.size, note)


class GatheredBeforeUse(GatheredAfterStep):
    """Each rank holds only its shard of the parameters (ZeRO-3). A
    [`ShardableModel`][mpishard.protocols.ShardableModel] reads them from a few
    bucket-sized buffers: just before a layer runs, its bucket is gathered from
    every rank's shard ([`ParameterGather`][mpishard.comm.gather.ParameterGather],
    on a duplicate of ``groups.dp`` so the gathers keep their own order beside
    the gradient reductions), the next one gathering meanwhile (``prefetch``);
    the backward gathers again what has left its slot (or nothing, with
    ``keep``). Nothing is gathered after the step: the next forward gathers the
    new shard. Made at attach (collective over ``groups.dp``: the duplicate).
    """

    lockstep = True

    def __init__(self, model: Any, dp: FlatComm, xp: Any, sharded: ShardedState, *,
                 gather_elements: int, prefetch: bool, keep: bool, shard: Any = None) -> None:
        super().__init__(model, dp, xp, sharded)
        if shard is not None:    # a model already sharded (a recovery): its shard given
            self.dtype = shard.dtype
        self.units = unit_ranges(self.layout)
        #: The gather bucket size in elements (``gather_mb`` resolved).
        self.gather_elements = gather_elements
        # A shard given is kept as it is (built there, or a recovery moved it): no copy.
        self.store = shard if shard is not None else xp.empty(len(self.shard), dtype=self.dtype)
        #: The gathers' communicator: a duplicate of ``groups.dp``.
        self.comm = dp.dup(f"{dp.name} (parameter gathers)")
        if ulfm.is_on(dp):   # a lost rank is seen here too, as on the group
            ulfm.enable([self.comm], evict_stuck=dp.evict_stuck)
        self.gather = ParameterGather(
            list(reversed(bucket_ranges(self.layout, gather_elements))), sharded.shards,
            dp.rank, self.store, self.comm, prefetch=prefetch, keep=keep)
        self.gather.allocate(xp, self.dtype)
        self._reshard(given=shard is not None)

    def _reshard(self, given: bool = False) -> None:
        """Keep this rank's shard of the model's whole vector (``given``: the store
        holds it already), bind the model to the gather buffers and drop the
        vector. Local."""
        model, shard = self.model, self.shard
        if not given:
            self.store[...] = model.params[shard.start:shard.stop]
        self.params_shard = self.store
        self.gather.invalidate()
        model.bind_parameters(self.gather.views(self.layout))   # params is None now
        model.set_parameter_hooks(self.gather)

    def _whole(self, params: Any = None) -> Any:
        """The model bound to a whole vector again (``params``, or gathered:
        collective over ``groups.dp``), the gathers stopped; the vector."""
        full = self.xp.empty(self.layout.size, dtype=self.dtype)
        if params is None:
            full[self.shard.start:self.shard.stop] = self.params_shard
            if self.dp.size > 1:
                self.dp.Allgatherv(full, self.sharded.counts, slot="unshard")
            self.gather.invalidate()
        else:       # given the values (a recovery): the group may be broken
            full[...] = params
            self.gather.drop()
        self.model.set_parameter_hooks(None)
        self.model.bind_parameters(lambda name: self.layout.view(full, name), full)
        return full

    def unshard(self, params: Any = None) -> Placement:
        """A [`GatheredAfterStep`][mpishard.parallel.placement.GatheredAfterStep]
        over the model's whole vector again (``params``; local), or gathered from
        the shards (collective over ``groups.dp``), with this state."""
        self._whole(params)
        self.release()
        return GatheredAfterStep(self.model, self.dp, self.xp, self.sharded)

    @contextlib.contextmanager
    def gathered_parameters(self) -> Iterator[Any]:
        """Within: ``model.params`` is the whole vector (gathered: collective over
        ``groups.dp``), ``model.forward`` runs on any rank alone, writes to it are
        kept. On exit each rank takes its shard back (local)."""
        full = self._whole()
        try:
            yield full
        finally:
            self._reshard()

    def communicators(self) -> list[FlatComm]:
        return [self.dp, self.comm] if self.comm is not None else [self.dp]

    def release(self) -> None:
        if self.comm is not None:
            self.comm.free()
        self.comm = None

    def waited(self) -> float:
        return self.gather.seconds

    def after_step(self) -> None:
        # Nothing is gathered after the step: the next forward gathers the new shard.
        self.gather.invalidate()

    def parameter_shard(self) -> tuple[Range, Any]:
        """This rank's shard; writes to it are read by the next forward. Local."""
        self.gather.invalidate()     # the caller may write to it
        return self.shard, self.params_shard

    def replay(self, phases: list[str], buckets: GradientBuckets | None) -> None:
        """The hook calls the model's passes ``phases`` make, without a model: the
        parameter hooks around each unit and (``buckets``: a bucketed backward)
        the gradient hooks inside them, each unit's gradient zero (a piece per
        bucket it overlaps: the buckets may be cut inside a layer, at the
        pieces the model hands its gradients over in). Collective
        over the gathers' group (and, with ``buckets``, ``groups.dp``)."""
        gather = self.gather
        for phase in phases:
            backward = phase == BACKWARD
            for u in (reversed(self.units) if backward else self.units):
                gather.before(u, phase)
                if backward and buckets is not None:
                    _replay_gradient(buckets, u)
                gather.after(u, phase)

    def digest(self) -> tuple[str, str, str]:
        """Each parameter lives on one rank: a hash of each bucket as gathered.
        Collective over the gathers' group."""
        digest = hashlib.blake2b(digest_size=16)
        for _, values in self.gather.each_bucket():
            digest.update(to_numpy(values).tobytes())
        return digest.hexdigest(), "ranks", "gathered parameter hash"

    def memory(self) -> dict[str, int]:
        state, previous = self.sharded.nbytes()
        return {"parameters": int(self.store.nbytes), "gathered": self.gather.nbytes,
                "optimizer_state": state, "buffers": previous}

    def report(self) -> dict[str, int]:
        return {"gathered_peak": self.gather.peak * self.dtype.itemsize}


def _replay_gradient(buckets: GradientBuckets, unit: Range) -> None:
    """A zero gradient of ``unit`` handed over as a backward does: its part of
    each bucket it overlaps, highest first, between the hooks (each bucket is
    launched in the unit that holds its lowest offset, as in the backward)."""
    for j in range(buckets.index_of(unit.stop - 1), buckets.index_of(unit.start) + 1):
        b = buckets.ranges[j]
        piece = b.intersect(unit)
        buckets.before(piece)
        buckets.source(j)[piece.start - b.start:piece.stop - b.start].fill(0)
        buckets.after(piece)
