"""Memory by phase: the peak of a core's own arrays and of the process in each phase.

[`PhaseMemory`][mpishard.parallel.memory.PhaseMemory] gives a core's
``memory_report()`` the peak of every phase it went through (``PHASES``):
the bytes of the arrays the core accounts for (parameters, gathered
parameters, gradients, optimizer state, buffers: the same sum as ``total``,
with what a phase holds for a while, such as a checkpoint's whole optimizer
state), the bytes the phase allocated at its peak as Python's ``tracemalloc``
sees them (NumPy's arrays and every Python object, whoever made them; not
during the steps, where tracing would slow every allocation, nor during a
checkpoint save, whose HDF5 layout it made three times as slow: there the
growth of the resident memory over the phase, where the kernel's peak can be
reset), and the peak
resident memory of the process in it (Linux: ``VmHWM`` of ``/proc/self/status``,
reset at each phase's start through ``/proc/self/clear_refs``; elsewhere the
process' peak so far, ``resource.getrusage``).

Resetting the kernel's peak also resets ``getrusage``'s: the process' peak over
its whole life is [`process_peak_rss`][mpishard.parallel.memory.process_peak_rss].
The rules and the keys are on the docs site's strategies page ("Memory").
"""

from __future__ import annotations

import contextlib
import resource
import sys
import tracemalloc
from collections.abc import Callable, Iterator

__all__ = ["PHASES", "PHASE_KEYS", "PhaseMemory", "UNTRACED", "current_rss",
           "process_peak_rss", "reset_peak_rss"]

#: The phases a core reports, in the order a run usually meets them.
PHASES = ("construction", "attach", "step", "save", "load", "recovery")
#: Phases never traced: the steps (no ``allocated_step``) and a checkpoint
#: save (``allocated_save`` is the growth of the resident memory).
UNTRACED = ("step", "save")
#: How the keys of a phase's peaks in ``memory_report()`` begin.
PHASE_KEYS = ("peak_", "allocated_", "rss_peak_")

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"
#: The process' peak before the last reset of the kernel's (bytes).
_peak_before_reset = 0


def _status_kib(field: str) -> int | None:
    try:
        with open(_STATUS) as status:
            for line in status:
                if line.startswith(field):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _rusage_peak() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def _kernel_peak() -> int:
    """The kernel's peak resident bytes since its last reset."""
    kib = _status_kib("VmHWM:")
    return kib * 1024 if kib is not None else _rusage_peak()


def current_rss() -> int:
    """The process' resident bytes now (0 where the system does not say)."""
    kib = _status_kib("VmRSS:")
    return kib * 1024 if kib is not None else 0


def process_peak_rss() -> int:
    """The process' peak resident bytes over its whole life, phase resets included."""
    return max(_peak_before_reset, _kernel_peak(), _rusage_peak())


def reset_peak_rss() -> bool:
    """Start the kernel's peak afresh (the process' peak is kept here); False where
    the system cannot (then a phase's peak is the process' peak so far)."""
    global _peak_before_reset
    peak = process_peak_rss()
    try:
        with open(_CLEAR_REFS, "w") as clear:
            clear.write("5")
    except OSError:
        return False
    _peak_before_reset = peak
    return True


class PhaseMemory:
    """The peaks of each phase of one core's life. Local.

    Args:
        current: the core's accounted bytes now (its ``memory_report`` total).
    """

    def __init__(self, current: Callable[[], int]) -> None:
        self.current = current
        #: ``phase -> {"bytes", "allocated", "rss"}`` of the phases that ended.
        self.peaks: dict[str, dict[str, int]] = {}
        self._open: str | None = None
        self._bytes = 0
        self._traced_base: int | None = None
        self._rss_base: int | None = None
        self._started_tracing = False

    @property
    def phase_now(self) -> str | None:
        """The phase open now (None: none)."""
        return self._open

    def begin(self, name: str, traced: bool = True) -> None:
        """Open phase ``name`` (ending another); nothing when it is open already.
        ``traced=False`` (always for `UNTRACED`): no ``tracemalloc``; then
        ``allocated_<name>`` is the growth of the resident memory (none for
        ``"step"``, nor where the kernel's peak cannot be reset)."""
        if self._open == name:
            return
        self.end()
        if name not in PHASES:
            raise ValueError(f"expecting a phase of {PHASES}, got {name!r}")
        self._open, self._bytes = name, self.current()
        reset = reset_peak_rss()
        self._traced_base = self._rss_base = None
        traced = traced and name not in UNTRACED   # tracing slows every allocation
        if not traced and name != "step" and reset:
            self._rss_base = current_rss()
        if traced:
            self._started_tracing = not tracemalloc.is_tracing()
            if self._started_tracing:
                tracemalloc.start()
            tracemalloc.reset_peak()
            self._traced_base = tracemalloc.get_traced_memory()[0]

    def end(self) -> None:
        """Close the open phase, keeping its peaks (the most of every time it ran)."""
        if self._open is None:
            return
        now = self._now()
        if self._traced_base is not None and self._started_tracing:
            tracemalloc.stop()
        self._traced_base, self._rss_base, self._started_tracing = None, None, False
        kept = self.peaks.setdefault(self._open, {})
        for key, value in now.items():
            kept[key] = max(kept.get(key, 0), value)
        self._open = None

    def enter(self, name: str, traced: bool = True) -> bool:
        """Open ``name`` unless another phase than ``"step"`` is open (the work
        counts in that one); whether it opened (for ``leave``)."""
        if self._open is not None and self._open != "step":
            return False
        self.begin(name, traced)
        return True

    def leave(self, opened: bool) -> None:
        """Close the phase ``enter`` opened (``opened``)."""
        if opened:
            self.end()

    @contextlib.contextmanager
    def phase(self, name: str, traced: bool = True) -> Iterator[None]:
        """``name`` for the ``with`` block; inside another phase (not ``"step"``)
        the block counts in that one (an attach inside a load is the load's).
        ``traced=False``: no ``tracemalloc`` (see `begin`)."""
        opened = self.enter(name, traced)
        try:
            yield
        finally:
            self.leave(opened)

    def note(self, nbytes: int) -> None:
        """The core holds ``nbytes`` now (counted in the open phase's peak)."""
        self._bytes = max(self._bytes, nbytes)

    def _now(self) -> dict[str, int]:
        self._bytes = max(self._bytes, self.current())
        found = {"bytes": self._bytes, "rss": _kernel_peak()}
        if self._traced_base is not None:
            found["allocated"] = max(0, tracemalloc.get_traced_memory()[1] - self._traced_base)
        elif self._rss_base is not None:
            found["allocated"] = max(0, found["rss"] - self._rss_base)
        return found

    def report(self) -> dict[str, int]:
        """``peak_<phase>``, ``allocated_<phase>`` and ``rss_peak_<phase>`` bytes of
        every phase so far (the open one up to now), in ``PHASES`` order."""
        peaks = {name: dict(found) for name, found in self.peaks.items()}
        if self._open is not None:
            kept = peaks.setdefault(self._open, {})
            for key, value in self._now().items():
                kept[key] = max(kept.get(key, 0), value)
        report: dict[str, int] = {}
        for name in PHASES:
            found = peaks.get(name)
            if found is None:
                continue
            report[f"peak_{name}"] = found["bytes"]
            if "allocated" in found:
                report[f"allocated_{name}"] = found["allocated"]
            report[f"rss_peak_{name}"] = found["rss"]
        return report
