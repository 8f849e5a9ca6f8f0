"""Gradients handed over piece by piece: a layer's backward into bucket-sized buffers.

Bound to the gradient buckets of a ZeRO-2/ZeRO-3 reduction
([`LayerStack.bind_gradient_pieces`][mpishard.nn.LayerStack.bind_gradient_pieces]),
a [`LayerStack`][mpishard.nn.LayerStack] writes each top-level layer's gradients
in *pieces*, each between the backward hooks' ``before`` and ``after``: a
group of whole tensors written in one go, or a block of rows of a 2-D weight
(``x[:, rows].T @ dy``). Pieces come in descending world offsets, so once a
piece is done every gradient above it is final and the bucket holding it can
be reduced; the buckets are cut at piece boundaries, so the two bucket buffers
are bounded by the bucket size rather than by the largest layer.

A layer says how it writes its gradients with ``handover_groups()``: groups of
local tensor names in the order its ``backward_params`` writes them (each
group's tensors contiguous, the groups in descending offsets), each
``(names, rows)``, ``rows`` True for one 2-D tensor written in row blocks. A
layer with that method gets a [`HandOver`][mpishard.nn.handover.HandOver] in
place of its gradient views; a layer without it is one group, written whole
between the hooks (its ``backward_params`` sees plain views).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..flat import ParamLayout, Range
from .base import Layer

__all__ = ["HandOver", "HandOverState", "Piece", "handover_groups", "plan_layer"]

#: ``(local names, rows)`` of one group, in a layer's backward order.
Group = tuple[tuple[str, ...], bool]


@dataclass
class Piece:
    """One piece of a layer's gradient: its world ``range``, the ``views`` its
    tensors' gradients go to (local name -> array; a row piece: the rows'
    block), the ``rows`` of a row piece (else None) and, once a backward
    accumulates, the ``scratch`` views the gradients are computed in first."""

    range: Range
    views: dict[str, Any]
    rows: slice | None = None
    scratch: dict[str, Any] | None = None


@dataclass
class HandOverState:
    """What every [`HandOver`][mpishard.nn.handover.HandOver] of one model
    shares: the hooks, whether the backward adds to the gradients, the
    accumulation scratch."""

    hooks: Any = None
    accumulate: bool = False
    scratch_size: int = 0
    scratch: Any = None
    xp: Any = None
    dtype: Any = None


@dataclass
class HandOver:
    """A layer's gradients by piece (see the module). ``pieces(name)``: the
    pieces of the group that starts with local ``name``, in backward order;
    ``begin(piece)`` calls the hooks' ``before`` and returns ``(views,
    scratch)`` (scratch None unless accumulating: compute there, then
    ``finish_gradient``); ``end(piece)`` calls ``after``. ``sub(prefix)``: the
    hand-over of a sub-layer (names under ``prefix.``). Local."""

    groups: dict[str, list[Piece]]
    shared: HandOverState
    subs: dict[str, HandOver] = field(default_factory=dict)
    #: One piece for the whole layer: it gets plain views, not this hand-over.
    whole: bool = False

    def pieces(self, name: str) -> list[Piece]:
        return self.groups[name]

    def sub(self, prefix: str) -> HandOver:
        return self.subs[prefix]

    def begin(self, piece: Piece) -> tuple[dict[str, Any], dict[str, Any] | None]:
        shared = self.shared
        if shared.hooks is not None:
            shared.hooks.before(piece.range)
        if not shared.accumulate:
            return piece.views, None
        if piece.scratch is None:
            piece.scratch = self._scratch_views(piece)
        return piece.views, piece.scratch

    def end(self, piece: Piece) -> None:
        if self.shared.hooks is not None:
            self.shared.hooks.after(piece.range)

    def backward(self, layer: Layer, dy: Any, buf: dict[str, Any]) -> None:
        """``layer.backward_params`` through this hand-over: given it, where the
        layer writes in pieces, else its one piece's views between the hooks."""
        if hasattr(layer, "handover_groups") and not self.whole:
            layer.backward_params(dy, buf, self, None)
            return
        (piece,) = next(iter(self.groups.values()))
        views, scratch = self.begin(piece)
        layer.backward_params(dy, buf, views, scratch)
        self.end(piece)

    def _scratch_views(self, piece: Piece) -> dict[str, Any]:
        # One flat buffer, the largest piece's size, serves every piece: each
        # tensor is computed there and added to its gradient before the next.
        shared = self.shared
        if shared.scratch is None:
            shared.scratch = shared.xp.empty(shared.scratch_size, dtype=shared.dtype)
        return {name: shared.scratch[:v.size].reshape(v.shape)
                for name, v in piece.views.items()}


