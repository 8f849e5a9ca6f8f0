"""Deadlines by kind: how long a call of the library may wait, and for what. Pure.

A wait has one of three causes, and each gets its own deadline, because they
last for different reasons:

* ``peer``: waiting for the other ranks of a group to arrive in a collective
  (``ShardingConfiguration(timeout=...)``). A rank that does not come within it
  is stuck or took another path: the message names it.
* ``data``: waiting for the slowest rank's data. A
  [`BatchStream`][mpishard.data.BatchStream] step starts with a small exchange that
  completes only once every rank's iterator has yielded its batch, that is, once
  the simulation behind the slowest rank has produced it
  (``data_timeout=``). Skew between the ranks' producers is normal in a coupled
  code (one rank's own checkpoint, a diagnostics gather, load imbalance).
* ``io``: waiting for file I/O: a checkpoint's collective writes and reads, the
  other ranks waiting while rank 0 seals, ``fsync``-s and renames it, HDF5's
  collective ``File`` open and close (``io_timeout=``). A busy shared file
  system can take minutes.

Precedence ([`Deadlines.build`][mpishard.comm.deadlines.Deadlines.build]): a kind's own argument
when given (``None`` waits forever), else ``timeout``; so ``timeout=T`` alone bounds every wait by
``T``, as it did before the kinds existed.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

__all__ = ["KINDS", "SAME_AS_TIMEOUT", "Deadlines"]

#: The kinds of wait, each with its argument of ``ShardingConfiguration`` and
#: what a timeout message says the wait was for.
KINDS: dict[str, tuple[str, str]] = {
    "peer": ("timeout", "a wait for the other ranks of the group"),
    "data": ("data_timeout", "a wait for the slowest rank's data (its stream's next batch)"),
    "io": ("io_timeout", "a wait for file I/O (checkpoint or HDF5)"),
}

#: The default of ``data_timeout`` and ``io_timeout``: the value of ``timeout``.
SAME_AS_TIMEOUT = "timeout"


def _seconds(name: str, value: Any) -> float | None:
    if value is None:
        return None
    if (isinstance(value, bool) or not isinstance(value, numbers.Real)
            or not float(value) > 0):
        raise ValueError(f"{name} must be positive seconds or None, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Deadlines:
    """Seconds a wait of each kind may last (``None``: forever)."""

    peer: float | None = None
    data: float | None = None
    io: float | None = None

    @classmethod
    def build(cls, timeout: Any = None, data_timeout: Any = SAME_AS_TIMEOUT,
              io_timeout: Any = SAME_AS_TIMEOUT) -> Deadlines:
        """From ``ShardingConfiguration``'s arguments: a kind not given takes ``timeout``.

        Raises:
            ValueError: a value that is not positive seconds, None (or, for the
                kinds, ``"timeout"``).
        """
        if isinstance(timeout, Deadlines):
            return timeout
        peer = _seconds("timeout", timeout)
        data = peer if data_timeout == SAME_AS_TIMEOUT else _seconds("data_timeout",
                                                                        data_timeout)
        io = peer if io_timeout == SAME_AS_TIMEOUT else _seconds("io_timeout", io_timeout)
        return cls(peer, data, io)

    def of(self, kind: str) -> float | None:
        """The deadline of ``kind`` (``"peer"``, ``"data"`` or ``"io"``)."""
        if kind not in KINDS:
            raise ValueError(f"expecting a deadline kind among {sorted(KINDS)}, got {kind!r}")
        return getattr(self, kind)

    def explain(self, kind: str) -> str:
        """How a timeout message names the deadline: ``"data_timeout=30: a wait for ..."``."""
        argument, what = KINDS[kind]
        seconds = self.of(kind)
        return f"{argument}={'None' if seconds is None else format(seconds, 'g')}: {what}"
