"""Where worker slots come from, and the elastic agent's sizing rules. Pure.

A *slot* is room for one worker (one MPI rank). The agent asks a
[`SlotSource`][mpishard.launch.SlotSource] how many there are now; a source can be a file holding
one integer (``--slots-file``, rewritten by whoever manages capacity), an Open MPI
hostfile (``slots=`` summed), the Slurm allocation (``SLURM_NTASKS``), or a fixed
number. ``stamp()`` changes whenever the source may have changed, so the agent
re-reads it only then.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ..exitcodes import EXIT_STOPPED

__all__ = ["EXIT_RESIZE", "SlotSource", "next_size", "slots_from_hostfile"]

#: Exit status of workers that checkpointed and stopped for a planned resize: the
#: one `mpishard.exitcodes.EXIT_STOPPED`, under its older name (kept for
#: compatibility).
EXIT_RESIZE = EXIT_STOPPED


def slots_from_hostfile(text: str) -> int:
    """Total ``slots=`` of an Open MPI hostfile (a host without ``slots=`` counts 1)."""
    total = 0
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.search(r"\bslots\s*=\s*(\d+)", line)
        total += int(match.group(1)) if match else 1
    return total


@dataclass
class SlotSource:
    """How many workers could run now.

    Exactly one of ``slots_file``, ``hostfile`` or ``fixed`` is used; with none,
    the Slurm allocation's ``SLURM_NTASKS`` if set.
    """

    slots_file: str | None = None
    hostfile: str | None = None
    fixed: int | None = None

    def describe(self) -> str:
        if self.slots_file:
            return f"slots file {self.slots_file}"
        if self.hostfile:
            return f"hostfile {self.hostfile}"
        if self.fixed is not None:
            return f"{self.fixed} slots"
        return "the Slurm allocation (SLURM_NTASKS)"

    def available(self) -> int:
        """Slots now. Raises ValueError for an unreadable source."""
        if self.slots_file:
            with open(self.slots_file) as f:
                text = f.read().strip()
            if not text.isdigit():
                raise ValueError(f"{self.slots_file}: expecting one non-negative integer, "
                                 f"got {text[:40]!r}")
            return int(text)
        if self.hostfile:
            with open(self.hostfile) as f:
                return slots_from_hostfile(f.read())
        if self.fixed is not None:
            return self.fixed
        ntasks = os.environ.get("SLURM_NTASKS")
        if ntasks and ntasks.isdigit():
            return int(ntasks)
        raise ValueError("no slot source: give --workers, --slots-file or --hostfile, "
                         "or run inside a Slurm allocation")

    def modified_since(self, when: float) -> bool:
        """True when the slot file or hostfile was written at or after ``when``
        (seconds since the epoch); a fixed or Slurm source never changes."""
        path = self.slots_file or self.hostfile
        if path is None:
            return False
        try:
            return os.stat(path).st_mtime >= when
        except OSError:
            return False

    def stamp(self) -> tuple:
        """Changes when the source may have changed (file modification time)."""
        path = self.slots_file or self.hostfile
        if path is None:
            return ()
        try:
            st = os.stat(path)
        except OSError:
            return ("missing",)
        return (st.st_mtime_ns, st.st_size)


def next_size(event: str, current: int, available: int, min_workers: int,
              max_workers: int, lost: int = 1) -> int:
    """The worker count after ``event``; below ``min_workers`` means stop.

    * ``"start"``: as many as are available, up to the maximum.
    * ``"failure"``: ``lost`` workers died; their slots are taken as lost, so
      ``lost`` fewer than before (and no more than are available). Where the slot
      source was rewritten after the death, the agent asks for ``"slots"`` instead.
    * ``"slots"``: the slot source changed; as many as are available now, up to
      the maximum.
    """
    if event == "failure":
        if lost < 1:
            raise ValueError(f"expecting at least 1 lost worker, got {lost}")
        return min(current - lost, available)
    if event in ("start", "slots"):
        return min(available, max_workers)
    raise ValueError(f"unknown event {event!r}")
