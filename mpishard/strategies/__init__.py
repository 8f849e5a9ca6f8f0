"""The public strategies, one class per name: DDP, ZeRO-2, ZeRO-3, 3D hybrid and elastic.

Each is a :class:`Strategy`: a parallel core (:mod:`mpishard.parallel`: attach,
backward, step, state) and the one training loop as ``optimize()``:
``DDPOptimizer(AdamW(lr), config).optimize(model, (x, y), epochs=10, batch_size=256)``.
"""

from ..parallel import HybridShardedModel, choose_reduce_method
from ..train import TrainResult
from .base import Strategy
from .ddp import DDPOptimizer
from .elastic import BATCH_POLICIES, ElasticOptimizer
from .hybrid import HybridShardedOptimizer
from .zero2 import ZeRO2Optimizer
from .zero3 import ZeRO3Optimizer

__all__ = [
    "BATCH_POLICIES",
    "DDPOptimizer",
    "ElasticOptimizer",
    "HybridShardedModel",
    "HybridShardedOptimizer",
    "Strategy",
    "TrainResult",
    "ZeRO2Optimizer",
    "ZeRO3Optimizer",
    "choose_reduce_method",
]
