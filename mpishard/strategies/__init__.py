"""The public strategies: DDP, ZeRO-2, 3D hybrid and elastic training.

(Transitional: re-exports the parallel layer while the training loop moves to
:mod:`mpishard.train`.)
"""

from ..parallel import (DataParallelOptimizer, DDPOptimizer, HybridShardedModel,
                        HybridShardedOptimizer, TrainResult, ZeRO2Optimizer,
                        choose_reduce_method)
from ..train.elastic import ElasticOptimizer

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
