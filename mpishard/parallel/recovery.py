"""Deprecated: recovery after a lost rank lives in :mod:`mpishard.recovery`."""

from .._deprecated import forward_names

# Nothing is defined here: the names are read from their new home (a layer
# above, named by its path), with a warning.
__all__: list[str] = []

__getattr__ = forward_names(__name__, {
    name: ("mpishard.recovery", name)
    for name in ("InexactRecoveryWarning", "ShardBuddy", "communicators", "recover_in_place",
                 "recoverable", "shrink_only")})
