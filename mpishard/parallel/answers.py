"""``RecoveryAnswers``: what a core answers a recovery after a lost rank.

Mixed into [`DataParallelCore`][mpishard.parallel.base.DataParallelCore], these
are its side of [`RecoverableCore`][mpishard.protocols.RecoverableCore]
([`mpishard.recovery`][mpishard.recovery] asks them, never the core's class):
the communicators to revoke (the groups' and each part's own), why it cannot go
on in place, whether whole 3D replicas go on instead, and the whole parameter
vector put together by the survivors. How a part's state is put back is the
part's own answer (``placement.recovery``); the step count and data position
are set through ``set_progress``
([`Progress`][mpishard.parallel.progress.Progress]).
"""

from __future__ import annotations

from typing import Any

from ..comm import FlatComm
from ..config import ShardingConfiguration

__all__ = ["RecoveryAnswers"]


class RecoveryAnswers:
    """A core's answers to a recovery, from its groups and its parts (its
    ``reduction`` and ``placement``, None before attach), and the core set up
    again over the survivors (``rebuild``: the core's ``_over`` and ``attach``)."""

    #: A lost rank takes its whole model replica with it (a 3D layout): the
    #: recovery drops replicas ([`mpishard.recovery.replicas`][mpishard.recovery.replicas])
    #: instead of rebuilding over every survivor.
    drops_replicas = False

    def communicators(self) -> list[FlatComm]:
        """Every communicator this core and its model wait on: the world, the data,
        tensor and pipeline groups, the step's group and the parts' own (a
        two-level or ring reduction's, ZeRO-3's gathers'). For a recovery to
        revoke. Local."""
        groups = self.config.groups
        found = [groups.world, groups.dp, groups.tp, groups.pp]
        if self.totals.group is not None:
            found.append(self.totals.group)
        for part in (self.reduction, self.placement):
            if part is not None:
                found.extend(part.communicators())
        unique: list[FlatComm] = []
        for comm in found:
            if all(comm is not seen for seen in unique):
                unique.append(comm)
        return unique

    def recovery_problem(self) -> str | None:
        """Why this core cannot be rebuilt over the survivors of a lost rank, or None.
        Local."""
        topo = self.config.topology
        if topo.tp * topo.pp != 1:
            return (f"the layout has tensor_parallel_size={topo.tp} and "
                    f"pipeline_parallel_size={topo.pp}: the lost rank held a piece of the "
                    f"model that no survivor has")
        if self.model is None:
            return f"in-place recovery needs an attached model, {self.public} has none"
        return None

    def whole_parameters(self, params: Any) -> None:
        """Give the model the whole vector ``params`` (the same on every rank: what
        the survivors put together), without gathering over the possibly broken
        ``groups.dp``; sharded parameters are sharded again by ``rebuild``. Local."""
        self.placement = self.placement.unshard(params)

    def rebuild(self, config: ShardingConfiguration, shard: Any = None, *,
                agreed: bool = False) -> None:
        """Set this core up again over ``config``'s groups (after a lost rank: the
        survivors'), keeping the optimizer, every option and the attached model.
        A model whose parameters are gathered before use stays sharded where
        ``shard`` is given (this rank's shard under ``config``, the old gathers
        dropped: nothing whole), else it gets its whole vector back first
        (gathered over the old ``groups.dp``: unshard it with the values where
        that group is broken). ``agreed``: every rank holds the parameters to go
        on with already (a promotion sent them): not broadcast from rank 0 again.
        The optimizer state starts from zero (the caller
        puts it back), the step count and data position stay. Collective over
        ``config.world`` (and, without ``shard``, the old ``groups.dp``)."""
        model = self.model
        opened = self.memory_phases.enter("recovery")
        if model is not None and model.params is None:   # gathered before use
            if shard is None:
                self.placement = self.placement.unshard()
            elif self.placement is not None and self.placement.gather is not None:
                self.placement.gather.drop()             # the old group may be broken
        self._release()
        self._shed()
        self._over(config)
        self.model = None
        if model is not None:
            self._attach(model, shard if model.params is None else None, agreed=agreed)
        self.memory_phases.leave(opened)

    def _shed(self) -> None:
        """Drop what the old layout held (the gradient shard, the gradient and
        gather buckets, the parameter and state shards) before the new one is
        allocated: a recovery's peak is then the new layout and what it moves,
        not both layouts. The model's views of the old buckets go when it is
        bound to the new ones. The reduction stays (its choices are kept). Local."""
        if self.reduction is not None:
            self.reduction.shed()
        self.placement = None
        self.buckets = None
        self._sums = self._repro = None

    def _release(self) -> None:
        """Free what the parts made on the old groups."""
        for part in (self.reduction, self.placement):
            if part is not None:
                part.release()
