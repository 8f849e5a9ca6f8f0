"""Training strategies: how gradients, state and parameters are spread over ranks."""

from .base import DataParallelOptimizer, TrainResult
from .ddp import DDPOptimizer
from .elastic import ElasticOptimizer
from .hybrid import HybridShardedModel, HybridShardedOptimizer
from .zero2 import ZeRO2Optimizer, choose_reduce_method

__all__ = [
    "DDPOptimizer",
    "DataParallelOptimizer",
    "ElasticOptimizer",
    "HybridShardedModel",
    "HybridShardedOptimizer",
    "TrainResult",
    "ZeRO2Optimizer",
    "choose_reduce_method",
]
