"""The pieces of what a run shows: the metrics file, a tqdm bar, clocks, memory.

[`Reporter`][mpishard.train.reporting.Reporter] uses them; the metrics records are
listed on the docs site's training-loop page. Nothing here communicates.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from typing import Any, TextIO

from ..parallel.memory import process_peak_rss

__all__ = ["Metrics", "clock", "interactive_output", "peak_rss_bytes", "progress_bar"]


class Metrics:
    """JSON lines appended to ``path`` (or nothing, for ``path=None``)."""

    def __init__(self, path: str | None, append: bool = False) -> None:
        self._file: TextIO | None = None
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            # Open for the whole run (a record per log_every steps); close() ends it.
            self._file = open(path, "a" if append else "w")  # noqa: SIM115

    @property
    def active(self) -> bool:
        return self._file is not None

    def record(self, event: str, **values: Any) -> None:
        """One JSON line; a NaN or infinite number is written as ``null`` (strict JSON)."""
        if self._file is not None:
            self._file.write(json.dumps(_strict({"event": event, **values}),
                                        allow_nan=False) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _strict(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None, at any depth."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value


def progress_bar(total: int | None, initial: int, label: str, out: TextIO) -> Any:
    """A tqdm bar of ``total`` steps (loss, samples/s and ETA as its postfix)."""
    from tqdm import tqdm  # optional dependency: only imported when a bar is asked for

    # A rank's pseudo-terminal from mpirun has no size, and tqdm draws
    # nothing on a screen of 0 rows: say 80 x 24 unless the size is known.
    size = shutil.get_terminal_size((80, 24))
    return tqdm(total=total, initial=initial if total is None else min(initial, total),
                unit="step", desc=label, file=out,
                ncols=min(size.columns, 100), nrows=max(size.lines, 2), leave=True,
                bar_format="{desc} {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} "
                           "[{elapsed}<{remaining}{postfix}]")


def interactive_output(stream: TextIO | None = None) -> bool:
    """Whether ``stream`` (stdout) reaches a person's terminal.

    Open MPI gives every rank a pseudo-terminal as stdout even when mpirun's
    own output goes to a file, so under mpirun the answer is mpirun's (the
    parent's) stdout; a Slurm batch job writes to a file unless ``srun --pty``.
    """
    stream = stream or sys.stdout
    try:
        if not stream.isatty():
            return False
    except (AttributeError, ValueError):
        return False
    if os.environ.get("SLURM_JOB_ID") and not os.environ.get("SLURM_PTY_PORT"):
        return False
    if "OMPI_COMM_WORLD_SIZE" in os.environ:
        try:
            target = os.readlink(f"/proc/{os.getppid()}/fd/1")
        except OSError:
            return False   # a remote daemon's stdout: not a terminal we can see
        return target.startswith(("/dev/pts/", "/dev/tty"))
    return True


def peak_rss_bytes() -> int:
    """This process's peak resident memory over its life (memory phases reset the
    kernel's peak: [`process_peak_rss`][mpishard.parallel.memory.process_peak_rss])."""
    return process_peak_rss()


def clock(seconds: float) -> str:
    """``m:ss``, or ``?`` for a time not known."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    m, s = divmod(int(round(seconds)), 60)
    return f"{m}:{s:02d}"
