"""The public strategies: DDP, ZeRO-2, 3D hybrid and elastic training.

Each class here is its parallel core (:mod:`mpishard.parallel`: attach,
backward, step, state) with the training loop's ``optimize()``
(:class:`~mpishard.train.Trainable`) on top: ``DDPOptimizer(AdamW(lr),
config).optimize(model, (x, y), epochs=10, batch_size=256)``.
"""

from __future__ import annotations

from .. import parallel
from ..parallel import DataParallelOptimizer, HybridShardedModel, choose_reduce_method
from ..parallel.hybrid import HybridDDPOptimizer as _CoreHybridDDP
from ..parallel.hybrid import HybridZeRO2Optimizer as _CoreHybridZeRO2
from ..train import ElasticOptimizer, Trainable, TrainResult

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


class DDPOptimizer(Trainable, parallel.DDPOptimizer):
    __doc__ = parallel.DDPOptimizer.__doc__


class ZeRO2Optimizer(Trainable, parallel.ZeRO2Optimizer):
    __doc__ = parallel.ZeRO2Optimizer.__doc__


class HybridShardedOptimizer(Trainable, parallel.HybridShardedOptimizer):
    __doc__ = parallel.HybridShardedOptimizer.__doc__


# Base order: the facade first (so isinstance(x, HybridShardedOptimizer) holds and
# Trainable precedes the core), then the core strategy.
class HybridDDPOptimizer(HybridShardedOptimizer, _CoreHybridDDP):
    __doc__ = _CoreHybridDDP.__doc__


class HybridZeRO2Optimizer(HybridShardedOptimizer, _CoreHybridZeRO2):
    __doc__ = _CoreHybridZeRO2.__doc__


# The public class builds the public variants (parallel.HybridShardedOptimizer's
# __new__ dispatches on this table).
HybridShardedOptimizer._variants = {"ddp": HybridDDPOptimizer, "zero2": HybridZeRO2Optimizer}
