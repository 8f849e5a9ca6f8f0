"""Deprecated: recovery after a lost rank lives in :mod:`mpishard.recovery`."""

from typing import Any

# Nothing is defined here: the names are read from their new home, with a warning.
__all__: list[str] = []

_MOVED = ("InexactRecoveryWarning", "ShardBuddy", "communicators", "recover_in_place",
          "recoverable", "shrink_only")


def __getattr__(name: str) -> Any:
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import warnings

    from .. import recovery  # a layer above: this alias is ignored by the contract

    warnings.warn(f"mpishard.parallel.recovery.{name} is deprecated and goes in 0.6: use "
                  f"mpishard.recovery.{name}", DeprecationWarning, stacklevel=2)
    return getattr(recovery, name)
