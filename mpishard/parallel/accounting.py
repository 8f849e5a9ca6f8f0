"""``Accounting``: a core's time and memory, as its two parts report them.

Mixed into [`DataParallelCore`][mpishard.parallel.base.DataParallelCore]:
``timings`` (seconds by phase),
[`memory_report`][mpishard.parallel.accounting.Accounting.memory_report]
(bytes by kind, from the [gradient reduction][mpishard.parallel.reduction] and the
[parameter placement][mpishard.parallel.placement], with the peak since attach)
and [`note_peak`][mpishard.parallel.accounting.Accounting.note_peak], which the
parts call when they hold more for a while.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable
from typing import Any

from .memory import PhaseMemory

__all__ = ["Accounting"]


class Accounting:
    """Seconds by phase and bytes by kind of a core (its ``reduction``,
    ``placement`` and, in reproducible mode, its binned sums). Local."""

    def _start_accounting(self) -> None:
        #: Seconds spent so far, by phase (``reset_timings`` zeroes them).
        self.timings = {"forward_backward": 0.0, "communication": 0.0,
                        "optimizer": 0.0, "gather": 0.0}
        self._peak_bytes = 0
        #: The peaks of each phase (attach, step, save, ...: ``memory_report``).
        #: (Through a weak reference: a cycle would keep a dropped core's arrays
        #: until the garbage collector runs, in another core's step loop.)
        self.memory_phases = PhaseMemory(functools.partial(_held_bytes, weakref.ref(self)))

    def _attached(self, whole: bool) -> None:
        """At the end of attach: a placement that shards the parameters dropped the
        whole vector the model came with (not ``whole``), the peak counts from here."""
        current = self._current_bytes()
        self._peak_bytes = max(self._peak_bytes, current) if whole else current

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds for parameters, gradients, optimizer state and
        communication buffers, with the total now and the peak since attach
        (ZeRO-3 adds ``gathered`` and ``gathered_peak``), and the peaks of each
        phase so far ([`PhaseMemory.report`][mpishard.parallel.memory.PhaseMemory.report]).
        Local."""
        report = self._memory()
        if self._repro is not None:
            report["buffers"] += self._repro.nbytes()
        report["total"] = sum(report.values())
        self._peak_bytes = max(self._peak_bytes, report["total"])
        report["peak"] = self._peak_bytes
        report.update(self.placement.report())
        report.update(self.memory_phases.report())
        return report

    def memory_phase(self, name: str,
                     traced: bool = True) -> contextlib.AbstractContextManager[None]:
        """Count the ``with`` block's memory as phase ``name`` of ``memory_report``
        (``"save"``, ``"load"``, ``"recovery"``, ...); ``traced=False``: without
        ``tracemalloc``, which slows every allocation. Local."""
        return self.memory_phases.phase(name, traced)

    def note_peak(self, extra: int = 0) -> None:
        """Count what is held now, and ``extra`` bytes more held for a while, in the peak."""
        held = self._current_bytes() + extra
        self._peak_bytes = max(self._peak_bytes, held)
        self.memory_phases.note(held)

    def reset_timings(self) -> None:
        """Zero every entry of ``timings``."""
        for key in self.timings:
            self.timings[key] = 0.0

    def _current_bytes(self) -> int:
        return sum(self._memory().values())

    def _memory(self) -> dict[str, int]:
        placed, reduced = self.placement.memory(), self.reduction.memory()
        report = {"parameters": placed["parameters"]}
        if "gathered" in placed:
            report["gathered"] = placed["gathered"]
        report.update(gradients=reduced["gradients"], optimizer_state=placed["optimizer_state"],
                      buffers=placed["buffers"] + reduced["buffers"])
        return report


def _held_bytes(core: Callable[[], Any]) -> int:
    """The bytes ``core()`` holds now (0 before attach or once it is gone)."""
    found = core()
    return found._current_bytes() if found is not None and found.placement is not None else 0
