"""Cutting a list of layers into pipeline stages. Pure."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["balance_stages", "check_boundaries"]


def balance_stages(costs: Sequence[int], stages: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, stop)`` layer ranges, one per stage, that minimise the
    largest stage's total cost (parameter count), every stage at least one layer.

    Exact, by dynamic programming over (layers, stages): ``O(n^2 p)`` for ``n``
    layers, fine for the hundreds of layers a model has. Among equal optima the
    earlier stages get fewer layers (the last stage also computes the loss).

    Raises:
        ValueError: more stages than layers, or fewer than one stage.
    """
    n = len(costs)
    if stages < 1:
        raise ValueError(f"expecting at least one pipeline stage, got {stages}")
    if stages > n:
        raise ValueError(f"pipeline_parallel_size {stages} is larger than the model's "
                         f"{n} top-level layers: every stage needs at least one layer")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + int(c))
    inf = float("inf")
    # best[k][i]: the smallest possible largest-stage cost of layers [0, i) in k stages.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds, i = [], n
    for k in range(stages, 0, -1):
        j = cut[k][i]
        bounds.append((j, i))
        i = j
    return bounds[::-1]


def check_boundaries(boundaries: Sequence[int], layers: int, stages: int) -> list[tuple[int, int]]:
    """User-given stage starts ``[0, b1, b2, ...]`` (or full ``[(start, stop), ...]``)
    checked against the model and turned into ranges.

    Raises:
        ValueError: not one range per stage, or ranges that are not contiguous,
            increasing and covering ``[0, layers)``.
    """
    if boundaries and isinstance(boundaries[0], (tuple, list)):
        ranges = [(int(a), int(b)) for a, b in boundaries]
    else:
        starts = [int(b) for b in boundaries]
        ranges = list(zip(starts, starts[1:] + [layers]))
    ok = (len(ranges) == stages and ranges and ranges[0][0] == 0 and ranges[-1][1] == layers
          and all(a < b for a, b in ranges)
          and all(r[1] == s[0] for r, s in zip(ranges, ranges[1:])))
    if not ok:
        raise ValueError(f"expecting {stages} contiguous stage ranges covering layers "
                         f"[0, {layers}), got {list(boundaries)}")
    return ranges
