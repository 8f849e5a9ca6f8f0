"""``ProcessGroups`` (kept here for imports; it lives in :mod:`mpishard.comm.groups`)."""

from .comm.groups import ProcessGroups

__all__ = ["ProcessGroups"]
