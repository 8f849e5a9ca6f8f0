"""The training loop's option groups: how the data is visited, what a run shows and
records, and what it saves. Plain dataclasses; the rules are on the docs site's
training-loop page."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, TextIO

from ..checkpoint import CheckpointManager

__all__ = ["FLAT_OPTIONS", "Checkpointing", "Reporting", "Sampling", "option_groups"]


@dataclass
class Sampling:
    """How a dataset's samples are visited.

    Attributes:
        shuffle: shuffle each epoch (None: the data position's, else True).
        seed: the shuffle seed (None: the data position's, else 0).
        drop_last: drop an epoch's last batch shorter than ``batch_size``.
        batch_size_may_change: no warning when the batch size differs from the
            position's (``ElasticOptimizer`` under ``scale-lr``).
    """

    shuffle: bool | None = None
    seed: int | None = None
    drop_last: bool = True
    batch_size_may_change: bool = False


@dataclass
class Reporting:
    """What a run shows (rank 0 only) and records.

    Attributes:
        progress: a tqdm bar on rank 0.
        print_every: an epoch line every that many epochs (and the first and
            last); 0: none.
        out: where lines and the bar go (default ``sys.stdout``).
        label: the run's name in lines and hand-overs.
        log_every: steps per ``step`` record of the metrics file.
        metrics_path: the metrics file (JSON lines; the record format is on the
            docs site's training-loop page).
        append_metrics: True appends, False starts the file anew; None (the
            default) appends when the call continues a data position and starts
            it anew otherwise.
        start_record: written as the ``start`` record, when given.
        validation: ``(x, y)`` evaluated at each epoch's end and at the end.
    """

    progress: bool = False
    print_every: int = 0
    out: TextIO | None = None
    label: str = "train"
    log_every: int = 10
    metrics_path: str | None = None
    append_metrics: bool | None = None
    start_record: dict[str, Any] | None = None
    validation: tuple[Any, Any] | None = None


@dataclass
class Checkpointing:
    """What a run saves, and when it hands over to a relaunch.

    Attributes:
        manager: where checkpoints go (None: none are written).
        every: steps between checkpoints (0: only at a stop and at the end).
        min_workers: with fault tolerance on, fewer survivors than this after a
            lost rank write a checkpoint and end the process with 75.
    """

    manager: CheckpointManager | None = None
    every: int = 0
    min_workers: int = 1


#: ``optimize()``'s flat keywords and the group field each one sets.
FLAT_OPTIONS: dict[str, tuple[type, str]] = {
    **{name: (Sampling, name) for name in ("shuffle", "seed", "drop_last",
                                            "batch_size_may_change")},
    **{name: (Reporting, name) for name in ("progress", "print_every", "out", "label",
                                             "log_every", "metrics_path", "append_metrics",
                                             "start_record", "validation")},
    "checkpoints": (Checkpointing, "manager"),
    "checkpoint_every": (Checkpointing, "every"),
    "min_workers": (Checkpointing, "min_workers"),
}


def option_groups(sampling: Sampling | None, reporting: Reporting | None,
                  checkpointing: Checkpointing | None, flat: dict[str, Any],
                  core: Any = None) -> tuple[Sampling, Reporting, Checkpointing]:
    """The three groups, with the flat keywords ``flat`` set into them (a flat
    keyword and its group given together: the flat one wins).

    ``core`` names the strategy in the error for ``buddy_copies``, an option of
    ZeRO-2's and ZeRO-3's constructors (``optimize()`` took it up to 0.5).

    Raises:
        TypeError: an unknown keyword, or ``buddy_copies`` (saying where it goes).
    """
    groups = {Sampling: replace(sampling) if sampling is not None else Sampling(),
              Reporting: replace(reporting) if reporting is not None else Reporting(),
              Checkpointing: (replace(checkpointing) if checkpointing is not None
                              else Checkpointing())}
    for name, value in flat.items():
        if name == "buddy_copies":
            raise TypeError(_buddy_copies_error(core))
        if name not in FLAT_OPTIONS:
            raise TypeError(f"unknown training option {name!r}; expecting one of "
                            f"{sorted(FLAT_OPTIONS)}, max_steps, stop or callback")
        group, field_name = FLAT_OPTIONS[name]
        setattr(groups[group], field_name, value)
    return groups[Sampling], groups[Reporting], groups[Checkpointing]


def _buddy_copies_error(core: Any) -> str:
    """Where ``buddy_copies`` goes since 0.6, for the strategy ``core`` runs."""
    public = getattr(core, "public", None)
    if hasattr(getattr(core, "options", None), "buddy_copies"):
        where = f"pass it to the constructor: {public}(..., buddy_copies=...)"
    else:
        where = ("it is an option of ZeRO2Optimizer(..., buddy_copies=...) and "
                 "ZeRO3Optimizer(..., buddy_copies=...)"
                 + (f"; this {public} ({core.strategy}) keeps none"
                    if public and hasattr(core, "strategy") else ""))
    return f"optimize() takes no buddy_copies since 0.6: {where}"
