"""Old import paths of 0.4 kept for one version: a name read through them warns. Pure.

A new home in a layer above the old module is named by its dotted path and
imported when the name is read, so the old module does not depend on that layer
(the import-layer contracts hold with no exception for these aliases).
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = ["forward_names"]

#: The version that removes the old paths.
REMOVED_IN = "0.6"


def forward_names(old: str,
                  names: dict[str, tuple[ModuleType | str, str]]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for the old module ``old``: each name of ``names``
    (``{old name: (new module or its dotted path, new name)}``) is read from its
    new home with a ``DeprecationWarning`` that says where to import it from."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        home, new = names[name]
        module = importlib.import_module(home) if isinstance(home, str) else home
        warnings.warn(f"{old}.{name} is deprecated and goes in {REMOVED_IN}: use "
                      f"{module.__name__}.{new}", DeprecationWarning, stacklevel=2)
        return getattr(module, new)

    return __getattr__