def handover_groups(layer: Layer, names: list[str]) -> list[Group]:
    """``layer``'s groups (its ``handover_groups()``), or one group of all its
    tensors ``names`` (local, layout order) where it has none."""
    groups = getattr(layer, "handover_groups", None)
    if groups is None:
        return [(tuple(names), False)]
    return [(tuple(g), bool(rows)) for g, rows in groups()]


def plan_layer(layer: Layer, names: list[tuple[str, str]], layout: ParamLayout,
               max_elements: int, view: Callable[[Range], Any] | None,
               shared: HandOverState) -> tuple[list[Range], HandOver | None]:
    """Layer ``layer``'s pieces (world ranges, backward order) for pieces of at
    most ``max_elements`` (a row of a 2-D tensor longer than that is a piece of
    its own), and, given ``view`` (world range -> 1-D gradient array), its
    hand-over. ``names``: ``(local, global)`` tensor names in layout order.
    Groups that are not contiguous in descending offsets make the layer one
    piece (today's hand-over: a layer at a time)."""
    glob = dict(names)
    groups = handover_groups(layer, [local for local, _ in names])
    ranges = [_group_range(layout, [glob[n] for n in g]) for g, _ in groups]
    ordered = all(r is not None for r in ranges) and all(
        a.start >= b.stop for a, b in zip(ranges, ranges[1:]))
    if not ordered or sorted(n for g, _ in groups for n in g) != sorted(glob):
        groups = [(tuple(glob), False)]
        ranges = [_group_range(layout, list(glob.values()))]
    whole = len(groups) == 1 and not groups[0][1]
    plan: dict[str, list[Piece]] = {}
    out: list[Range] = []
    for (group, rows), r in zip(groups, ranges):
        if rows and len(group) == 1 and len(layout[glob[group[0]]].shape) >= 2:
            spans = _row_spans(layout[glob[group[0]]].shape, r, max_elements)
        else:
            spans = [(r, None)]
        out += [span for span, _ in spans]
        if view is not None:
            plan[group[0]] = [Piece(span, _views(layout, glob, group, span, rows, view(span)),
                                    rows) for span, rows in spans]
        shared.scratch_size = max(shared.scratch_size, max(len(s) for s, _ in spans))
    if view is None:
        return out, None
    hand = _nest(plan, shared)
    hand.whole = whole
    return out, hand


def _nest(plan: dict[str, list[Piece]], shared: HandOverState) -> HandOver:
    """The hand-over of ``plan`` (group pieces by first local name), with a
    sub-hand-over for each first name component (``"mlp"`` of
    ``"mlp.fc2.weight"``) whose groups and views are named under it."""
    hand = HandOver(plan, shared)
    for prefix in {name.split(".", 1)[0] for name in plan if "." in name}:
        cut = len(prefix) + 1
        inner = {name[cut:]: [Piece(p.range, {k[cut:]: v for k, v in p.views.items()}, p.rows)
                              for p in pieces]
                 for name, pieces in plan.items()
                 if all(k.startswith(prefix + ".") for p in pieces for k in p.views)}
        sub = hand.subs[prefix] = _nest(inner, shared)
        hand.subs.update({f"{prefix}.{k}": v for k, v in sub.subs.items()})
    return hand


def _group_range(layout: ParamLayout, names: list[str]) -> Range | None:
    specs = sorted((layout[n] for n in names), key=lambda s: s.offset)
    if any(a.range.stop != b.offset for a, b in zip(specs, specs[1:])):
        return None
    return Range(specs[0].offset, specs[-1].range.stop)


def _row_spans(shape: tuple[int, ...], r: Range,
               max_elements: int) -> list[tuple[Range, slice]]:
    """Row blocks of a tensor of ``shape`` at world range ``r``, last first."""
    width = math.prod(shape[1:])
    step = max(1, max_elements // max(width, 1))
    starts = range(0, shape[0], step)
    return [(Range(r.start + i * width, r.start + min(i + step, shape[0]) * width),
             slice(i, min(i + step, shape[0]))) for i in reversed(starts)]


def _views(layout: ParamLayout, glob: dict[str, str], group: tuple[str, ...], span: Range,
           rows: slice | None, flat: Any) -> dict[str, Any]:
    """The group's gradient views in ``flat`` (the 1-D gradient of ``span``)."""
    if rows is not None:
        shape = layout[glob[group[0]]].shape
        return {group[0]: flat.reshape((rows.stop - rows.start,) + tuple(shape[1:]))}
    out = {}
    for name in group:
        spec = layout[glob[name]]
        lo = spec.offset - span.start
        out[name] = flat[lo:lo + spec.size].reshape(spec.shape)
    return out
