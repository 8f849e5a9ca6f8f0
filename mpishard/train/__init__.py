"""The one training loop (:func:`run_training`), behind every ``optimize()``,
``ElasticOptimizer`` and ``mpishard train``: feeding, reporting and the step loop,
its option groups, its result, stop requests and evaluation."""

from .evaluate import evaluate
from .loop import run_training
from .options import Checkpointing, Reporting, Sampling
from .progress import interactive_output, peak_rss_bytes
from .result import TrainResult
from .signals import StopRequest

#: The former name of :class:`TrainResult` (``run_training``'s report); the same class.
TrainingReport = TrainResult

__all__ = [
    "Checkpointing",
    "Reporting",
    "Sampling",
    "StopRequest",
    "TrainResult",
    "TrainingReport",
    "evaluate",
    "interactive_output",
    "peak_rss_bytes",
    "run_training",
]


def __getattr__(name: str):
    # 0.4 exported the elastic optimizer here; it lives in mpishard.strategies now.
    if name in ("ElasticOptimizer", "BATCH_POLICIES"):
        import warnings

        from ..strategies import elastic

        warnings.warn(f"mpishard.train.{name} is deprecated and goes in 0.6: use "
                      f"mpishard.strategies.{name}", DeprecationWarning, stacklevel=2)
        return getattr(elastic, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
