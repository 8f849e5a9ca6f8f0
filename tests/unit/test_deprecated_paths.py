"""The old import paths of 0.4 (kept until 0.6): each name read through one warns,
names its new home, and is the new home's object; any other name is an
AttributeError. The two whose new home is a layer above (mpishard.parallel.recovery,
mpishard.train) import it only when the name is read (no static upward import)."""

from __future__ import annotations

import importlib

import pytest

OLD_PATHS = [
    ("mpishard.parallel.recovery", "recover_in_place", "mpishard.recovery", "recover_in_place"),
    ("mpishard.parallel.recovery", "ShardBuddy", "mpishard.recovery", "ShardBuddy"),
    ("mpishard.train", "ElasticOptimizer", "mpishard.strategies.elastic", "ElasticOptimizer"),
    ("mpishard.train", "BATCH_POLICIES", "mpishard.strategies.elastic", "BATCH_POLICIES"),
    ("mpishard.parallel", "DDPOptimizer", "mpishard.parallel.ddp", "DDPCore"),
    ("mpishard.parallel", "ZeRO2Optimizer", "mpishard.parallel.zero2", "ZeRO2Core"),
    ("mpishard.nn", "ShardedSequential", "mpishard.nn.stack", "LayerStack"),
    ("mpishard.nn.sharding", "TensorShard", "mpishard.nn.shards", "TensorShard"),
    ("mpishard.groups", "ProcessGroups", "mpishard.comm.groups", "ProcessGroups"),
    ("mpishard.hdf5data", "HDF5Dataset", "mpishard.data.hdf5", "HDF5Dataset"),
    ("mpishard.checkpoint.strategy", "save_checkpoint", "mpishard.checkpoint.state",
     "save_checkpoint"),
]


@pytest.mark.parametrize("old, name, home, new", OLD_PATHS,
                         ids=[f"{old}.{name}" for old, name, _, _ in OLD_PATHS])
def test_an_old_path_warns_and_gives_the_new_object(old, name, home, new):
    module = importlib.import_module(old)
    with pytest.warns(DeprecationWarning, match=rf"{old}\.{name} is deprecated and goes in "
                                                rf"0\.6: use {home}\.{new}"):
        got = getattr(module, name)
    assert got is getattr(importlib.import_module(home), new)


@pytest.mark.parametrize("old", sorted({old for old, *_ in OLD_PATHS}))
def test_an_old_path_has_no_other_names(old):
    with pytest.raises(AttributeError, match=f"module '{old}' has no attribute 'nothing'"):
        importlib.import_module(old).nothing  # noqa: B018
