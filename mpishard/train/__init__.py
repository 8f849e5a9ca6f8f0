"""The one training loop, and elastic training on top of it."""

from .elastic import BATCH_POLICIES, ElasticOptimizer
from .loop import StopRequest, TrainingReport, evaluate, interactive_output, run_training

__all__ = [
    "BATCH_POLICIES",
    "ElasticOptimizer",
    "StopRequest",
    "TrainingReport",
    "evaluate",
    "interactive_output",
    "run_training",
]
