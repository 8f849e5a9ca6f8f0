"""Micro-batch schedules of a pipeline: what each stage does, in order. Pure.

A schedule is, per stage, a list of actions ``("F", m)`` (forward of
micro-batch ``m``) and ``("B", m)`` (its backward). Stage ``s`` of ``p`` receives
activations from ``s - 1`` before each forward (unless first) and sends them to
``s + 1`` after (unless last); backward goes the other way.

* **GPipe**: all forwards, then all backwards. Every stage holds the
  activations of all ``m`` micro-batches at once.
* **1F1B** (PipeDream-flush): stage ``s`` runs ``p - s - 1`` warm-up forwards,
  then alternates one forward and one backward, then drains the backwards. The
  bubble is the same as GPipe's, but stage ``s`` holds at most ``p - s``
  micro-batches' activations instead of ``m``.

Both have the bubble fraction ``(p - 1) / (m + p - 1)`` of the ideal step time
when forward and backward take the same time on every stage.
"""

from __future__ import annotations

from typing import Literal

__all__ = ["SCHEDULES", "Action", "bubble_fraction", "peak_in_flight", "schedule"]

Action = tuple[Literal["F", "B"], int]
SCHEDULES = ("gpipe", "1f1b")


def schedule(name: str, stages: int, micro_batches: int, stage: int) -> list[Action]:
    """The actions of ``stage`` (0-based) in a ``stages``-deep pipeline.

    Raises:
        ValueError: an unknown schedule name or sizes out of range.
    """
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}: "
                         f"choose one of {', '.join(SCHEDULES)}")
    if stages < 1 or micro_batches < 1 or not 0 <= stage < stages:
        raise ValueError(f"expecting stages >= 1, micro_batches >= 1 and 0 <= stage < stages, "
                         f"got stages={stages}, micro_batches={micro_batches}, stage={stage}")
    m = micro_batches
    if name == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warmup = min(stages - stage - 1, m)
    actions: list[Action] = [("F", i) for i in range(warmup)]
    forward, backward = warmup, 0
    while forward < m:
        actions.append(("F", forward))
        forward += 1
        actions.append(("B", backward))
        backward += 1
    actions.extend(("B", i) for i in range(backward, m))
    return actions


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """Idle fraction of a GPipe or 1F1B step: ``(p - 1) / (m + p - 1)``."""
    return (stages - 1) / (micro_batches + stages - 1)


def peak_in_flight(actions: list[Action]) -> int:
    """Most micro-batches whose activations a stage holds at once."""
    held = peak = 0
    for kind, _ in actions:
        held += 1 if kind == "F" else -1
        peak = max(peak, held)
    return peak
