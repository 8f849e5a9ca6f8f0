"""The one table of the data-parallel strategies: name -> classes, cost and summary.

Every lookup of a strategy by name reads [`STRATEGIES`][mpishard.strategies.registry.STRATEGIES]:
[`ElasticOptimizer`][mpishard.strategies.elastic.ElasticOptimizer]'s ``strategy``,
[`HybridShardedOptimizer`][mpishard.strategies.hybrid.HybridShardedOptimizer]'s
``data_parallel``, ``mpishard train --strategy``, ``mpishard plan --strategy`` and
the tests' parametrisation; a test fails when a docs page's strategy list misses
one of its names. Adding a strategy is one entry here (and its parts).

Importing this module does not initialise MPI: an entry names its classes by
dotted path and loads them on first use, so ``mpishard train --help`` and
``mpishard plan`` read the table in the process that starts ``mpirun``.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from ..costmodel import DataParallelCost

if TYPE_CHECKING:
    from .base import Strategy

__all__ = ["STRATEGIES", "StrategyEntry", "strategy_entry", "unknown_strategy"]


def _load(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class StrategyEntry:
    """One data-parallel strategy: its name, classes (``"module:Name"``), cost and summary.

    Attributes:
        name: what users type (``strategy="zero2"``, ``--strategy zero2``).
        title: what the docs call it (``"ZeRO-2"``).
        summary: one line for the docs and ``--help``.
        public: the public class, a [`Strategy`][mpishard.strategies.base.Strategy].
        core: its parallel core (``core(optimizer, config, model=..., **options)``).
        hybrid: the core over the data group of a 3D layout.
        cost: what [`mpishard.costmodel`][mpishard.costmodel] counts for it.
    """

    name: str
    title: str
    summary: str
    public: str
    core: str
    hybrid: str
    cost: DataParallelCost

    @property
    def public_class(self) -> type[Strategy]:
        """The public class (imported on first use)."""
        return _load(self.public)

    @property
    def core_class(self) -> type:
        """The parallel core (imported on first use)."""
        return _load(self.core)

    @property
    def hybrid_class(self) -> type:
        """The hybrid core of ``HybridShardedOptimizer(data_parallel=name)``."""
        return _load(self.hybrid)


_ENTRIES = (
    StrategyEntry(
        "ddp", "DDP", "every rank holds the whole model and optimizer state, gradients allreduced",
        "mpishard.strategies.ddp:DDPOptimizer", "mpishard.parallel.ddp:DDPCore",
        "mpishard.parallel.hybrid:HybridDDPCore",
        DataParallelCost("ddp", reduce_scatter=False, gathers=0)),
    StrategyEntry(
        "zero2", "ZeRO-2", "gradients and optimizer state sharded over the data group",
        "mpishard.strategies.zero2:ZeRO2Optimizer", "mpishard.parallel.zero2:ZeRO2Core",
        "mpishard.parallel.hybrid:HybridZeRO2Core",
        DataParallelCost("zero2", reduce_scatter=True, gathers=1, sharded_grads=True,
                         sharded_states=True)),
    StrategyEntry(
        "zero3", "ZeRO-3", "parameters, gradients and optimizer state sharded, each "
        "layer's parameters gathered just before use",
        "mpishard.strategies.zero3:ZeRO3Optimizer", "mpishard.parallel.zero3:ZeRO3Core",
        "mpishard.parallel.hybrid:HybridZeRO3Core",
        # Gathered twice (forward, backward); prefetch holds two layers gathered.
        DataParallelCost("zero3", reduce_scatter=True, gathers=2, sharded_params=True,
                         sharded_grads=True, sharded_states=True, gathered_layers=2)),
)

STRATEGIES: Mapping[str, StrategyEntry] = MappingProxyType({e.name: e for e in _ENTRIES})
"""The data-parallel strategies by name, in the docs' order (read only): ``"ddp"``,
``"zero2"``, ``"zero3"``."""


def unknown_strategy(name: str, what: str = "strategy") -> str | None:
    """The error text for a name not in [`STRATEGIES`][mpishard.strategies.registry.STRATEGIES]
    (``what`` names the argument), or None for a known one."""
    if name in STRATEGIES:
        return None
    return f"{what} must be one of {', '.join(STRATEGIES)}, got {name!r}"


def strategy_entry(name: str, what: str = "strategy") -> StrategyEntry:
    """The entry of ``name``.

    Raises:
        ValueError: an unknown name (the text says which are known).
    """
    problem = unknown_strategy(name, what)
    if problem is not None:
        raise ValueError(problem)
    return STRATEGIES[name]
