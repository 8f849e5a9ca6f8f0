"""The public strategies, one class per name: DDP, ZeRO-2, ZeRO-3, 3D hybrid and elastic.

Each is a [`Strategy`][mpishard.strategies.base.Strategy]: a parallel core
([`mpishard.parallel`][mpishard.parallel]: attach, backward, step, state) and the
one training loop as ``optimize()``:
``DDPOptimizer(AdamW(lr), config).optimize(model, (x, y), epochs=10, batch_size=256)``.
[`STRATEGIES`][mpishard.strategies.registry.STRATEGIES] names the data-parallel ones
(``"ddp"``, ``"zero2"``, ``"zero3"``) for the elastic and hybrid strategies, the
commands and the tests.

Importing the package does not initialise MPI: the registry is read at once, the
classes are loaded on first use (``mpishard train --help`` and ``mpishard plan``
read the registry in the process that starts ``mpirun``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .registry import STRATEGIES, StrategyEntry, strategy_entry

if TYPE_CHECKING:
    from ..nn.hybrid import HybridShardedModel
    from ..parallel import choose_reduce_method
    from ..train import TrainResult
    from .base import Strategy
    from .ddp import DDPOptimizer
    from .elastic import BATCH_POLICIES, ElasticOptimizer
    from .hybrid import HybridShardedOptimizer
    from .zero2 import ZeRO2Optimizer
    from .zero3 import ZeRO3Optimizer

__all__ = [
    "BATCH_POLICIES",
    "STRATEGIES",
    "DDPOptimizer",
    "ElasticOptimizer",
    "HybridShardedModel",
    "HybridShardedOptimizer",
    "Strategy",
    "StrategyEntry",
    "TrainResult",
    "ZeRO2Optimizer",
    "ZeRO3Optimizer",
    "choose_reduce_method",
    "strategy_entry",
]

# Where each name loaded on first use lives (relative to this package).
_WHERE = {
    "BATCH_POLICIES": ".elastic", "DDPOptimizer": ".ddp", "ElasticOptimizer": ".elastic",
    "HybridShardedModel": "..nn.hybrid", "HybridShardedOptimizer": ".hybrid",
    "Strategy": ".base", "TrainResult": "..train", "ZeRO2Optimizer": ".zero2",
    "ZeRO3Optimizer": ".zero3", "choose_reduce_method": "..parallel",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
