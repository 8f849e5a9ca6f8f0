"""The options of the data-parallel cores, their one home (the core's ``options``).

[`DataParallelOptions`][mpishard.parallel.options.DataParallelOptions] for every
core, [`ZeRO2Options`][mpishard.parallel.options.ZeRO2Options] for the cores
whose gradient is reduced to shards, and
[`ZeRO3Options`][mpishard.parallel.options.ZeRO3Options] for ZeRO-3's gathers.
Pure: each says what is wrong with it (``problem()``), the core agrees on it.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from .overlap import OVERLAP_CHOICES

__all__ = ["AUTO_BUCKET_LIMITS_MB", "AUTO_BUCKET_SHARE", "NONFINITE_POLICIES", "REDUCE_METHODS",
           "DataParallelOptions", "OptionsHome", "ZeRO2Options", "ZeRO3Options",
           "auto_bucket_elements"]

#: What ``nonfinite=`` accepts.
NONFINITE_POLICIES = ("error", "skip")

#: Ways of reducing a bucket to its shards: MPI's reduce-scatter, MPI's allreduce
#: (keeping this rank's piece), or a ring of point-to-point messages
#: ([`RingComm`][mpishard.comm.ring.RingComm]; host arrays only).
REDUCE_METHODS = ("reduce_scatter", "allreduce", "ring")

#: DDP's and ZeRO-2's bucket size in MiB when ``bucket_mb="auto"`` (their default).
DEFAULT_BUCKET_MB = 25.0
#: ZeRO-3's ``"auto"`` bucket: this share of a rank's shard of the parameters ...
AUTO_BUCKET_SHARE = 1 / 8
#: ... kept within these bounds in MiB (below 64 KiB a collective costs its
#: latency, above 25 MiB it gains nothing: DDP's default).
AUTO_BUCKET_LIMITS_MB = (1 / 16, DEFAULT_BUCKET_MB)


def auto_bucket_elements(size: int, itemsize: int, ranks: int) -> int:
    """ZeRO-3's bucket (gradient and gather) for ``bucket_mb="auto"``: an eighth
    of a rank's shard (``ceil(size / ranks)`` elements), within
    ``AUTO_BUCKET_LIMITS_MB``. Two gradient and two gather buffers of that size
    cost half a shard, so the peak of parameters, gradients and state stays
    within 1.15x of their shards plus two gather buckets (Adam or SGD); a layer
    larger than the bucket is a bucket of its own, whatever the size. Pure."""
    shard = -(-size // max(ranks, 1))
    low, high = (int(mb * 2**20) // itemsize for mb in AUTO_BUCKET_LIMITS_MB)
    return max(1, min(high, max(low, int(shard * AUTO_BUCKET_SHARE))))


def _is_auto(value: Any) -> bool:
    return value is None or (isinstance(value, str) and value == "auto")


def _size_problem(name: str, value: Any) -> str | None:
    if _is_auto(value) or (isinstance(value, numbers.Real) and not isinstance(value, bool)
                           and value > 0):
        return None
    return f"{name} must be positive, got {value!r} (or 'auto': chosen at attach)"


@dataclass(frozen=True)
class DataParallelOptions:
    """The options every data-parallel core takes (keyword arguments of its
    constructor): their one home is the core's ``options``, kept whole by
    [`DataParallelCore.rebuild`][mpishard.parallel.base.DataParallelCore.rebuild]
    (the core reads them as attributes, ``core.bucket_mb``; a write such as
    ``core.schedule = f`` replaces the option, checked). Values resolved at
    attach have their own names: ``bucketed`` (``overlap``), ZeRO's
    ``reduction.method`` (``reduce_method``), ``bucket_elements``
    (``bucket_mb``), ZeRO-3's ``placement.gather_elements`` (``gather_mb``).

    Attributes:
        bucket_mb: gradient bucket size in MiB; ``"auto"`` (or None): 25 for
            DDP and ZeRO-2, chosen from the model and the ranks for ZeRO-3
            ([`auto_bucket_elements`][mpishard.parallel.options.auto_bucket_elements]).
            The size used is the core's ``bucket_elements`` (set at attach).
        accumulation_steps: micro-batches per step; only the last communicates (DDP).
        max_grad_norm: clip by the global gradient norm (None: no clipping).
        schedule: ``step -> factor`` of the learning rate.
        overlap: ``"auto"`` (DDP's default): reduce gradient buckets during
            the backward or after it, as recorded for the layout, modelled, or
            measured by a stand-in backward within a budget at attach
            (``mpishard.parallel.overlap``; ``overlap_timings``,
            ``bucketed``); ``"measure"``: always the stand-in, unbounded; True (ZeRO's default, see
            [`ZeRO2Options`][mpishard.parallel.zero2.ZeRO2Options]): during it (library
            models only); False: after it. The two ways may add in a different
            order on 3 or more ranks: pin one where two runs must agree bit for
            bit, or train with ``ShardingConfiguration(reproducible=True)``.
        nonfinite: ``"error"`` (a NaN or infinite loss or gradient norm raises
            [`NonFiniteError`][mpishard.errors.NonFiniteError] on every rank) or ``"skip"``
            (no update on any rank; counted in ``skipped_steps``).
    """

    bucket_mb: float | str | None = DEFAULT_BUCKET_MB
    accumulation_steps: int = 1
    max_grad_norm: float | None = None
    schedule: Callable[[int], float] | None = None
    overlap: bool | str = "auto"
    nonfinite: str = "error"

    def __post_init__(self) -> None:
        steps = self.accumulation_steps
        if isinstance(steps, numbers.Integral) and not isinstance(steps, bool):
            object.__setattr__(self, "accumulation_steps", int(steps))   # np.int64(2) -> 2

    def problem(self) -> str | None:
        """Why these options cannot be used, or None. Pure."""
        steps = self.accumulation_steps
        if not isinstance(steps, numbers.Integral) or isinstance(steps, bool) or steps < 1:
            return f"accumulation_steps must be a positive integer, got {steps!r}"
        problem = _size_problem("bucket_mb", self.bucket_mb)
        if problem is not None:
            return problem
        if self.max_grad_norm is not None and not (self.max_grad_norm > 0):
            return f"max_grad_norm must be positive or None, got {self.max_grad_norm!r}"
        if self.nonfinite not in NONFINITE_POLICIES:
            return f"nonfinite must be one of {NONFINITE_POLICIES}, got {self.nonfinite!r}"
        if not any(self.overlap is c if isinstance(c, bool) else self.overlap == c
                   for c in OVERLAP_CHOICES):   # a str read from a file is not `is` "auto"
            return f"overlap must be True, False, 'auto' or 'measure', got {self.overlap!r}"
        return None

    def _auto_bucket(self, size: int, itemsize: int, ranks: int) -> int:
        return max(1, int(DEFAULT_BUCKET_MB * 2**20) // itemsize)

    def bucket_elements(self, size: int, itemsize: int, ranks: int) -> int:
        """The gradient bucket size in elements for a vector of ``size`` elements of
        ``itemsize`` bytes over ``ranks`` data-parallel ranks: ``bucket_mb``, or
        its ``"auto"`` choice. Pure."""
        if _is_auto(self.bucket_mb):
            return self._auto_bucket(size, itemsize, ranks)
        return max(1, int(self.bucket_mb * 2**20) // itemsize)


@dataclass(frozen=True)
class ZeRO2Options(DataParallelOptions):
    """[`DataParallelOptions`][mpishard.parallel.base.DataParallelOptions] and ZeRO-2's own.

    Attributes:
        reduce_method: ``"auto"`` (measure them at attach, on a bucket-sized
            buffer, and keep the fastest: the core's ``reduction.method``),
            ``"reduce_scatter"``, ``"allreduce"`` or ``"ring"``
            ([`RingComm`][mpishard.comm.ring.RingComm]; host arrays only).
            All give the same sum up to rounding; on 3 or more ranks they
            may add in a different order, so pin one where two runs must agree
            bit for bit, or train with ``ShardingConfiguration(reproducible=True)``.
        buddy_copies: with fault tolerance on, each rank keeps copies of its
            right neighbour's shard (parameters and optimizer state) and of its
            own from before the update ([`ShardBuddy`][mpishard.recovery.ShardBuddy]),
            so a rank lost at any point of a step is recovered exactly; False: a
            lost shard rolls back to the newest checkpoint.
        overlap: as [`DataParallelOptions`][mpishard.parallel.base.DataParallelOptions]', but
            True by default: reducing after the backward needs the whole
            gradient, which the bucketed backward never holds (two bucket
            buffers and the shard instead), so ``"auto"`` could trade ZeRO's
            gradient memory for a timing. Pass ``"auto"`` to let it.
    """

    # (Redefined with ZeRO's default; a dataclass field keeps its place.)
    overlap: bool | str = True
    reduce_method: str = "auto"
    buddy_copies: bool = True

    def problem(self) -> str | None:
        if self.reduce_method not in ("auto",) + REDUCE_METHODS:
            return (f"reduce_method must be 'auto' or one of {REDUCE_METHODS}, "
                    f"got {self.reduce_method!r}")
        return super().problem()


@dataclass(frozen=True)
class ZeRO3Options(ZeRO2Options):
    """[`ZeRO2Options`][mpishard.parallel.options.ZeRO2Options] and ZeRO-3's own.

    Attributes:
        prefetch: start gathering the next bucket of parameters (``Iallgatherv``)
            while the layers of the current one compute; False: each bucket is
            gathered (``Allgatherv``) when its first layer needs it, one slot of
            parameters instead of two.
        keep_gathered: keep what a forward gathered for its backward (a slot per
            bucket: the whole vector's memory, one gather per forward, none in
            the backward); False: the backward gathers again what has left its slot.
        gather_mb: size of a bucket of gathered parameters in MiB (whole units:
            a layer larger than this is a bucket of its own); ``"auto"`` (or
            None): the bucket size in use (``bucket_mb``, or its ``"auto"``
            choice). The size used is the placement's ``gather_elements``.
        bucket_mb: as [`DataParallelOptions`][mpishard.parallel.base.DataParallelOptions]',
            but ``"auto"`` by default: an eighth of a rank's shard of the
            parameters, within 64 KiB and 25 MiB
            ([`auto_bucket_elements`][mpishard.parallel.options.auto_bucket_elements]),
            so that the two gradient and two gather buffers stay small beside
            the shards even for a model of a few buckets of 25 MiB.
    """

    # (Redefined with ZeRO-3's default; a dataclass field keeps its place.)
    bucket_mb: float | str | None = "auto"
    prefetch: bool = True
    keep_gathered: bool = False
    gather_mb: float | str | None = "auto"

    def problem(self) -> str | None:
        for name in ("prefetch", "keep_gathered"):
            if not isinstance(getattr(self, name), bool):
                return f"{name} must be True or False, got {getattr(self, name)!r}"
        return _size_problem("gather_mb", self.gather_mb) or super().problem()

    def _auto_bucket(self, size: int, itemsize: int, ranks: int) -> int:
        return auto_bucket_elements(size, itemsize, ranks)

    def gather_elements(self, size: int, itemsize: int, ranks: int) -> int:
        """The gather bucket size in elements: ``gather_mb``, or (``"auto"``) the
        gradient bucket's. Pure."""
        if _is_auto(self.gather_mb):
            return self.bucket_elements(size, itemsize, ranks)
        return max(1, int(self.gather_mb * 2**20) // itemsize)


@functools.cache
def _option_names(options: type) -> frozenset[str]:
    return frozenset(f.name for f in fields(options))


class OptionsHome:
    """An object whose options have one home, ``options`` (a frozen dataclass of
    `Options`): each option is read as an attribute (``core.bucket_mb``),
    and a write of one (``core.schedule = f``) replaces it there, checked, so no
    attribute can diverge from the options."""

    #: The options dataclass (a subclass of ``DataParallelOptions``).
    Options: ClassVar[type[DataParallelOptions]] = DataParallelOptions

    def _take_options(self, world: Any, who: str, given: dict[str, Any]) -> None:
        """Make ``options`` from the keyword arguments ``given``. Collective over
        ``world`` (errors are agreed).

        Raises:
            TypeError: an unknown option; ValueError: one out of range (on every rank).
        """
        unknown = sorted(set(given) - _option_names(self.Options))
        world.agree(f"{who} got unknown option(s) {unknown}; expecting "
                    f"{[f.name for f in fields(self.Options)]}" if unknown else None, TypeError)
        #: The constructor's options, their one home.
        self.options = self.Options(**given)
        world.agree(self.options.problem(), ValueError)

    def __getattr__(self, name: str) -> Any:
        # Only for names found nowhere else: an option is read from the options.
        options = self.__dict__.get("options")
        if options is not None and name in _option_names(type(options)):
            return getattr(options, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        options = self.__dict__.get("options")
        if options is not None and name in _option_names(type(options)):
            self.replace_options(**{name: value})
        else:
            object.__setattr__(self, name, value)

    def replace_options(self, **changes: Any) -> None:
        """Change options after construction (a checkpoint's ``schedule``), checked
        as the constructor does; what attach set up from them stays. Local.

        Raises:
            ValueError: an option out of range.
        """
        options = dataclasses.replace(self.options, **changes)
        problem = options.problem()
        if problem is not None:
            raise ValueError(problem)
        object.__setattr__(self, "options", options)
