"""Optimizers, learning-rate schedules and gradient clipping for flat vectors."""

from __future__ import annotations

from .adam import Adam, AdamW
from .base import FlatOptimizer
from .clip import clip_coefficient, sum_of_squares
from .registry import get_optimizer, optimizer_from_hyperparameters
from .schedules import (
    ConstantSchedule,
    CosineSchedule,
    Schedule,
    WarmupSchedule,
    schedule_from_dict,
)
from .sgd import SGD

__all__ = [
    "Adam",
    "AdamW",
    "ConstantSchedule",
    "CosineSchedule",
    "FlatOptimizer",
    "SGD",
    "Schedule",
    "WarmupSchedule",
    "clip_coefficient",
    "get_optimizer",
    "optimizer_from_hyperparameters",
    "schedule_from_dict",
    "sum_of_squares",
]
