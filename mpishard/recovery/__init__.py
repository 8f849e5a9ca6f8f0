"""After a lost rank (ULFM): the strategy rebuilt in place over the survivors, whole
3D replicas kept, ZeRO-2 and ZeRO-3 shards from buddy copies (moved shard to shard,
never whole), a rollback to a checkpoint, or a typed hand-over to a relaunch.

The mechanism (revoke, shrink, agree) is [`mpishard.comm.ulfm`][mpishard.comm.ulfm]'s; this package
is the policy. The training loop talks to it through
[`RecoveryPolicy`][mpishard.recovery.policy.RecoveryPolicy] only:
``after_step(position)`` after each step, ``recover(error) ->``
[`Recovered`][mpishard.recovery.common.Recovered] when a step fails; a
[`HandOver`][mpishard.errors.HandOver] ends the process
([`hand_over`][mpishard.recovery.handover.hand_over]). Recovery never asks a
core's class: it asks the core ([`RecoverableCore`][mpishard.protocols.RecoverableCore])
and its parts. The rules are on the docs site's faults page.
"""

from ..errors import HandOver, InexactRecoveryWarning
from .common import Recovered, StepMarks
from .handover import hand_over
from .inplace import communicators, recover_in_place, recoverable, shrink_only
from .policy import RecoveryPolicy
from .replicas import drop_replicas, whole_replicas
from .resplit import Moved, moves, resplit
from .shardcopy import ShardBuddy, sharded_pieces, zero2_candidates, zero2_rebuild
from .spares import Promoted, promote_spares, wait_as_spare

__all__ = [
    "HandOver",
    "InexactRecoveryWarning",
    "Moved",
    "Promoted",
    "Recovered",
    "RecoveryPolicy",
    "ShardBuddy",
    "StepMarks",
    "communicators",
    "drop_replicas",
    "hand_over",
    "moves",
    "promote_spares",
    "recover_in_place",
    "recoverable",
    "resplit",
    "sharded_pieces",
    "shrink_only",
    "wait_as_spare",
    "whole_replicas",
    "zero2_candidates",
    "zero2_rebuild",
]

# 0.5's names (the faults guide names them), kept importable.
Recovery = RecoveryPolicy
leave = hand_over
