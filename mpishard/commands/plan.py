"""``mpishard plan``: the predictions of [`mpishard.costmodel`][mpishard.costmodel].

    mpishard plan --table                     # 64 .. 4096 ranks of a 7B GPT
    mpishard plan --tp 8 --pp 4 --dp 16       # one layout
    mpishard plan --validate bench.jsonl      # against benchmarks/bench_nodes.py, bench_zero3.py
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import Any

from ..costmodel import GPT7B, Layout, Machine, ModelSpec, predict, table
from ..strategies.registry import STRATEGIES
from .benchlines import validate

__all__ = ["add_plan_parser", "main"]


# --------------------------------------------------------------------------- command

def add_plan_parser(sub: Any) -> None:
    """Add ``plan`` to the subcommands ``sub`` of ``mpishard``."""
    parser = sub.add_parser("plan", help="predict step time, communication and memory of "
                                         "layouts (a cost model; no MPI)",
                            description="mpishard plan: print the cost model's predictions "
                                        "(mpishard.costmodel).")
    parser.add_argument("--table", action="store_true",
                        help="the fastest fitting layout for 64 .. 4096 ranks")
    parser.add_argument("--worlds", default="64,128,256,512,1024,2048,4096")
    parser.add_argument("--validate", metavar="BENCH.jsonl",
                        help="compare with the measurements of benchmarks/bench_nodes.py")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--strategy", choices=list(STRATEGIES), default="zero2",
                        help="; ".join(f"{e.name}: {e.summary}" for e in STRATEGIES.values()))
    parser.add_argument("--reduction", choices=("flat", "hierarchical"), default="hierarchical")
    parser.add_argument("--micro-batches", type=int, default=0)
    parser.add_argument("--global-batch", type=int, default=1024, help="sequences per step")
    m = Machine()
    parser.add_argument("--ranks-per-node", type=int, default=m.ranks_per_node)
    parser.add_argument("--latency-inside-us", type=float, default=m.latency_inside * 1e6)
    parser.add_argument("--bandwidth-inside-gbs", type=float, default=m.bandwidth_inside / 1e9)
    parser.add_argument("--latency-across-us", type=float, default=m.latency_across * 1e6)
    parser.add_argument("--bandwidth-across-gbs", type=float, default=m.bandwidth_across / 1e9)
    parser.add_argument("--tflops", type=float, default=m.flops / 1e12, help="per rank")
    parser.add_argument("--memory-gb", type=float, default=m.memory / 1e9, help="per rank")
    parser.add_argument("--reduce-scatter-cost", type=float, default=m.reduce_scatter_cost,
                        help="reduce-scatter time / allreduce time (0.5: bandwidth-optimal)")
    parser.add_argument("--allgather-cost", type=float, default=m.allgather_cost,
                        help="allgather time / allreduce time (0.5: bandwidth-optimal)")
    parser.add_argument("--parameters", type=float, default=GPT7B.parameters)
    parser.add_argument("--layers", type=int, default=GPT7B.layers)
    parser.add_argument("--hidden", type=int, default=GPT7B.hidden)
    parser.add_argument("--heads", type=int, default=GPT7B.heads)
    parser.add_argument("--seq", type=int, default=GPT7B.seq)
    parser.add_argument("--dtype-bytes", type=int, default=GPT7B.dtype_bytes)
    parser.add_argument("--json", action="store_true", help="JSON lines instead of a table")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if args.validate:
        with open(args.validate) as f:
            records = [json.loads(line) for line in f if line.startswith("{")]
        try:
            calib, rows = validate(records)
        except ValueError as exc:
            print(f"mpishard plan: error: {exc}", file=sys.stderr)
            return 2
        if args.json:
            print(json.dumps({"calibration": calib}))
            for row in rows:
                print(json.dumps(row))
            return 0
        print(f"calibrated: {calib['bandwidth_inside'] / 1e9:.3g} GB/s inside (from "
              f"{calib['from'][0]}), {calib['bandwidth_across'] / 1e9:.3g} GB/s across (from "
              f"{calib['from'][1]}); latency {calib['latency_inside'] * 1e6:.0f} us inside, "
              f"{calib['latency_across'] * 1e6:.0f} us across (ping-pong); reduce-scatter "
              f"{calib['reduce_scatter_cost']:.2f} x allreduce, allgather "
              f"{calib['allgather_cost']:.2f} x (from the same one-node run)")
        print(f"{'layout':<7} {'what':<34} {'measured':>10} {'predicted':>10} {'error':>7}")
        for r in rows:
            print(f"{r['layout']:<7} {r['what']:<34} {r['measured_s'] * 1e3:>8.2f}ms "
                  f"{r['predicted_s'] * 1e3:>8.2f}ms {r['error']:>+7.0%}")
        if rows:
            errs = sorted(abs(r["error"]) for r in rows)
            print(f"|error|: median {errs[len(errs) // 2]:.0%}, max {errs[-1]:.0%}, "
                  f"{sum(e <= 0.25 for e in errs)} of {len(errs)} within 25%")
        return 0
    machine = Machine(args.ranks_per_node, args.latency_inside_us * 1e-6,
                      args.bandwidth_inside_gbs * 1e9, args.latency_across_us * 1e-6,
                      args.bandwidth_across_gbs * 1e9, args.tflops * 1e12, args.memory_gb * 1e9,
                      args.reduce_scatter_cost, args.allgather_cost)
    model = ModelSpec(args.parameters, args.layers, args.hidden, args.heads, args.seq,
                      args.dtype_bytes)
    if args.table:
        worlds = [int(w) for w in args.worlds.split(",")]
        rows = table(model, machine, args.global_batch, worlds,
                     [e.cost for e in STRATEGIES.values()])
        if args.json:
            for row in rows:
                print(json.dumps(row))
            return 0
        print(f"{model.parameters / 1e9:g}B parameters, {model.layers} layers, global batch "
              f"{args.global_batch} x {model.seq} tokens, {machine.ranks_per_node} ranks/node, "
              f"{args.bandwidth_inside_gbs:g}/{args.bandwidth_across_gbs:g} GB/s inside/across, "
              f"{args.tflops:g} TFLOP/s and {args.memory_gb:g} GB per rank")
        print(f"{'ranks':>6} {'fit':>7}  {'fastest that fits':<26} {'step':>8} {'comm':>7} "
              f"{'bubble':>6} {'memory':>8} {'tokens/s':>10}")
        for row in rows:
            best = row["best"]
            if best is None:
                print(f"{row['world']:>6} {0:>3}/{row['layouts']:<3}  none fits (smallest "
                      f"{row['smallest_memory_gb']:.0f} GB)")
                continue
            name = f"tp{best['tp']} pp{best['pp']} dp{best['dp']} {best['strategy']}"
            print(f"{row['world']:>6} {row['fit']:>3}/{row['layouts']:<3}  {name:<26} "
                  f"{best['step_s']:>7.2f}s {best['comm_s'] / best['step_s']:>7.0%} "
                  f"{best['bubble']:>6.0%} {best['memory_gb']:>6.1f}GB "
                  f"{best['tokens_per_s']:>10.3g}")
        return 0
    layout = Layout(args.tp, args.pp, args.dp, STRATEGIES[args.strategy].cost, args.reduction,
                    global_batch=args.global_batch, micro_batches=args.micro_batches)
    result = predict(model, layout, machine)
    if args.json:
        print(json.dumps({**result, "machine": asdict(machine), "model": asdict(model)}))
        return 0
    for key, value in result.items():
        print(f"{key:<13} {value:.4g}" if isinstance(value, float) else f"{key:<13} {value}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mpishard")
    add_plan_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args) or 0)

