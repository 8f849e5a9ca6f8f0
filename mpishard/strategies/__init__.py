"""The public strategies: DDP, ZeRO-2, 3D hybrid and elastic training.

Each class here is its parallel core (:mod:`mpishard.parallel`: attach,
backward, step, state) with the training loop's ``optimize()``
(:class:`~mpishard.train.Trainable`) on top: ``DDPOptimizer(AdamW(lr),
config).optimize(model, (x, y), epochs=10, batch_size=256)``.
"""

from __future__ import annotations

from typing import Any

from .. import parallel
from ..config import ShardingConfiguration
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

    def __new__(cls, optimizer: Any, config: ShardingConfiguration | None = None, *,
                data_parallel: str = "ddp", **kwargs: Any):
        if cls is not HybridShardedOptimizer:
            return object.__new__(cls)
        impls = {"ddp": HybridDDPOptimizer, "zero2": HybridZeRO2Optimizer}
        if data_parallel not in impls:
            raise ValueError(f"data_parallel must be 'ddp' or 'zero2', got {data_parallel!r}")
        return object.__new__(impls[data_parallel])


# Base order: the facade first (so isinstance(x, HybridShardedOptimizer) holds and
# Trainable precedes the core), then the core strategy.
class HybridDDPOptimizer(HybridShardedOptimizer, _CoreHybridDDP):
    __doc__ = _CoreHybridDDP.__doc__


class HybridZeRO2Optimizer(HybridShardedOptimizer, _CoreHybridZeRO2):
    __doc__ = _CoreHybridZeRO2.__doc__
