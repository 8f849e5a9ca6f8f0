"""The parallel layer: the strategy cores, how gradients, state and parameters are
spread over ranks.

Each core here owns attach / backward / step / state, how a bucket of gradients
is reduced and :meth:`~DataParallelCore.rebuild` over new groups; it knows
nothing of data sets, checkpoints or training loops (the layers above:
:mod:`mpishard.train` runs the loop, :mod:`mpishard.strategies` holds the public
classes, one per name).
"""

from .._deprecated import forward_names
from . import base as _base
from . import ddp as _ddp
from . import zero2 as _zero2
from .base import DataParallelCore, DataParallelOptions
from .ddp import DDPCore
from .hybrid import (
    HybridCore,
    HybridDDPCore,
    HybridShardedModel,
    HybridZeRO2Core,
    HybridZeRO3Core,
)
from .zero2 import REDUCE_METHODS, ZeRO2Core, ZeRO2Options, choose_reduce_method
from .zero3 import ZeRO3Core, ZeRO3Options

__all__ = [
    "REDUCE_METHODS",
    "DDPCore",
    "DataParallelCore",
    "DataParallelOptions",
    "HybridCore",
    "HybridDDPCore",
    "HybridShardedModel",
    "HybridZeRO2Core",
    "HybridZeRO3Core",
    "ZeRO2Core",
    "ZeRO2Options",
    "ZeRO3Core",
    "ZeRO3Options",
    "choose_reduce_method",
]

# 0.4's names of the cores (the public classes are mpishard.strategies'): one version more.
__getattr__ = forward_names(__name__, {
    "DDPOptimizer": (_ddp, "DDPCore"),
    "ZeRO2Optimizer": (_zero2, "ZeRO2Core"),
    "DataParallelOptimizer": (_base, "DataParallelCore"),
})
