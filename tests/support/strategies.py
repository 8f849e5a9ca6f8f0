"""The data-parallel strategies of the tests, by test id, read from the one registry.

Every strategy of ``mpishard.strategies.STRATEGIES`` is here under its name, and
those that reduce the gradient to shards once more per ``reduce_method`` pinned
(``zero2-ring``, ...). A strategy added to the registry is tested by every suite
parametrised over this table without a test file copied.
"""

from __future__ import annotations

import functools

import numpy as np

from mpishard.backend import to_numpy
from mpishard.strategies import STRATEGIES as REGISTRY

__all__ = ["NAMES", "SHARDED", "STRATEGIES", "build", "whole"]

#: The registry's names (``"ddp"``, ``"zero2"``, ``"zero3"``).
NAMES = list(REGISTRY)
#: The strategies that reduce the gradient to shards, and so take ``reduce_method``.
SHARDED = [name for name, entry in REGISTRY.items() if entry.cost.reduce_scatter]
# The reduce methods a sharded strategy is tested with, each pinned ("auto" times them).
_METHODS = ("reduce_scatter", "allreduce", "ring")


def build(name: str, optimizer, config, **options):
    """``name``'s public class (a registry name) over ``config``."""
    return REGISTRY[name].public_class(optimizer, config, **options)


def _variants():
    for name in NAMES:
        if name not in SHARDED:
            yield name, functools.partial(build, name)
            continue
        for method in _METHODS:
            yield f"{name}-{method}", functools.partial(build, name, reduce_method=method)


#: By test id: ``STRATEGIES[id](optimizer, config, **options)``.
STRATEGIES = dict(_variants())


def whole(strategy) -> np.ndarray:
    """A copy of the whole parameter vector of ``strategy``'s model, on every rank
    (gathered where the strategy shards it: collective over ``groups.dp``)."""
    with strategy.gathered_parameters() as params:
        return np.array(to_numpy(params))
