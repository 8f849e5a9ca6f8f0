"""The parallel layer: the strategy cores, how gradients, state and parameters are
spread over ranks.

Each core here ([`DataParallelCore`][mpishard.parallel.base.DataParallelCore]:
attach, backward, step, and [`rebuild`][mpishard.parallel.base.DataParallelCore.rebuild]
over new groups) is a gradient reduction (`reduction.py`) and a parameter
placement (`placement.py`) composed, with the step's totals (`totals.py`); the
rest sits beside it (`attach.py`, `reads.py`, `accounting.py`, `answers.py`,
`progress.py`, `options.py`). It knows nothing of data sets, checkpoints or
training loops (the layers above: [`mpishard.train`][mpishard.train] runs the
loop, `mpishard.strategies` holds the public classes, one per name). The model of 3D parallelism,
[`HybridShardedModel`][mpishard.nn.hybrid.HybridShardedModel], is in the models' layer.
"""

# A model, in the models' layer since 0.6; still importable here (not in __all__, so
# the API reference renders it once, under mpishard.nn).
from ..nn.hybrid import HybridShardedModel as HybridShardedModel
from .base import DataParallelCore, DataParallelOptions
from .ddp import DDPCore
from .hybrid import HybridCore, HybridDDPCore, HybridZeRO2Core, HybridZeRO3Core
from .zero2 import REDUCE_METHODS, ZeRO2Core, ZeRO2Options, choose_reduce_method
from .zero3 import ZeRO3Core, ZeRO3Options

__all__ = [
    "REDUCE_METHODS",
    "DDPCore",
    "DataParallelCore",
    "DataParallelOptions",
    "HybridCore",
    "HybridDDPCore",
    "HybridZeRO2Core",
    "HybridZeRO3Core",
    "ZeRO2Core",
    "ZeRO2Options",
    "ZeRO3Core",
    "ZeRO3Options",
    "choose_reduce_method",
]
