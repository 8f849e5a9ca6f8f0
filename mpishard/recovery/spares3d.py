"""Spare ranks in a 3D layout (tensor x pipeline x data, ULFM): a spare takes the lost
rank's three coordinates, and its slice's state comes from its data-parallel replica.

In a layout with ``tp * pp > 1`` a rank holds a tensor slice of one pipeline stage;
the ranks with the same ``(tensor, pipeline)`` coordinates in the other replicas
(its data-parallel group) hold the same slice: whole with hybrid DDP, in shards
with a buddy copy of each (hybrid ZeRO-2 and ZeRO-3). So with ``dp >= 2`` a lost
rank's state is still there, and a spare can take its place instead of dropping
its replica ([`mpishard.recovery.replicas`][mpishard.recovery.replicas]).
[`promote_spares`][mpishard.recovery.spares.promote_spares] does the rest as for a
flat layout (the new training world is split with the lost rank's key, so every
group, tensor, pipeline and data, is rebuilt at full size with the same rank
order); this module is its 3D part:

* on the survivors, before the spares are woken,
  [`agree_3d`][mpishard.recovery.spares3d.agree_3d]: the step every slice goes on
  from and where its state is. Hybrid DDP: the newest step that every
  ``(tensor, pipeline)`` coordinate has a survivor at (the update after the
  step's ``Allreduce`` is local: the survivors may differ by one), each
  coordinate's state from its lowest data-parallel rank at that step. Sharded
  state: the newest step every data-parallel group can rebuild exactly from its
  survivors' shards and the buddy copies, each survivor's pieces of it (nothing
  whole);
* on every rank of the new world,
  [`send_state_3d`][mpishard.recovery.spares3d.send_state_3d]: the model is
  built again over the new groups (the same stage boundaries; a newcomer builds
  the lost rank's stage and tensor slice; ZeRO-3's in shards), and the state goes to
  each data group's newcomer: hybrid DDP, its slice by a ``Bcast`` over the data
  group; hybrid ZeRO-2 and ZeRO-3, only its shard of the parameters and of the
  optimizer state, from the buddy copy that holds it
  ([`resplit`][mpishard.recovery.resplit.resplit]: the group keeps its split, so the
  survivors keep theirs), and ZeRO-2's whole parameters by its ``Allgatherv``. No
  rank holds a whole slice of sharded state.

With ``dp == 1`` no survivor holds the lost slice: the promotion hands over (exit 75).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..comm import FlatComm
from ..config import ShardingConfiguration
from ..flat import ParameterShard, Range, shard_ranges
from ..nn.hybrid import HybridShardedModel
from ..parallel.options import REDUCE_METHODS
from ..parallel.overlap import learn_decisions
from ..protocols import StrategyCore
from .common import put_state
from .resplit import Moved, resplit
from .shardcopy import ShardBuddy, sharded_pieces, zero2_candidates

__all__ = ["agree_3d", "newest_common_step", "send_state_3d", "short_of_spares"]


def newest_common_step(every: list[tuple[int, int, int, int]]
                       ) -> tuple[int | None, dict[tuple[int, int], int]]:
    """Hybrid DDP: from each survivor's ``(dp, tp, pp, step count)``, the newest
    step that every ``(tp, pp)`` coordinate has a survivor at, and for each
    coordinate the lowest data-parallel rank there at that step (its source);
    ``(None, {})`` when no step is common. Pure.

    Example: ``[(0, 0, 0, 5), (1, 0, 0, 4), (1, 1, 0, 4)]``: ``(4, {(0, 0): 1, (1, 0): 1})``.
    """
    counts: dict[tuple[int, int], dict[int, int]] = {}
    for d, t, p, step in sorted(every):
        counts.setdefault((t, p), {}).setdefault(step, d)
    common = set.intersection(*(set(c) for c in counts.values())) if counts else set()
    if not common:
        return None, {}
    step = max(common)
    return step, {key: steps[step] for key, steps in counts.items()}


def agree_3d(core: StrategyCore, buddy: ShardBuddy | None, world: FlatComm
             ) -> tuple[int, dict[str, Any] | None, str | None, dict[str, Any]]:
    """On the survivors ``world`` of a 3D layout's training world: ``(step, pieces,
    problem, layout)``: the step they go on from; ``pieces``: sharded state, what
    this rank holds of its data group's slice at it (its own shard, the buddy copy
    of a lost neighbour's: [`sharded_pieces`][mpishard.recovery.shardcopy.sharded_pieces]),
    None for replicated state; why the spares cannot be promoted (or
    None); ``layout``: what every rank of the new world needs (the stage
    boundaries, each coordinate's source rank or the state's names), for the
    ``info`` the newcomers receive. Collective over ``world``."""
    me, topo = core.config.groups.coordinates, core.config.topology
    layout: dict[str, Any] = {"stages": [list(r) for r in core.model.stage_ranges]}
    every = world.allgather((me.dp, me.tp, me.pp, core.step_count))
    newest = max(e[3] for e in every)
    held = {(t, p) for _, t, p, _ in every}
    gone = [(t, p) for p in range(topo.pp) for t in range(topo.tp) if (t, p) not in held]
    if gone:
        return (newest, None,
                f"every rank holding the slice (tensor, pipeline) = {gone[0]} is lost "
                f"(all {topo.dp} data-parallel ranks of it)", layout)
    if core.placement.recovery != "sharded":
        step, roots = newest_common_step(every)
        if step is None:
            return (newest, None,
                    f"no step is held at every (tensor, pipeline) coordinate by a "
                    f"survivor (steps by (dp, tp, pp): {sorted(every)})", layout)
        layout["roots"] = roots
        return step, None, None, layout
    # The survivors of this rank's data-parallel group, in the old dp order.
    group = world.split(me.pp * topo.tp + me.tp, me.dp, "data-parallel survivors")
    try:
        mine = zero2_candidates(core, buddy, group)
        common = set.intersection(*map(set, world.allgather(sorted(mine))))
        if not common:
            return (newest, None,
                    "the optimizer-state shard of a lost rank is gone (no buddy copy of it "
                    "in its data-parallel group): restart from a checkpoint", layout)
        step = max(common)
        # Its own shard and the buddy copy of a lost neighbour's: nothing whole.
        pieces = sharded_pieces(core, buddy, group, step)
    finally:
        group.free()
    layout["names"] = [(k, np.dtype(v.dtype).str) for k, v in pieces[0][1].items()]
    layout["sharded_params"] = core.model.params is None     # ZeRO-3's
    return step, pieces, None, layout


def send_state_3d(core: StrategyCore, config: ShardingConfiguration, info: dict[str, Any],
                  held: list[tuple[Range, dict[str, Any]]] | None) -> int:
    """The model and ``core`` rebuilt over ``config`` (the survivors and the promoted
    spares, each at its coordinates) and each data-parallel group's agreed state sent
    to its newcomer; the bytes the newcomers received, together.
    ``info["layout3d"]``: [`agree_3d`][mpishard.recovery.spares3d.agree_3d]'s
    ``layout``; ``held``: its pieces on a survivor of sharded state, else None.
    Collective over ``config.world``."""
    layout = info["layout3d"]
    model = core.model
    newcomer = core.reduction is None
    if newcomer:   # decides as the survivors did
        learn_decisions(info["overlap"])
        if info["reduce_method"] in REDUCE_METHODS and hasattr(core.options, "reduce_method"):
            core.replace_options(reduce_method=info["reduce_method"])
    sharded = "names" in layout
    seat_model(model, config, layout["stages"], keep=not newcomer and not sharded,
               in_shards=sharded and layout["sharded_params"])
    dp = config.groups.dp
    if sharded:
        return _move_slice_shards(core, config, layout, held or [])
    c = config.groups.coordinates
    root = layout["roots"][(c.tp, c.pp)]
    dp.Bcast(model.params, root=root, slot=("spares", "params"))
    old_state = None if newcomer else dict(core.state)
    core.rebuild(config)
    put_state(core, None, old_state if old_state is not None else dict(core.state), dp, root)
    mine = model.params.nbytes + sum(v.nbytes for v in core.state.values()) if newcomer else 0
    return sum(config.world.allgather(mine))


def _move_slice_shards(core: StrategyCore, config: ShardingConfiguration,
                       layout: dict[str, Any], pieces: list[tuple[Range, dict[str, Any]]]
                       ) -> int:
    """Sharded state (hybrid ZeRO-2, ZeRO-3): the data group keeps its split, so each
    survivor keeps its shard and the newcomer receives the lost one from the buddy
    copy ([`resplit`][mpishard.recovery.resplit.resplit]), nothing whole: ZeRO-3's
    parameters stay in shards (the stage was built so), ZeRO-2's whole parameters
    are put together by its ``Allgatherv``. The bytes the newcomers received,
    together. Collective over ``config.groups.dp`` (``config.world`` in the rebuild)."""
    dp, model = config.groups.dp, core.model
    newcomer = core.reduction is None
    xp, size = model.xp, model.layout.size
    shards = shard_ranges(size, dp.size)
    want = shards[dp.rank]
    dtypes = {name: np.dtype(dtype) for name, dtype in layout["names"]}
    params = {"params": dtypes.pop("params")}
    moved = Moved()
    if layout["sharded_params"]:     # straight into the stage's new shard, kept as the store
        built = model.built_shard()
        out = {"params": built[1]} if built is not None and built[0] == want else None
        store = resplit(dp, pieces, want, params, xp, moved, out=out)["params"]
        core.rebuild(config, shard=store)
    else:
        resplit(dp, pieces, want, params, xp, moved,
                out={"params": model.params[want.start:want.stop]})
        if dp.size > 1:
            dp.Allgatherv(model.params, [len(s) for s in shards], slot="recovery")
        core.rebuild(config, agreed=True)
    resplit(dp, pieces, want, dtypes, xp, moved, out=core.state)
    pieces.clear()
    mine = 0
    if newcomer:    # its shard of each vector, and ZeRO-2's gathered parameters
        mine = len(want) * sum(d.itemsize for d in dtypes.values())
        mine += (len(want) if layout["sharded_params"] else size) * params["params"].itemsize
    return sum(config.world.allgather(mine))


def seat_model(model: HybridShardedModel, config: ShardingConfiguration,
               stages: list[list[int]], keep: bool, in_shards: bool = False) -> None:
    """Build ``model`` again over ``config`` in place (the same object, factory,
    micro-batches, schedule and stage boundaries ``stages``), at this rank's
    coordinates there: a survivor's own (its parameters kept where ``keep``), a
    promoted spare's the lost rank's (its placeholder freed first). ``in_shards``:
    ZeRO-3's stage, built in shards over the data group, nothing whole.
    Collective over ``config.world``."""
    params = model.params.copy() if keep and model.params is not None else None
    model.stage_model = model.runner = None    # the old stage goes before the new one
    dp = config.groups.dp
    HybridShardedModel.__init__(model, model._factory, config,
                                micro_batches=model.micro_batches, schedule=model.schedule,
                                stages=[tuple(s) for s in stages],
                                shard=ParameterShard(dp.rank, dp.size) if in_shards else None)
    if params is not None and model.params is not None:
        model.params[...] = params


def short_of_spares(lost: int, seated: int) -> str | None:
    """Why a 3D layout cannot go on with ``seated`` spares promoted for ``lost``
    lost training ranks, or None: it needs one for each (a layout with holes has
    no tensor and pipeline groups). Pure."""
    if seated >= lost:
        return None
    return (f"{lost} training rank(s) lost, {seated} spare(s) alive: a 3D layout needs a "
            f"spare for each lost rank")
