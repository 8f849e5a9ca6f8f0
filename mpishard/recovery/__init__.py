"""After a lost rank (ULFM): the strategy rebuilt in place over the survivors, whole
3D replicas kept, ZeRO-2 shards from buddy copies, a rollback to a checkpoint, or a
typed hand-over to a relaunch.

The mechanism (revoke, shrink, agree) is :mod:`mpishard.comm.ulfm`'s; this package
is the policy. The training loop talks to it through :class:`Recovery` only:
``after_step(position)`` after each step, ``recover(error) -> event`` when a step
fails; a :class:`~mpishard.errors.HandOver` ends the process
(:func:`~mpishard.recovery.handover.leave`). The rules are on the docs site's
faults page.
"""

from ..errors import HandOver, InexactRecoveryWarning
from .common import StepMarks
from .handover import leave
from .inplace import communicators, recover_in_place, recoverable, shrink_only
from .policy import Recovery
from .replicas import drop_replicas, whole_replicas
from .shardcopy import ShardBuddy, zero2_candidates, zero2_rebuild

__all__ = [
    "HandOver",
    "InexactRecoveryWarning",
    "Recovery",
    "ShardBuddy",
    "StepMarks",
    "communicators",
    "drop_replicas",
    "leave",
    "recover_in_place",
    "recoverable",
    "shrink_only",
    "whole_replicas",
    "zero2_candidates",
    "zero2_rebuild",
]
