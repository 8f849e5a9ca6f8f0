"""Launching workers: the elastic agent behind ``mpishard run`` and its slot sources."""

from .agent import ElasticAgent, ElasticFailure, last_checkpoint
from .slots import EXIT_RESIZE, SlotSource, next_size, slots_from_hostfile

__all__ = ["EXIT_RESIZE", "ElasticAgent", "ElasticFailure", "SlotSource", "last_checkpoint",
           "next_size", "slots_from_hostfile"]
