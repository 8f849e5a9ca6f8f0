"""Pipeline parallelism: micro-batch schedules and their execution across stages."""

from .schedules import SCHEDULES, bubble_fraction, peak_in_flight, schedule

__all__ = ["SCHEDULES", "bubble_fraction", "peak_in_flight", "schedule"]
