"""Learning-rate schedules: multipliers of the base learning rate by 1-based step."""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "ConstantSchedule",
    "CosineSchedule",
    "Schedule",
    "WarmupSchedule",
    "schedule_from_dict",
]


@runtime_checkable
class Schedule(Protocol):
    """``schedule(step)``: the factor applied to the base lr for update ``step`` (1-based)."""

    def __call__(self, step: int) -> float: ...

    def to_dict(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class ConstantSchedule:
    """The base learning rate at every step: ``1.0``."""

    def __call__(self, step: int) -> float:
        _check_step(step)
        return 1.0

    def to_dict(self) -> dict[str, Any]:
        return {"name": type(self).__name__}


@dataclass(frozen=True)
class WarmupSchedule:
    """Linear warm-up, then constant: ``min(1, step / warmup_steps)``.

    Step 1 gets ``1 / warmup_steps``, step ``warmup_steps`` and later ``1.0``;
    ``warmup_steps=0`` is the constant schedule.

    Raises:
        ValueError: ``warmup_steps`` not an integer ``>= 0``.
    """

    warmup_steps: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "warmup_steps",
                           _check_count("warmup_steps", self.warmup_steps, 0))

    def __call__(self, step: int) -> float:
        _check_step(step)
        return _warmup(step, self.warmup_steps)

    def to_dict(self) -> dict[str, Any]:
        return {"name": type(self).__name__, **asdict(self)}


@dataclass(frozen=True)
class CosineSchedule:
    """Linear warm-up over ``warmup_steps``, then cosine decay to ``min_ratio``.

    With ``W = warmup_steps``, ``T = total_steps``::

        step <= W:  step / W
        step >  W:  min_ratio + (1 - min_ratio) * (1 + cos(pi * p)) / 2,
                    p = min(1, (step - W) / (T - W))

    so the factor is ``1.0`` at the end of the warm-up and reaches ``min_ratio``
    at step ``T``, where it stays.

    Raises:
        ValueError: ``total_steps < 1``, ``warmup_steps`` not in ``[0, total_steps)``,
            ``min_ratio`` not in ``[0, 1]``.
    """

    total_steps: int
    warmup_steps: int = 0
    min_ratio: float = 0.0

    def __post_init__(self) -> None:
        for name, low in (("total_steps", 1), ("warmup_steps", 0)):
            object.__setattr__(self, name, _check_count(name, getattr(self, name), low))
        if self.warmup_steps >= self.total_steps:
            raise ValueError(f"expecting warmup_steps < total_steps={self.total_steps}, "
                             f"got {self.warmup_steps}")
        ratio = self.min_ratio
        if (isinstance(ratio, bool) or not isinstance(ratio, numbers.Real)
                or not 0.0 <= ratio <= 1.0):
            raise ValueError(f"expecting min_ratio in [0, 1], got {ratio!r}")
        object.__setattr__(self, "min_ratio", float(ratio))

    def __call__(self, step: int) -> float:
        _check_step(step)
        w, t = self.warmup_steps, self.total_steps
        if step <= w:
            return _warmup(step, w)
        progress = min(1.0, (step - w) / (t - w))
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def to_dict(self) -> dict[str, Any]:
        return {"name": type(self).__name__, **asdict(self)}


_SCHEDULES: dict[str, type] = {
    cls.__name__: cls for cls in (ConstantSchedule, CosineSchedule, WarmupSchedule)}


def schedule_from_dict(d: dict[str, Any]) -> Schedule:
    """Rebuild a schedule from its ``to_dict()``.

    Raises:
        ValueError: no or an unknown ``"name"``, or bad parameters.
    """
    args = dict(d)
    name = args.pop("name", None)
    cls = _SCHEDULES.get(name)  # type: ignore[arg-type]
    if cls is None:
        raise ValueError(f"expecting a schedule name among {sorted(_SCHEDULES)}, got {name!r}")
    try:
        return cls(**args)
    except TypeError as e:
        raise ValueError(f"bad parameters for {name}: {e}") from None


def _warmup(step: int, warmup_steps: int) -> float:
    return 1.0 if step >= warmup_steps else step / warmup_steps


def _check_step(step: int) -> None:
    if step < 1:
        raise ValueError(f"expecting a 1-based step >= 1, got {step}")


def _check_count(name: str, value: Any, low: int) -> int:
    """``value`` as an int (NumPy integers too), or a ValueError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"expecting an integer {name} >= {low}, got {value!r}")
    return int(value)
