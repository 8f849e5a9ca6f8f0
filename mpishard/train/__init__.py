"""The one training loop ([`run_training`][mpishard.train.loop.run_training]), behind every
``optimize()``, ``ElasticOptimizer`` and ``mpishard train``: feeding, reporting and the step loop,
its option groups, its result, stop requests and evaluation."""

from .evaluate import evaluate, evaluation_group
from .loop import run_training
from .options import Checkpointing, Reporting, Sampling
from .progress import interactive_output, peak_rss_bytes
from .result import TrainResult
from .signals import StopRequest

#: The former name of `TrainResult` (``run_training``'s report); the same class.
TrainingReport = TrainResult

__all__ = [
    "Checkpointing",
    "Reporting",
    "Sampling",
    "StopRequest",
    "TrainResult",
    "TrainingReport",
    "evaluate",
    "evaluation_group",
    "interactive_output",
    "peak_rss_bytes",
    "run_training",
]
