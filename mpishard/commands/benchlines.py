"""``mpishard plan --validate``: the benchmarks' JSON lines against the cost model.

Reads the lines of ``benchmarks/bench_nodes.py`` (and the ``zero_step`` lines of
``benchmarks/bench_zero3.py --cluster``), calibrates [`mpishard.costmodel`][mpishard.costmodel]
from a few of them and predicts the rest. The cost model itself stays pure
arithmetic; what a benchmark line means is known here, next to the command.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..costmodel import Machine, gather_time, reduction_time
from ..strategies.registry import STRATEGIES

__all__ = ["validate"]

Record = dict[str, Any]


def _shape(layout: str) -> tuple[int, int]:
    """``"2x4"`` (or ``"2x4rr"``, placed round robin) -> (nodes, ranks per node)."""
    nodes, per = (int(v) for v in layout.removesuffix("rr").split("x"))
    return nodes, per


def _flat_allreduce(by_layout: dict[str, list[Record]],
                    match: Callable[[int, int], bool]) -> Record | None:
    """The smallest flat allreduce line of the layouts whose shape ``match``-es."""
    runs = [r for name, rs in by_layout.items() if match(*_shape(name)) for r in rs
            if r["kind"] == "reduction" and r["op"] == "allreduce" and r["way"] == "flat"]
    return min(runs, key=lambda r: r["mib"]) if runs else None


def _calibrate(by_layout: dict[str, list[Record]]) -> tuple[dict[str, Any], list[Record]]:
    """The calibration, and the lines it used (not predicted)."""
    inside = _flat_allreduce(by_layout, lambda nodes, per: nodes == 1 and per > 1)
    if inside is None:
        raise ValueError("expecting the flat allreduce lines of a one-node layout (1xL) "
                         "to calibrate from")
    across = _flat_allreduce(by_layout, lambda nodes, per: nodes > 1 and per == 1)
    if across is None:
        raise ValueError("expecting the flat allreduce lines of a one-rank-per-node layout "
                         "(Nx1) to calibrate from")

    def link(where: str, key: str, default: float) -> float:
        values = sorted(r[key] for rs in by_layout.values() for r in rs
                        if r["kind"] == "link" and r["where"] == where and key in r)
        return values[len(values) // 2] if values else default

    # Reduce-scatter and allgather against allreduce: the one-node flat ones of that size.
    same = [r for r in by_layout[inside["layout"]] if r["kind"] == "reduction"
            and r["mib"] == inside["mib"]]
    rs = [r for r in same if r["op"] == "reduce_scatter" and r["way"] == "flat"]
    ag = [r for r in same if r["op"] == "allgather"]
    calib = {"reduce_scatter_cost": rs[0]["seconds"] / inside["seconds"] if rs else 0.5,
             "allgather_cost": ag[0]["seconds"] / inside["seconds"] if ag else 0.5,
             "bandwidth_inside": inside["busbw_gbs"] * 1e9,
             "bandwidth_across": across["busbw_gbs"] * 1e9,
             "latency_inside": link("inside", "latency_us", 5.0) * 1e-6,
             "latency_across": link("across", "latency_us", 10.0) * 1e-6,
             "from": [f"{inside['layout']} allreduce {inside['mib']:g} MiB flat",
                      f"{across['layout']} allreduce {across['mib']:g} MiB flat"]}
    return calib, [inside, across, *rs[:1], *ag[:1]]


def _step_comm(r: Record, ranks: int, per: int, machine: Machine,
               placement: str) -> tuple[float, tuple[Any, ...], str]:
    """A step line's modelled communication, the key of its one-node twin, its label."""
    n = r["gradient_mib"] * (1 << 20)
    if r["kind"] == "ddp_step":
        comm = reduction_time(n, ranks, per, machine, r["way"], placement)
        return comm, ("ddp", r["way"], ranks), f"DDP step {r['way']}"
    # ZeRO-2 and ZeRO-3: reduce-scatter and allgather(s), flat.
    cost = STRATEGIES[r["strategy"]].cost
    comm = (reduction_time(n, ranks, per, machine, "flat", placement,
                           half=cost.reduce_scatter)
            + cost.gathers * gather_time(n, ranks, per, machine, placement))
    key = (r["strategy"], r.get("prefetch", True), ranks)
    return comm, key, f"{r['strategy']} step" + ("" if key[1] else " no prefetch")


