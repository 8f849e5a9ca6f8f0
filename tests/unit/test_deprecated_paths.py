"""The old import paths of 0.4, forwarded with a warning in 0.5, are gone in 0.6
(as the 0.5 changelog announced): an old module is a ModuleNotFoundError, an old
name of a module that stays is an AttributeError, and the new home of each
works."""

from __future__ import annotations

import importlib

import pytest

#: The modules that only forwarded (old module, its new home).
GONE_MODULES = [
    ("mpishard.hdf5data", "mpishard.data.hdf5"),
    ("mpishard.groups", "mpishard.comm.groups"),
    ("mpishard.nn.sharding", "mpishard.nn.stack"),
    ("mpishard.checkpoint.strategy", "mpishard.checkpoint.state"),
    ("mpishard.parallel.recovery", "mpishard.recovery"),
    ("mpishard._deprecated", "mpishard"),
]

#: The names that modules still here forwarded (old module, name, new module, new name).
GONE_NAMES = [
    ("mpishard.nn", "ShardedSequential", "mpishard.nn", "LayerStack"),
    ("mpishard.parallel", "DDPOptimizer", "mpishard.parallel", "DDPCore"),
    ("mpishard.parallel", "ZeRO2Optimizer", "mpishard.parallel", "ZeRO2Core"),
    ("mpishard.parallel", "DataParallelOptimizer", "mpishard.parallel", "DataParallelCore"),
    ("mpishard.train", "ElasticOptimizer", "mpishard.strategies", "ElasticOptimizer"),
    ("mpishard.train", "BATCH_POLICIES", "mpishard.strategies.elastic", "BATCH_POLICIES"),
]


@pytest.mark.parametrize("old, home", GONE_MODULES, ids=[old for old, _ in GONE_MODULES])
def test_an_old_module_is_gone(old, home):
    with pytest.raises(ModuleNotFoundError, match=rf"No module named '{old}'"):
        importlib.import_module(old)
    importlib.import_module(home)


@pytest.mark.parametrize("old, name, home, new", GONE_NAMES,
                         ids=[f"{old}.{name}" for old, name, _, _ in GONE_NAMES])
def test_an_old_name_is_gone(old, name, home, new):
    module = importlib.import_module(old)
    with pytest.raises(AttributeError, match=f"module '{old}' has no attribute '{name}'"):
        getattr(module, name)
    with pytest.raises(ImportError, match=f"cannot import name '{name}'"):
        exec(f"from {old} import {name}", {})
    assert getattr(importlib.import_module(home), new) is not None
