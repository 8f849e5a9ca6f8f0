"""Deprecated: ``ProcessGroups`` lives in [`mpishard.comm`][mpishard.comm]
(``mpishard.comm.groups``)."""

from ._deprecated import forward_names
from .comm import groups as _groups

# Nothing is defined here: the names are read from their new homes, with a warning.
__all__: list[str] = []


__getattr__ = forward_names(__name__, {"ProcessGroups": (_groups, "ProcessGroups")})
