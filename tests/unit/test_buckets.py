"""GradientBuckets without MPI: launch order from the hooks, slot reuse, flush.

The reductions are a recording fake: what the mechanism decides (which bucket,
from which source, blocking or not, after waiting for which earlier one) is
checked against the order a backward produces, written out by hand.
"""

from __future__ import annotations

import numpy as np
import pytest

from mpishard.comm.buckets import GradientBuckets
from mpishard.flat import ParamLayout, Range, bucket_ranges
from mpishard.nn import MLP


class FakeHandle:
    def __init__(self, log, index):
        self.log, self.index, self.done = log, index, False

    def test(self):
        return False

    def wait(self):
        if not self.done:
            self.log.append(("wait", self.index))
            self.done = True


class Recorder:
    """A strategy's reduce(): records each call and a copy of its source."""

    def __init__(self):
        self.log, self.sources = [], {}

    def __call__(self, index, source, blocking):
        self.log.append(("reduce", index, blocking))
        self.sources[index] = np.array(source)
        return None if blocking else FakeHandle(self.log, index)


def test_ranges_in_backward_order_and_hooks_launch_when_passed():
    layout = ParamLayout([("0.w", (4,)), ("1.w", (3,)), ("2.w", (5,))])
    ranges = bucket_ranges(layout, 5)
    assert ranges == [Range(7, 12), Range(4, 7), Range(0, 4)]
    reduce = Recorder()
    buckets = GradientBuckets(ranges, reduce)
    buckets.vector = np.arange(12.0)
    buckets.begin(True)
    buckets.after(Range(7, 12))
    assert reduce.log == [("reduce", 0, False)]
    buckets.after(Range(4, 7))
    buckets.after(Range(0, 4))
    assert reduce.log == [("reduce", j, False) for j in range(3)]
    assert buckets.launched_all
    np.testing.assert_array_equal(reduce.sources[1], [4.0, 5.0, 6.0])
    buckets.flush()                       # nothing left
    buckets.wait()
    assert reduce.log[3:] == [("wait", j) for j in range(3)]


def test_inactive_backward_launches_nothing_and_flush_reduces_blocking():
    ranges = [Range(6, 9), Range(3, 6), Range(0, 3)]
    reduce = Recorder()
    buckets = GradientBuckets(ranges, reduce)
    buckets.vector = np.ones(9)
    buckets.begin(False)                  # a micro-batch that only accumulates
    for r in ranges:
        buckets.before(r)
        buckets.after(r)
    assert reduce.log == [] and not buckets.launched_all
    buckets.flush(zero=True)
    assert reduce.log == [("reduce", j, True) for j in range(3)]
    np.testing.assert_array_equal(buckets.vector, 0.0)


def test_slots_wait_for_the_bucket_two_earlier():
    """Bucket j reuses slot j % 2: before the backward writes it, the reduction
    of bucket j - 2 completes."""
    model = MLP([3, 4, 4, 4, 2])          # four Linear layers: four buckets of one layer
    ranges = bucket_ranges(model.layout, 1)
    assert len(ranges) == 4
    reduce = Recorder()
    buckets = GradientBuckets(ranges, reduce, slots=2)
    buckets.allocate(np, np.float64)
    assert [b.size for b in buckets.buffers] == [max(len(ranges[0]), len(ranges[2])),
                                                 max(len(ranges[1]), len(ranges[3]))]
    reference = MLP([3, 4, 4, 4, 2])
    model.bind_gradients(buckets.gradient_views(model.layout))
    model.set_backward_hooks(buckets)
    x = np.random.default_rng(0).standard_normal((5, 3))
    y = np.array([0, 1, 1, 0, 1])
    buckets.begin(True)
    model.forward_backward(x, y)
    buckets.wait()
    assert reduce.log == [("reduce", 0, False), ("reduce", 1, False), ("wait", 0),
                          ("reduce", 2, False), ("wait", 1), ("reduce", 3, False),
                          ("wait", 2), ("wait", 3)]
    # Each bucket's source held exactly its own gradient when it was reduced.
    reference.forward_backward(x, y)
    for j, r in enumerate(ranges):
        np.testing.assert_array_equal(reduce.sources[j], reference.grads[r.start:r.stop])


@pytest.mark.parametrize("slots", [0, 2])
def test_no_buckets_reduce_nothing(slots):
    # A layout without parameters (a pipeline stage of activations only, issue 21):
    # no ranges, every call a no-op, empty slot buffers. (Before: a ValueError.)
    layout = ParamLayout([])
    reduce = Recorder()
    buckets = GradientBuckets(bucket_ranges(layout, 5), reduce, slots=slots)
    assert buckets.ranges == [] and buckets.largest == 0 and buckets.launched_all
    if slots:
        buckets.allocate(np, np.float64)
        assert [len(b) for b in buckets.buffers] == [0, 0]
        assert buckets.gradient_views(layout) is not None
    else:
        buckets.vector = np.zeros(0)
    for launch in (True, False):
        buckets.begin(launch)
        assert buckets.launched_all
        buckets.flush(zero=True)
        buckets.wait()
    assert reduce.log == [] and buckets.seconds == 0.0


def test_largest():
    ranges = [Range(7, 12), Range(4, 7), Range(0, 4)]
    assert GradientBuckets(ranges, Recorder()).largest == 5


def test_bad_arguments():
    with pytest.raises(ValueError, match="no slots"):
        GradientBuckets([Range(0, 2)], Recorder()).allocate(np, np.float64)
