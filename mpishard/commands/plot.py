"""``mpishard plot METRICS.jsonl... -o loss.png``: the loss curves of training runs as a PNG.

Reads the JSON lines that ``mpishard train`` writes (``step`` records: the mean
training loss every ``--log-every`` steps; ``epoch`` records: the validation
loss) and draws one panel per file, loss against optimizer step, on a log
scale. A run resumed from a checkpoint appends to its file; steps written
twice (between the last checkpoint and the stop) keep the later value. One
process, no MPI; matplotlib draws with its Agg backend (no display needed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Curves", "add_plot_parser", "main", "plot_metrics", "read_metrics"]


class _PlotError(Exception):
    pass


@dataclass
class Curves:
    """What a metrics file holds, by step (later records of a step win)."""

    name: str
    train: dict[int, float] = field(default_factory=dict)
    validation: dict[int, float] = field(default_factory=dict)
    epochs: dict[int, float] = field(default_factory=dict)   # epoch mean training loss

    def series(self, which: dict[int, float]) -> tuple[list[int], list[float]]:
        steps = sorted(which)
        return steps, [which[s] for s in steps]


def read_metrics(path: str) -> Curves:
    """The curves in the metrics file ``path``.

    Raises:
        FileNotFoundError: no file.
        ValueError: a line that is not a JSON object (with its number), or no losses at all.
    """
    name = os.path.basename(os.path.dirname(os.path.abspath(path))) or path
    curves = Curves(name)
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}, line {number}: not JSON ({exc.msg})") from None
            if not isinstance(rec, dict):
                raise ValueError(f"{path}, line {number}: expecting a JSON object")
            event = rec.get("event")
            if event == "start":
                curves.name = str(rec.get("run") or curves.name)
                if _number(rec.get("start_val_loss")):   # the validation loss before step 1
                    curves.validation[int(rec.get("first_step", 0))] = float(rec["start_val_loss"])
            elif event == "step" and _number(rec.get("loss")):
                curves.train[int(rec["step"])] = float(rec["loss"])
            elif event == "epoch":
                if _number(rec.get("val_loss")):
                    curves.validation[int(rec["step"])] = float(rec["val_loss"])
                if _number(rec.get("loss")):
                    curves.epochs[int(rec["step"])] = float(rec["loss"])
    if not (curves.train or curves.validation or curves.epochs):
        raise ValueError(f"{path}: no losses in it (is it a metrics file of mpishard train?)")
    return curves


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v


def plot_metrics(paths: Sequence[str], output: str, *, log_scale: bool = True,
                 title: str | None = None) -> str:
    """Draw the curves of ``paths`` (one panel each) into the PNG ``output``; its path."""
    from matplotlib.figure import Figure  # the OO API: no pyplot, no display, Agg for PNG

    all_curves = [read_metrics(p) for p in paths]
    fig = Figure(figsize=(7.0, 3.2 * len(all_curves)), layout="constrained")
    axes = fig.subplots(len(all_curves), 1, squeeze=False)[:, 0]
    for ax, curves in zip(axes, all_curves):
        if curves.train:
            ax.plot(*curves.series(curves.train), lw=1.2, label="training loss")
        elif curves.epochs:
            ax.plot(*curves.series(curves.epochs), lw=1.2, marker=".",
                    label="training loss (epoch mean)")
        if curves.validation:
            ax.plot(*curves.series(curves.validation), "o-", ms=3, lw=1.0,
                    label="validation loss")
        if log_scale:
            ax.set_yscale("log")
        ax.set_title(curves.name)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("loss")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    folder = os.path.dirname(os.path.abspath(output))
    os.makedirs(folder, exist_ok=True)
    fig.savefig(output, dpi=110, format="png")
    return output


#: The help's description: the docstring's first paragraph, as plain text.
_DESCRIPTION = ("mpishard plot METRICS.jsonl... -o loss.png: the loss curves of training runs "
                "as a PNG.")


def add_plot_parser(sub: Any) -> None:
    """Add ``plot`` to the subcommands ``sub`` of ``mpishard``."""
    parser = sub.add_parser("plot", help="draw loss curves from metrics files as a PNG",
                            description=_DESCRIPTION)
    _arguments(parser)
    parser.set_defaults(func=_run)


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("metrics", nargs="+", metavar="METRICS.jsonl",
                        help="metrics files of mpishard train (one panel each)")
    parser.add_argument("-o", "--output", default=None,
                        help="the PNG to write (default: loss.png beside the first file)")
    parser.add_argument("--linear", action="store_true", help="a linear loss axis")
    parser.add_argument("--title", default=None)


def _run(args: argparse.Namespace) -> int:
    output = args.output or os.path.join(os.path.dirname(args.metrics[0]), "loss.png")
    try:
        path = plot_metrics(args.metrics, output, log_scale=not args.linear, title=args.title)
    except (OSError, ValueError) as exc:
        text = f"{exc.filename}: {exc.strerror}" if isinstance(exc, OSError) and exc.filename \
            else str(exc)
        print(f"mpishard plot: error: {text}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``mpishard plot`` on its own (``python -m mpishard.commands.plot``)."""
    parser = argparse.ArgumentParser(prog="mpishard plot", description=_DESCRIPTION)
    _arguments(parser)
    return _run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
