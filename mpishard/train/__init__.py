"""The one training loop (:func:`run_training`), behind every ``optimize()``,
:class:`ElasticOptimizer` and ``mpishard train``; its result, stop requests and
evaluation."""

from .elastic import BATCH_POLICIES, ElasticOptimizer
from .evaluate import evaluate
from .loop import run_training
from .progress import interactive_output, peak_rss_bytes
from .result import TrainResult
from .signals import StopRequest
from .trainable import Trainable

#: The former name of :class:`TrainResult` (``run_training``'s report); the same class.
TrainingReport = TrainResult

__all__ = [
    "BATCH_POLICIES",
    "ElasticOptimizer",
    "StopRequest",
    "TrainResult",
    "Trainable",
    "TrainingReport",
    "evaluate",
    "interactive_output",
    "peak_rss_bytes",
    "run_training",
]
