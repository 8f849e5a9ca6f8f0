"""``Progress``: where training is (step count, skipped steps, data position), set in one place."""

from __future__ import annotations

from typing import Any

__all__ = ["Progress"]

_KEEP: Any = object()   # set_progress(): leave this one as it is


def _progress(name: str, doc: str) -> property:
    """A property of where training is, read from ``_<name>``, set through
    ``set_progress`` (the one method that sets it)."""
    return property(lambda core: getattr(core, f"_{name}"),
                    lambda core, value: core.set_progress(**{name: value}), doc=doc)


class Progress:
    """Where training is, saved and restored with checkpoints and put back by a
    recovery: read as attributes, set through `set_progress` only (a
    write of an attribute goes there too). The step itself counts on."""

    step_count = _progress("step_count", "Optimizer steps taken (restored from checkpoints).")
    skipped_steps = _progress(
        "skipped_steps", "Steps refused for a non-finite loss or gradient norm "
        "(``nonfinite='skip'``); they do not count in ``step_count``.")
    data_position = _progress(
        "data_position", "Where the training loop is in the data (epoch, "
        "samples_consumed, seed, batch_size, num_samples, shuffle: ints); None: not "
        "trained yet.")

    def _start_progress(self) -> None:
        self._step_count = 0
        self._skipped_steps = 0
        self._data_position: dict[str, int] | None = None

    def set_progress(self, *, step_count: int = _KEEP, skipped_steps: int = _KEEP,
                     data_position: dict[str, int] | None = _KEEP) -> None:
        """Set where training is (a checkpoint read back, a recovery, the training
        loop's data position); what is not given stays. Local."""
        if step_count is not _KEEP:
            self._step_count = int(step_count)
        if skipped_steps is not _KEEP:
            self._skipped_steps = int(skipped_steps)
        if data_position is not _KEEP:
            self._data_position = data_position
