"""``PartReads``: what a core's two parts hold, read through the core.

Mixed into [`DataParallelCore`][mpishard.parallel.base.DataParallelCore]: the
parameters and the optimizer state as the
[parameter placement][mpishard.parallel.placement] holds them
(`parameter_shard`, `optimizer_state_shard`, `gathered_parameters`, ...),
the check that the replicas agree, and the attributes 0.5 had on the core
(`reducer`, `reduction_timings`, `state`) read from the parts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from ..errors import CommunicationError
from ..flat import Range

__all__ = ["PartReads"]


class PartReads:
    """The parts' state, read through the core (its ``reduction`` and
    ``placement``, None before attach)."""

    def _require_model(self) -> Any:
        if self.model is None:
            raise RuntimeError(f"{self.public} has no model: pass model= when "
                               f"you make it ({self.public}(optimizer, config, "
                               f"model=model)), or call attach(model) or optimize(model, "
                               f"...) first")
        return self.model

    # --- the parts, for readers of 0.5's attributes -------------------------------------
    @property
    def reducer(self) -> Any:
        """The gradient reduction's [`Reducer`][mpishard.comm.reducer.Reducer]."""
        return self.reduction.reducer if self.reduction is not None else None

    @property
    def reduction_timings(self) -> dict[str, Any]:
        """What the reducer's measurement at attach found."""
        return self.reduction.timings if self.reduction is not None else {}

    @property
    def state(self) -> dict[str, Any]:
        """The optimizer state this rank holds (whole, or its shard), by name."""
        return self.placement.state

    # --- parameters and state ---------------------------------------------------
    @contextlib.contextmanager
    def gathered_parameters(self) -> Iterator[Any]:
        """The whole parameter vector, ``model.params``, for the ``with`` block (the
        model's own; ZeRO-3 gathers it: collective over ``groups.dp``)."""
        self._require_model()
        with self.placement.gathered_parameters() as params:
            yield params

    def parameter_shard(self) -> tuple[Range, Any]:
        """The world range of the parameters this rank holds, and them (the whole
        vector, or ZeRO-3's shard: writes to it are read by the next forward). Local."""
        self._require_model()
        return self.placement.parameter_shard()

    def optimizer_state_shard(self) -> tuple[Range, dict[str, Any]]:
        """The world range of the optimizer state this rank holds, and the state."""
        return self.placement.optimizer_state_shard()

    def synchronize_optimizer_state(self) -> dict[str, Any]:
        """The whole optimizer state on every rank, by name (allocated where it is
        sharded: counted in the peak of ``memory_report``). Collective over
        ``groups.dp``."""
        return self.placement.synchronize_optimizer_state(self.note_peak)

    def verify_in_sync(self) -> None:
        """Check that every data-parallel rank is at the same step and holds the
        same parameters (a hash of each replica's vector; ZeRO-3: of the whole
        vector as gathered). Collective over ``groups.dp``.

        Raises:
            CommunicationError: on every rank, naming the ranks that differ.
        """
        self._require_model()
        digest, who, what = self.placement.digest()
        every = self.dp.allgather((digest, self.step_count))
        if len(set(every)) > 1:
            odd = [r for r, d in enumerate(every) if d != every[0]]
            raise CommunicationError(
                f"{who} out of sync: data-parallel rank(s) {odd} differ from rank 0 "
                f"({what}, step) = {every[0]}")
