"""The settings of ``mpishard train``, without MPI: defaults, a TOML file and flags,
bad settings named (the whole jobs: ``tests/jobs/test_train_cli.py``).
"""

from __future__ import annotations

import os

import pytest

from mpishard.commands.config import UsageError, plan_runs


def test_defaults_run_both_examples_and_flags_override_the_file(tmp_path):
    runs = plan_runs({}, 4)
    assert [r.run for r in runs] == ["gpt", "burgers"]
    assert (runs[0].batch_size, runs[0].epochs, runs[1].batch_size, runs[1].epochs) == (
        32, 3, 256, 30)
    toml = tmp_path / "run.toml"
    toml.write_text('example = "burgers"\nepochs = 7\nbatch_size = 64\n'
                    '[optimizer]\nlr = 0.01\nweight-decay = 0.0\n')
    run, = plan_runs({"config": str(toml), "epochs": 2}, 4)
    assert (run.example, run.epochs, run.batch_size, run.lr, run.weight_decay) == (
        "burgers", 2, 64, 0.01, 0.0)
    run, = plan_runs({"example": "burgers", "checkpoint_dir": "ck"}, 2)
    assert run.checkpoint_dir == "ck"
    assert [r.checkpoint_dir for r in plan_runs({"checkpoint_dir": "ck"}, 2)] == [
        os.path.join("ck", "gpt"), os.path.join("ck", "burgers")]


@pytest.mark.parametrize("given, world, message", [
    ({"strategy": "zero4"}, 4, "unknown strategy 'zero4': choose one of ddp, zero2, zero3, hybrid"),
    ({"strategy": "hybrid", "tp": 3}, 4, "impossible layout: tp 3 x pp 1 does not fit 4 rank(s)"),
    ({"tp": 2}, 4, "--tp 2 --pp 1 need --strategy hybrid"),
    # Why, from the registry: ZeRO-3 replicates no parameter but splits no layer either.
    ({"strategy": "ddp", "pp": 2}, 4,
     "--tp 1 --pp 2 need --strategy hybrid (ddp holds the whole model on every rank)"),
    ({"strategy": "zero3", "tp": 2}, 4,
     "--tp 2 --pp 1 need --strategy hybrid (zero3 shards the parameters over the data group "
     "but gathers every layer whole, so each rank runs the whole model)"),
    ({"example": "gpt", "batch_size": 30}, 4, "does not split across 4 data-parallel rank(s)"),
    ({"strategy": "hybrid", "pp": 4, "example": "gpt", "layers": 1}, 4, "the GPT has 3 layers"),
])
def test_bad_settings(given, world, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        plan_runs(given, world)


def test_unknown_config_key_lists_the_valid_ones(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text("[model]\nwidth = 64\n")
    with pytest.raises(UsageError) as info:
        plan_runs({"config": str(toml)}, 1)
    text = str(info.value)
    assert "unknown key 'model.width'" in text and "d_model" in text and "batch_size" in text


@pytest.mark.parametrize("given, expected", [
    ({"strategy": "ddp"}, True),
    ({"strategy": "zero2"}, True),
    ({"strategy": "zero3"}, True),
    ({"strategy": "hybrid", "data_parallel": "zero3", "tp": 2}, True),
    ({"strategy": "hybrid", "data_parallel": "ddp", "tp": 2}, True),
    ({"strategy": "zero3", "async_checkpoints": True}, True),
    ({"strategy": "ddp", "async_checkpoints": False}, False),
])
def test_async_checkpoints_default_where_measured_faster(given, expected):
    """On by default for every strategy (docs/guide/checkpoints.md); the flag decides."""
    from mpishard.commands.train import _async_checkpoints

    run, = plan_runs({"example": "burgers", **given}, 4)
    assert _async_checkpoints(run) is expected
