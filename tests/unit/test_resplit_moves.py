"""Which ranges move where when a sharded vector is split again over fewer ranks,
without MPI (``mpishard.recovery.resplit.moves``; the moves themselves:
``tests/mpi/test_resplit.py``; under ULFM: ``tests/faults/test_ulfm_train.py``).
"""

from __future__ import annotations

import pytest

from mpishard.flat import Range, shard_ranges
from mpishard.recovery.resplit import moves


def test_worked_example_of_the_module_docstring():
    # 12 elements over 4 ranks, rank 2 lost, rank 1 holding its copy.
    have = [[Range(0, 3)], [Range(3, 6), Range(6, 9)], [Range(9, 12)]]
    plan = moves(have, shard_ranges(12, 3))
    assert plan == [[[(Range(0, 3), 0)], [], []],
                    [[(Range(3, 4), 0)], [(Range(4, 6), 0), (Range(6, 8), 1)],
                     [(Range(8, 9), 1)]],
                    [[], [], [(Range(9, 12), 0)]]]


@pytest.mark.parametrize("size,old,lost", [(103, 4, [0]), (103, 4, [3]), (7, 8, [2, 5]),
                                           (100, 2, [1]), (64, 8, [0, 2, 4, 6])])
def test_every_element_comes_from_one_rank_and_only_overlaps_move(size, old, lost):
    # Each lost shard's copy is with its left neighbour (ShardBuddy); the survivors
    # want shard_ranges over themselves. Every wanted element is sent once, by the
    # rank that holds it; what a rank keeps is what it already held.
    shards = shard_ranges(size, old)
    alive = [r for r in range(old) if r not in lost]
    have = [[shards[r]] + [shards[(r + 1) % old]] * ((r + 1) % old in lost) for r in alive]
    want = shard_ranges(size, len(alive))
    plan = moves(have, want)
    for j, w in enumerate(want):
        got = sorted(r for i in range(len(alive)) for r, _ in plan[i][j])
        assert sum(len(r) for r in got) == len(w)
        assert all(a.stop == b.start for a, b in zip(got, got[1:]))
        assert not got or (got[0].start, got[-1].stop) == (w.start, w.stop)
        for i in range(len(alive)):
            for r, k in plan[i][j]:
                assert r.start >= have[i][k].start and r.stop <= have[i][k].stop


def test_overlaps_and_gaps_are_named():
    with pytest.raises(ValueError, match=r"ranks 0 and 1 both hold \[2, 3\)"):
        moves([[Range(0, 3)], [Range(2, 5)]], [Range(0, 5)])
    with pytest.raises(ValueError, match=r"rank 0 wants \[0, 6\) but \[3, \.\.\.\) is held "
                                         r"by no rank"):
        moves([[Range(0, 3)], [Range(4, 6)]], [Range(0, 6), Range(6, 6)])