def _layout_rows(name: str, records: list[Record], calib: dict[str, Any], used: list[Record],
                 compute: dict[tuple[Any, ...], float]) -> list[Record]:
    """The predictions of one layout's lines; its one-node steps' compute into ``compute``."""
    nodes, per = _shape(name)
    machine = Machine(ranks_per_node=per, latency_inside=calib["latency_inside"],
                      bandwidth_inside=calib["bandwidth_inside"],
                      latency_across=calib["latency_across"],
                      bandwidth_across=calib["bandwidth_across"],
                      reduce_scatter_cost=calib["reduce_scatter_cost"],
                      allgather_cost=calib["allgather_cost"])
    placement = "round-robin" if name.endswith("rr") else "slot"
    out = []
    for r in records:
        if any(r is u for u in used):
            continue
        if r["kind"] == "reduction" and r["op"] == "allgather":
            predicted = gather_time(r["mib"] * (1 << 20), nodes * per, per, machine, placement)
            out.append({"layout": name, "what": f"allgather {r['mib']:g} MiB flat",
                        "measured_s": r["seconds"], "predicted_s": predicted})
        elif r["kind"] == "reduction":
            predicted = reduction_time(r["mib"] * (1 << 20), nodes * per, per, machine,
                                       r["way"], placement, half=r["op"] == "reduce_scatter")
            out.append({"layout": name, "what": f"{r['op']} {r['mib']:g} MiB {r['way']}",
                        "measured_s": r["seconds"], "predicted_s": predicted})
        elif r["kind"] in ("ddp_step", "zero_step") and not r.get("overlap"):
            comm, key, what = _step_comm(r, nodes * per, per, machine, placement)
            if nodes == 1:
                compute[key] = r["seconds_per_step"] - comm
            else:
                out.append({"layout": name, "what": what, "measured_s": r["seconds_per_step"],
                            "comm_s": comm, "predicted_s": None, "key": key})
    return out


def validate(records: list[Record]) -> tuple[dict[str, Any], list[Record]]:
    """Predicted against measured for the benchmarks' lines ``records``.

    Calibration, then prediction of the rest. A ping-pong between two ranks
    overstates what a collective gets where ranks share cores and the reduction
    itself costs (here: 4 ranks on 2 cores, and the TCP stack of every "node" on
    them too; predicting from the ping-pong bandwidths measured a median error
    of 36-43 %), so the bandwidths are the bus bandwidths of two measured flat
    allreduces of the smallest size: inside from the one-node run (``1xL``),
    across from the one-rank-per-node run (``Nx1``); latencies are the
    (median) ping-pong ones. Everything else is predicted: the other sizes,
    reduce-scatter, the hierarchical reductions, the layouts with several nodes
    of several ranks, and the DDP, ZeRO-2 and ZeRO-3 steps (the one-node step's
    compute, its measured time less the model's communication there, plus the
    model's communication of the layout). Returns the calibration and one row
    per prediction (``measured_s``, ``predicted_s``, ``error`` = predicted/measured - 1).

    Raises:
        ValueError: no line to calibrate from.
    """
    by_layout: dict[str, list[Record]] = {}
    for r in records:
        by_layout.setdefault(r["layout"], []).append(r)
    calib, used = _calibrate(by_layout)
    compute: dict[tuple[Any, ...], float] = {}
    out = [row for name, rs in by_layout.items()
           for row in _layout_rows(name, rs, calib, used, compute)]
    for row in out:
        if row["predicted_s"] is None:
            base = compute.get(row["key"])
            row["predicted_s"] = None if base is None else base + row["comm_s"]
    out = [row for row in out if row["predicted_s"] is not None]
    for row in out:
        row.pop("key", None), row.pop("comm_s", None)
        row["error"] = row["predicted_s"] / row["measured_s"] - 1
    return calib, out
