"""The parallel layer: how gradients, state and parameters are spread over ranks.

Each strategy here owns attach / backward / step / state and how a bucket of
gradients is reduced; it knows nothing of data sets, checkpoints or training
loops (those are the layers above: :mod:`mpishard.train` runs the loop).
"""

from .base import DataParallelOptimizer
from .ddp import DDPOptimizer
from .hybrid import HybridShardedModel, HybridShardedOptimizer
from .zero2 import REDUCE_METHODS, ZeRO2Optimizer, choose_reduce_method

__all__ = [
    "DDPOptimizer",
    "DataParallelOptimizer",
    "HybridShardedModel",
    "HybridShardedOptimizer",
    "REDUCE_METHODS",
    "ZeRO2Optimizer",
    "choose_reduce_method",
]
