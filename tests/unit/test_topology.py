"""Pure rank arithmetic and flat-vector ranges: no MPI needed."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from mpishard.data import ShardedSampler, split_batch
from mpishard.errors import TopologyError
from mpishard.flat import ParamLayout, Range, bucket_ranges, shard_ranges, unit_ranges
from mpishard.topology import Topology


def test_design_example_8_ranks():
    t = Topology.build(8, tp=2, pp=2)
    assert t.dp == 2
    assert [t.tensor_group(r) for r in (0, 2, 4, 6)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [t.data_group(r) for r in (0, 1, 4, 5)] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert [t.pipeline_group(r) for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    c = t.coordinates(5)
    assert (c.dp, c.tp, c.pp) == (0, 1, 1)


@pytest.mark.parametrize("world,tp,pp", [(1, 1, 1), (4, 2, 1), (8, 2, 2), (12, 3, 2), (6, 1, 3)])
def test_rank_coordinates_round_trip(world, tp, pp):
    t = Topology.build(world, tp=tp, pp=pp)
    seen = set()
    for r in range(world):
        c = t.coordinates(r)
        assert t.rank(c.dp, c.tp, c.pp) == r
        assert r == (c.pp * t.dp + c.dp) * t.tp + c.tp
        seen.add((c.dp, c.tp, c.pp))
    assert len(seen) == world
    # Groups partition the world, and each rank is in exactly one of each kind.
    for kind in ("data_group", "tensor_group", "pipeline_group"):
        groups = {tuple(getattr(t, kind)(r)) for r in range(world)}
        members = sorted(itertools.chain.from_iterable(groups))
        assert members == list(range(world))


@pytest.mark.parametrize("world,kw,text", [
    (6, dict(tp=4), "not divisible"),
    (8, dict(tp=2, pp=2, dp=3), "expecting the world size 8"),
    (4, dict(tp=0), "positive integer"),
    (4, dict(dp=0), "positive integer or -1"),
])
def test_bad_sizes_name_the_numbers(world, kw, text):
    with pytest.raises(TopologyError, match=text):
        Topology.build(world, **kw)


def test_layout_views_and_ranges():
    layout = ParamLayout([("0.weight", (3, 4)), ("0.bias", (4,)), ("2.weight", (4, 2))])
    assert layout.size == 12 + 4 + 8
    assert layout.range("0.bias") == Range(12, 16)
    flat = np.arange(layout.size, dtype=np.float64)
    w = layout.view(flat, "2.weight")
    assert w.shape == (4, 2) and np.shares_memory(w, flat) and w[0, 0] == 16
    assert unit_ranges(layout) == [Range(0, 16), Range(16, 24)]


def test_buckets_are_whole_units_in_backward_order():
    layout = ParamLayout()
    for i in range(5):
        layout.add(f"{i}.weight", (10,))
        layout.add(f"{i}.bias", (2,))
    buckets = bucket_ranges(layout, 25)
    assert buckets == [Range(36, 60), Range(12, 36), Range(0, 12)]
    # A unit larger than the bucket size gets a bucket of its own.
    assert bucket_ranges(layout, 5) == [Range(48, 60), Range(36, 48), Range(24, 36),
                                        Range(12, 24), Range(0, 12)]
    assert bucket_ranges(layout, 10**6) == [Range(0, 60)]


@pytest.mark.parametrize("n,parts", [(10, 3), (66, 4), (3, 4), (0, 2), (8, 8), (1, 1)])
def test_shards_cover_exactly(n, parts):
    shards = shard_ranges(n, parts)
    assert len(shards) == parts
    assert shards[0].start == 0 and shards[-1].stop == n
    for a, b in zip(shards, shards[1:]):
        assert a.stop == b.start
    assert max(len(s) for s in shards) == -(-n // parts) if n else True


def test_batch_split_errors_and_sampler_independent_of_ranks():
    with pytest.raises(ValueError, match="does not split across 3"):
        split_batch(10, 3)
    s = split_batch(12, 2, 3)
    assert (s.local_size, s.micro_size, s.local_range(1)) == (6, 2, (6, 12))
    a, b = ShardedSampler(50, 8, seed=3), ShardedSampler(50, 8, seed=3)
    whole = a.batch_indices(0, 8).copy()
    halves = np.concatenate([b.batch_indices(0, 4), b.batch_indices(4, 8)])
    assert np.array_equal(whole, halves)
    seen = []
    for _ in range(a.batches_per_epoch):
        seen.extend(a.batch_indices(0, 8).tolist())
        a.advance()
    assert len(set(seen)) == 48 and a.state.epoch == 1
