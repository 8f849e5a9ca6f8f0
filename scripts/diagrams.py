"""Write the documentation's diagrams as SVG files (docs/guide/img/), from the library.

    .venv/bin/python scripts/diagrams.py           # write them
    .venv/bin/python scripts/diagrams.py --check   # exit 1 if a file is not up to date

Plain SVG, drawn here, so the pages show them without JavaScript or a network (a
cluster's login node often has none; Mermaid would load from a CDN). The numbers
come from the library's pure modules: the shards from `mpishard.flat.shard_ranges`,
the rank grid from `mpishard.topology.Topology`, the pipeline timelines from
`mpishard.pipeline.schedules.schedule`. scripts/test.sh runs --check.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mpishard.flat import shard_ranges
from mpishard.pipeline.schedules import peak_in_flight, schedule
from mpishard.topology import Topology

OUT = Path(__file__).resolve().parents[1] / "docs" / "guide" / "img"
FONT = "font-family=\"Helvetica, Arial, sans-serif\""
TENSOR_COLOURS = ["#8fb8de", "#f4b183", "#a9d18e", "#ffd966", "#c9a0dc", "#9dc3e6"]
RANK_COLOURS = ["#1f4e79", "#c55a11", "#548235", "#7030a0"]
F_COLOUR, B_COLOUR = "#9dc3e6", "#f4b183"
PIPELINE_FILLS = ["#c5e0b4", "#ffe699", "#bdd7ee", "#f8cbad"]


class Svg:
    def __init__(self, width: int, height: int, title: str):
        self.parts = [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" role="img" {FONT} font-size="13">',
            f"<title>{title}</title>",
            f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
        ]

    def rect(self, x, y, w, h, fill="none", stroke="#404040", extra=""):
        self.parts.append(f'<rect x="{x:g}" y="{y:g}" width="{w:g}" height="{h:g}" '
                          f'fill="{fill}" stroke="{stroke}" {extra}/>')

    def text(self, x, y, s, anchor="middle", size=13, extra=""):
        self.parts.append(f'<text x="{x:g}" y="{y:g}" text-anchor="{anchor}" '
                          f'font-size="{size}" {extra}>{s}</text>')

    def line(self, x1, y1, x2, y2, stroke="#404040", extra=""):
        self.parts.append(f'<line x1="{x1:g}" y1="{y1:g}" x2="{x2:g}" y2="{y2:g}" '
                          f'stroke="{stroke}" {extra}/>')

    def done(self) -> str:
        return "\n".join(self.parts + ["</svg>"]) + "\n"


# --- ZeRO: the flat vector, its shards, and what each strategy keeps per rank -------------

TENSORS = [("0.weight", 40), ("0.bias", 8), ("1.weight", 56), ("1.bias", 8),
           ("2.weight", 26), ("2.bias", 4)]
RANKS = 4


def zero_shards() -> str:
    n = sum(size for _, size in TENSORS)
    shards = shard_ranges(n, RANKS)
    x0, width = 110, 620
    scale = width / n
    svg = Svg(760, 465, "A flat vector cut into ZeRO shards, and what each strategy keeps")
    svg.text(20, 26, f"One flat vector of {n} elements (6 tensors), {RANKS} data-parallel "
             "ranks: shard r is one contiguous range", anchor="start", size=14,
             extra='font-weight="bold"')
    # the tensors
    y = 60
    svg.text(x0 - 10, y + 22, "tensors", anchor="end")
    offset = 0
    for i, (name, size) in enumerate(TENSORS):
        svg.rect(x0 + offset * scale, y, size * scale, 34, TENSOR_COLOURS[i % 6])
        svg.text(x0 + (offset + size / 2) * scale, y - 6 if size < 12 else y + 22,
                 name, size=12 if size >= 12 else 10)
        offset += size
    # the shards, crossing the tensor boundaries
    y = 118
    svg.text(x0 - 10, y + 22, "shards", anchor="end")
    for r, (a, b) in enumerate(shards):
        colour = RANK_COLOURS[r]
        svg.rect(x0 + a * scale + 1, y, (b - a) * scale - 2, 34, colour, colour,
                 'fill-opacity="0.18"')
        svg.text(x0 + (a + b) / 2 * scale, y + 16, f"rank {r}", extra=f'fill="{colour}"')
        svg.text(x0 + (a + b) / 2 * scale, y + 29, f"[{a}, {b})", size=11,
                 extra=f'fill="{colour}"')
    offset = 0
    for _, size in TENSORS[:-1]:
        offset += size
        svg.line(x0 + offset * scale, 60, x0 + offset * scale, 152, "#404040",
                 'stroke-dasharray="3,3"')
    svg.text(x0, 172, f"ceil({n} / {RANKS}) = {shards[0].stop} elements a shard; the last "
             f"is shorter ({shards[-1].stop - shards[-1].start}), so no padding reaches a "
             "parameter.", anchor="start", size=11)
    svg.text(x0, 187, "Dashed: the tensor boundaries, which the shards ignore "
             "(mpishard.flat.shard_ranges).", anchor="start", size=11)
    # what each strategy keeps: rank 1's view
    keep = 1
    y = 225
    svg.text(20, y, f"What rank {keep} of {RANKS} keeps between steps (filled: held; "
             "grey: held by the other ranks only)", anchor="start", size=14,
             extra='font-weight="bold"')
    columns = ["parameters", "reduced gradient", "optimizer state"]
    col_x = [140, 345, 550]
    col_w = 180
    for cx, title in zip(col_x, columns):
        svg.text(cx + col_w / 2, y + 30, title)
    rows = [
        ("DDP", (True, True, True), "the whole vector three times"),
        ("ZeRO-2", (True, False, False), "1/N of the gradient and state; two bucket-sized "
         "gradient buffers while the backward runs"),
        ("ZeRO-3", (False, False, False), "1/N of everything; the few buckets being used "
         "are gathered into slot buffers"),
    ]
    for j, (label, full, note) in enumerate(rows):
        ry = y + 45 + j * 70
        svg.text(125, ry + 17, label, anchor="end", size=14, extra='font-weight="bold"')
        for cx, whole in zip(col_x, full):
            for r, (a, b) in enumerate(shards):
                held = whole or r == keep
                fill = RANK_COLOURS[keep] if held else "#e7e6e6"
                opacity = 'fill-opacity="0.55"' if held else ""
                svg.rect(cx + a * col_w / n, ry, (b - a) * col_w / n, 24, fill, "#808080",
                         opacity)
        svg.text(140, ry + 42, note, anchor="start", size=11)
    return svg.done()


# --- the 3D rank grid --------------------------------------------------------------------------

def rank_grid() -> str:
    topo = Topology.build(8, tp=2, pp=2)
    svg = Svg(760, 380, "The ranks of a tp2-dp2-pp2 layout and their groups")
    svg.text(20, 26, "8 ranks, tp = dp = pp = 2:  rank = (pp_rank * dp + dp_rank) * tp + "
             "tp_rank", anchor="start", size=14, extra='font-weight="bold"')
    cell_w, cell_h = 92, 56
    origin = {0: (90, 90), 1: (430, 90)}
    centres = {}
    for pp in range(topo.pp):
        ox, oy = origin[pp]
        svg.rect(ox - 20, oy - 38, topo.tp * cell_w + 40 + 30, topo.dp * cell_h + 70,
                 "#f2f2f2", "#a6a6a6", 'rx="8"')
        svg.text(ox + topo.tp * cell_w / 2 + 15, oy - 18, f"pipeline stage {pp} "
                 f"(pp_rank {pp})", size=13, extra='font-weight="bold"')
        for tp in range(topo.tp):
            svg.text(ox + 30 + tp * cell_w + cell_w / 2, oy + 2, f"tp_rank {tp}", size=11)
        for dp in range(topo.dp):
            y = oy + 10 + dp * cell_h
            svg.text(ox + 22, y + cell_h / 2 + 4, f"dp {dp}", anchor="end", size=11)
            for tp in range(topo.tp):
                rank = topo.rank(dp=dp, tp=tp, pp=pp)
                x = ox + 30 + tp * cell_w
                fill = PIPELINE_FILLS[topo.pipeline_group(rank)[0]]   # one colour a group
                svg.rect(x + 6, y + 6, cell_w - 12, cell_h - 12, fill, "#404040",
                         'rx="4"')
                svg.text(x + cell_w / 2, y + cell_h / 2 + 5, f"rank {rank}", size=14,
                         extra='font-weight="bold"')
                centres[rank] = (x + cell_w / 2, y + cell_h / 2)
    # tensor groups: rows (blue), data groups: columns (orange, dashed)
    seen = set()
    for rank in range(topo.world):
        group = tuple(topo.tensor_group(rank))
        if group in seen:
            continue
        seen.add(group)
        xs = [centres[r][0] for r in group]
        yc = centres[group[0]][1]
        svg.rect(min(xs) - cell_w / 2 + 2, yc - cell_h / 2 + 2, max(xs) - min(xs) + cell_w - 4,
                 cell_h - 4, "none", "#2e75b6", 'stroke-width="2.5" rx="8"')
    seen = set()
    for rank in range(topo.world):
        group = tuple(topo.data_group(rank))
        if group in seen:
            continue
        seen.add(group)
        ys = [centres[r][1] for r in group]
        xc = centres[group[0]][0]
        svg.rect(xc - cell_w / 2 + 8, min(ys) - cell_h / 2 + 8, cell_w - 16,
                 max(ys) - min(ys) + cell_h - 16, "none", "#c55a11",
                 'stroke-width="2" stroke-dasharray="6,4" rx="6"')
    # between the stages: what the pipeline groups carry
    mid_y = origin[0][1] + 10 + topo.dp * cell_h / 2
    x1 = origin[0][0] + topo.tp * cell_w + 50
    x2 = origin[1][0] - 20
    svg.parts.append('<defs><marker id="arrow" markerWidth="8" markerHeight="8" refX="7" '
                     'refY="4" orient="auto"><path d="M0,0 L8,4 L0,8 z" fill="#548235"/>'
                     '</marker></defs>')
    svg.line(x1 + 4, mid_y - 8, x2 - 6, mid_y - 8, "#548235",
             'stroke-width="2" marker-end="url(#arrow)"')
    svg.line(x2 - 4, mid_y + 8, x1 + 6, mid_y + 8, "#548235",
             'stroke-width="2" marker-end="url(#arrow)"')
    svg.text((x1 + x2) / 2, mid_y - 14, "activations", size=10, extra='fill="#548235"')
    svg.text((x1 + x2) / 2, mid_y + 24, "gradients", size=10, extra='fill="#548235"')
    # legend, the groups as the library computes them
    def groups(fn):
        out, seen_ = [], set()
        for r in range(topo.world):
            g = tuple(fn(r))
            if g not in seen_:
                seen_.add(g)
                out.append("{" + ",".join(map(str, g)) + "}")
        return " ".join(out)

    ly = 280
    for i, (colour, dash, label, fn) in enumerate([
            ("#2e75b6", "", "tensor groups (innermost: neighbours, one node)",
             topo.tensor_group),
            ("#c55a11", 'stroke-dasharray="6,4"', "data groups (same tp_rank and stage)",
             topo.data_group),
            ("#548235", "", "pipeline groups (one fill colour: same tp and dp rank)",
             topo.pipeline_group)]):
        y = ly + i * 34
        if i == 2:
            for k, fill in enumerate(PIPELINE_FILLS):
                svg.rect(40 + k * 10, y - 7, 10, 14, fill, "#808080")
        else:
            svg.line(40, y, 80, y, colour, f'stroke-width="3" {dash}')
        svg.text(92, y + 5, label, anchor="start", size=13)
        svg.text(470, y + 5, groups(fn), anchor="start", size=13,
                 extra='font-family="monospace"')
    return svg.done()


# --- the pipeline schedules ---------------------------------------------------------------

def timeline(name: str, stages: int, micro: int) -> dict[int, list[tuple[int, str, int]]]:
    """Start slot of each action when a forward and a backward take one slot each.

    Each stage runs its actions (the library's schedule) in order; a forward waits for
    the previous stage's forward of that micro-batch, a backward for the next stage's
    backward of it.
    """
    actions = {s: schedule(name, stages, micro, s) for s in range(stages)}
    done: dict[tuple[str, int, int], int] = {}
    cursor = dict.fromkeys(range(stages), 0)
    free = dict.fromkeys(range(stages), 0)
    placed: dict[int, list[tuple[int, str, int]]] = {s: [] for s in range(stages)}
    while any(cursor[s] < len(actions[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            if cursor[s] == len(actions[s]):
                continue
            kind, m = actions[s][cursor[s]]
            dep = (("F", s - 1, m) if kind == "F" and s > 0
                   else ("B", s + 1, m) if kind == "B" and s < stages - 1 else None)
            if dep is not None and dep not in done:
                continue
            start = max(free[s], done[dep] if dep else 0)
            done[(kind, s, m)] = start + 1
            free[s] = start + 1
            placed[s].append((start, kind, m))
            cursor[s] += 1
            progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {name} deadlocks")
    return placed


def pipeline_schedules(stages: int = 4, micro: int = 6) -> str:
    slot, row_h, x0 = 34, 30, 120
    span = 2 * (micro + stages - 1)
    height = 70 + 2 * (stages * row_h + 50) + 30
    svg = Svg(x0 + span * slot + 150, height, "GPipe and 1F1B pipeline schedules")
    svg.text(20, 26, f"{stages} stages, {micro} micro-batches; a forward (F) and a backward "
             "(B) take one slot each", anchor="start", size=14, extra='font-weight="bold"')
    y = 60
    for name, title in (("gpipe", "GPipe: all forwards, then all backwards"),
                        ("1f1b", "1F1B: warm-up forwards, then one forward, one backward")):
        placed = timeline(name, stages, micro)
        svg.text(20, y + 4, title, anchor="start", size=13, extra='font-weight="bold"')
        svg.text(x0 + span * slot + 14, y + 4, "activations held", anchor="start", size=11)
        for s in range(stages):
            ry = y + 14 + s * row_h
            svg.text(x0 - 10, ry + row_h / 2 + 4, f"stage {s}", anchor="end")
            svg.rect(x0, ry, span * slot, row_h - 4, "#f7f7f7", "#d0d0d0")
            for start, kind, m in placed[s]:
                svg.rect(x0 + start * slot, ry, slot, row_h - 4,
                         F_COLOUR if kind == "F" else B_COLOUR, "#404040")
                svg.text(x0 + start * slot + slot / 2, ry + row_h / 2 + 2, f"{kind}{m}",
                         size=12)
            peak = peak_in_flight(schedule(name, stages, micro, s))
            svg.text(x0 + span * slot + 14, ry + row_h / 2 + 2, f"at most {peak}",
                     anchor="start", size=12)
        y += stages * row_h + 50
    bubble = (stages - 1) / (micro + stages - 1)
    svg.text(20, y - 14, f"Grey: idle. Both keep each stage idle (p - 1) / (m + p - 1) = "
             f"{stages - 1}/{micro + stages - 1} = {bubble:.0%} of the step (the bubble);",
             anchor="start", size=12)
    svg.text(20, y + 4, "1F1B holds at most p - stage micro-batches' activations instead of "
             "m (mpishard.pipeline.schedules).", anchor="start", size=12)
    return svg.done()


DIAGRAMS = {
    "zero-shards.svg": zero_shards,
    "rank-grid-3d.svg": rank_grid,
    "pipeline-schedules.svg": pipeline_schedules,
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="only compare, write nothing")
    args = ap.parse_args(argv)
    stale = []
    for name, draw in DIAGRAMS.items():
        path = OUT / name
        text = draw()
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
        else:
            OUT.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print("diagrams not up to date (run .venv/bin/python scripts/diagrams.py):",
              *stale, sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
