"""How a rank waits for an MPI request: MPI's own busy wait, or short naps.

MPI's blocking wait polls without pause. Where every rank has a core that is the
quickest wait; where the cores are shared (more ranks than cores, or other work
on the node) the waiting ranks take cores from the ranks the others are waiting
for. A napping wait tests the request and yields for ``SPIN_S``, then naps, from
``NAP_MIN_S`` doubling to ``NAP_MAX_S`` (a bound on the latency a nap adds).

``MPISHARD_WAIT`` (read once per process) chooses: ``spin`` (the default: MPI's
wait), ``nap``, or ``auto`` (nap where the launcher's count of this node's ranks,
``OMPI_COMM_WORLD_LOCAL_SIZE`` or ``MPI_LOCALNRANKS``, exceeds
``os.cpu_count()``). Napping is not the default: measured on 2 cores, 4 ranks of
small models, it was 0.71-0.78x the time of spinning with other work on the
machine (load 11-18) but 1.16x without (docs/install.md, "Waiting ranks"). The
waits under a timeout always test and nap (they must look at the clock).
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any

__all__ = ["NAP_MAX_S", "NAP_MIN_S", "SPIN_S", "WAIT_MODES", "naps", "next_nap", "wait"]

#: Seconds a wait yields before it naps; the first and the longest nap.
SPIN_S, NAP_MIN_S, NAP_MAX_S = 2e-3, 2e-5, 5e-4

#: What ``MPISHARD_WAIT`` accepts.
WAIT_MODES = ("auto", "spin", "nap")

# The launchers' counts of the ranks on this rank's node (Open MPI, MPICH/Hydra).
_LOCAL_SIZE = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")


@functools.cache
def naps() -> bool:
    """Whether this process's untimed waits nap (``MPISHARD_WAIT``; see the module). Local.

    Raises:
        ValueError: ``MPISHARD_WAIT`` is not one of
            [`WAIT_MODES`][mpishard.comm.waiting.WAIT_MODES].
    """
    mode = os.environ.get("MPISHARD_WAIT", "spin").strip().lower() or "spin"
    if mode not in WAIT_MODES:
        raise ValueError(f"MPISHARD_WAIT must be one of {', '.join(WAIT_MODES)}, "
                         f"not {mode!r}")
    if mode != "auto":
        return mode == "nap"
    for name in _LOCAL_SIZE:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value) > (os.cpu_count() or 1)
    return False


def next_nap(nap: float, waited: float) -> float:
    """The nap after ``nap`` once a wait has lasted ``waited`` seconds (0: a yield)."""
    return min(NAP_MAX_S, max(nap * 2, NAP_MIN_S)) if waited > SPIN_S else 0.0


def wait(request: Any) -> None:
    """Complete ``request`` without a deadline: MPI's ``Wait`` unless
    [`naps`][mpishard.comm.waiting.naps]; then test, yield and nap. Local."""
    if not naps():
        request.Wait()
        return
    start, nap = time.monotonic(), 0.0
    while not request.Test():
        nap = next_nap(nap, time.monotonic() - start)
        time.sleep(nap)
