"""``StopRequest``: a signal (or a request) to checkpoint and stop at the next step."""

from __future__ import annotations

import signal
import threading
from typing import Any

from ..comm import FlatComm

__all__ = ["StopRequest"]


class StopRequest:
    """Turn ``signals`` (or [`request`][mpishard.train.signals.StopRequest.request]) into a stop at
    the next step boundary.

    A handler only records the signal's name; the training loop calls
    [`agree`][mpishard.train.signals.StopRequest.agree] after every step, so that any rank that got
    a signal stops every rank after the same step (it does not matter whether the launcher
    signals one rank or all). Use as a context manager: the handlers are
    installed on entry and the previous ones come back on exit. Handlers can
    only be installed from the main thread; elsewhere only
    [`request`][mpishard.train.signals.StopRequest.request] works. ``SIGUSR1`` is what the elastic
    agent sends for a planned resize and Slurm (``--signal``) before a time limit; ``SIGTERM`` comes
    with a preemption.
    """

    def __init__(self, signals: tuple[str, ...] = ("SIGUSR1", "SIGTERM")) -> None:
        self.signals = signals
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    def request(self, reason: str = "request") -> None:
        """Ask for a stop at the next step boundary, as a signal would."""
        if self.received is None:
            self.received = reason

    def _handler(self, signum: int, frame: Any) -> None:
        self.request(signal.Signals(signum).name)

    def agree(self, world: FlatComm, also: str | None = None) -> str | None:
        """The reason to stop now, the same on every rank, or None.

        ``also`` is a reason of this rank's own (the callback asked to stop).
        One Allreduce of one integer a step; when some rank wants to stop, one
        broadcast of the lowest such rank's reason
        ([`FlatComm.first_finding`][mpishard.comm.FlatComm.first_finding]).
        Collective over ``world``.
        """
        mine = self.received or also
        if world.size == 1:
            return mine
        with world.during("the training loop's stop agreement"):
            found = world.first_finding(mine)
        return None if found is None else found[2]

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for name in self.signals:
                num = getattr(signal, name)
                self._previous[num] = signal.signal(num, self._handler)
        return self

    def __exit__(self, *exc: Any) -> None:
        for num, previous in self._previous.items():
            signal.signal(num, previous)
        self._previous.clear()
