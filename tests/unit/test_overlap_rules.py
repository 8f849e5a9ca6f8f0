"""``overlap="auto"``'s rules that decide without measuring (issue 34, item 1). Pure."""

from __future__ import annotations

import numpy as np
import pytest

from mpishard.comm import NodeMap
from mpishard.costmodel import Machine, reduction_time
from mpishard.flat import Range
from mpishard.parallel.overlap import (
    RECORD_FILE,
    WORTH_MEASURING,
    gain_bound,
    layout_key,
    modelled_overlap,
    record_path,
)


def test_one_bucket_has_nothing_to_overlap():
    assert "one gradient bucket" in modelled_overlap(1, 10.0, 4, device=False)
    assert "one gradient bucket" in modelled_overlap(0, 0.0, None, device=True)


def test_too_small_then_one_node_then_measure():
    assert modelled_overlap(3, WORTH_MEASURING / 2, 4, False).startswith("too small to gain")
    assert modelled_overlap(3, 1.0, 1, device=False).startswith("one node, host arrays")
    assert modelled_overlap(3, 1.0, 1, device=True) is None       # GPUs on one node: measure
    assert modelled_overlap(3, 1.0, 2, device=False) is None      # across nodes: measure
    assert modelled_overlap(3, 1.0, None, device=False) is None   # no node map: measure
    assert modelled_overlap(3, 0.5, 2, False, worth=1.0).startswith("too small")


def test_gain_bound_is_the_cost_model_of_every_bucket_but_the_last():
    slow = Machine(latency_inside=5e-6, bandwidth_inside=10e9, latency_across=50e-6,
                   bandwidth_across=1.25e9, reduce_scatter_cost=1.0)
    lengths = [2**20, 2**19, 2**18]
    expected = sum(reduction_time(n * 4, 8, 1, slow, "flat") for n in lengths[:-1])
    assert gain_bound(lengths, 4, 8, 1, "allreduce") == pytest.approx(expected)
    # 1M float32 in buckets over 8 ranks on slow links: several ms, worth measuring.
    assert gain_bound(lengths, 4, 8, 1, "allreduce") > 10 * WORTH_MEASURING
    # A tiny MLP's buckets: latency only, well under.
    assert gain_bound([42, 56, 24], 8, 4, 1, "allreduce") < WORTH_MEASURING
    assert gain_bound([1000], 4, 8, 1, "allreduce") == 0.0    # one bucket: nothing
    assert gain_bound([2**20, 1], 4, 1, 1, "allreduce") == 0.0  # one rank: nothing


def test_layout_key_names_what_the_decision_depends_on():
    ranges = [Range(10, 20), Range(0, 10)]
    nodes = NodeMap(node_of=(0, 0, 1, 1), hosts=("a", "b"))
    key = layout_key(4, 4, ranges, np.float32, np, "allreduce", 0, nodes)
    assert key == layout_key(4, 4, list(ranges), "float32", np, "allreduce", 0, nodes)
    others = [layout_key(2, 4, ranges, np.float32, np, "allreduce", 0, nodes),
              layout_key(4, 8, ranges, np.float32, np, "allreduce", 0, nodes),
              layout_key(4, 4, ranges[:1], np.float32, np, "allreduce", 0, nodes),
              layout_key(4, 4, [Range(11, 20), Range(0, 11)], np.float32, np, "allreduce",
                         0, nodes),
              layout_key(4, 4, ranges, np.float64, np, "allreduce", 0, nodes),
              layout_key(4, 4, ranges, np.float32, np, "reduce_scatter", 2, nodes),
              layout_key(4, 4, ranges, np.float32, np, "allreduce", 0, None),
              layout_key(4, 4, ranges, np.float32, np, "allreduce", 0,
                         NodeMap(node_of=(0, 0, 0, 1), hosts=("a", "b")))]
    assert key not in others and len(set(others)) == len(others)


def test_record_path(monkeypatch, tmp_path):
    for var in ("MPISHARD_OVERLAP_RECORD", "MPISHARD_JOB_DIR", "MPISHARD_ELASTIC"):
        monkeypatch.delenv(var, raising=False)
    assert record_path() is None
    job = tmp_path / "launch-3"
    monkeypatch.setenv("MPISHARD_JOB_DIR", str(job))
    assert record_path() is None                     # not under the elastic agent
    monkeypatch.setenv("MPISHARD_ELASTIC", "1")      # the agent's folder outlives launch-3
    assert record_path() == str(tmp_path / RECORD_FILE)
    monkeypatch.setenv("MPISHARD_OVERLAP_RECORD", str(tmp_path / "mine.json"))
    assert record_path() == str(tmp_path / "mine.json")
