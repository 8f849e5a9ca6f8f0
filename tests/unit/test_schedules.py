"""Pipeline schedules, simulated: dependencies hold, no deadlock, the bubble matches."""

from __future__ import annotations

import pytest

from mpishard.pipeline import bubble_fraction, peak_in_flight, schedule


def simulate(name, p, m):
    """Run all stages in lock-step time units (F and B take 1 unit each).

    A stage's next action starts when its input is there: F(i) on stage s needs
    F(i) of s-1 finished; B(i) needs B(i) of s+1 (or F(i) of the last stage).
    Returns the time the last action ends; fails on a deadlock.
    """
    plans = [schedule(name, p, m, s) for s in range(p)]
    done = {}
    clock = [0] * p
    pos = [0] * p
    progress = True
    while progress:
        progress = False
        for s in range(p):
            if pos[s] == len(plans[s]):
                continue
            kind, i = plans[s][pos[s]]
            if kind == "F":
                dep = done.get(("F", s - 1, i)) if s > 0 else 0
            else:
                dep = done.get(("B", s + 1, i)) if s < p - 1 else done.get(("F", s, i))
            if dep is None:
                continue
            start = max(clock[s], dep)
            done[(kind, s, i)] = clock[s] = start + 1
            pos[s] += 1
            progress = True
    assert all(pos[s] == len(plans[s]) for s in range(p)), "deadlock"
    return max(clock)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(1, 1), (2, 4), (4, 4), (4, 8), (3, 7), (4, 2)])
def test_every_micro_batch_once_and_bubble_closed_form(name, p, m):
    for s in range(p):
        actions = schedule(name, p, m, s)
        assert sorted(actions) == sorted([(kind, i) for kind in "FB" for i in range(m)])
        for i in range(m):   # each backward after its forward
            assert actions.index(("F", i)) < actions.index(("B", i))
    makespan = simulate(name, p, m)
    ideal = 2 * m
    assert makespan == 2 * (m + p - 1)
    assert 1 - ideal / makespan == pytest.approx(bubble_fraction(p, m))


def test_1f1b_holds_fewer_activations():
    p, m = 4, 8
    assert [peak_in_flight(schedule("gpipe", p, m, s)) for s in range(p)] == [8, 8, 8, 8]
    assert [peak_in_flight(schedule("1f1b", p, m, s)) for s in range(p)] == [4, 3, 2, 1]


def test_bad_names_and_sizes():
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zigzag'"):
        schedule("zigzag", 2, 2, 0)
    with pytest.raises(ValueError, match="stage=2"):
        schedule("gpipe", 2, 2, 2)


def test_balance_stages_is_optimal_and_contiguous():
    from itertools import combinations

    from mpishard.pipeline.partition import balance_stages, check_boundaries

    costs = [50, 10, 10, 10, 10, 40, 5, 60]
    for p in range(1, len(costs) + 1):
        ranges = balance_stages(costs, p)
        assert ranges[0][0] == 0 and ranges[-1][1] == len(costs) and len(ranges) == p
        assert all(a < b for a, b in ranges)
        worst = max(sum(costs[a:b]) for a, b in ranges)
        # brute force over all cut positions
        best = min(max(sum(costs[a:b]) for a, b in zip((0,) + cuts, cuts + (len(costs),)))
                   for cuts in combinations(range(1, len(costs)), p - 1))
        assert worst == best
    with pytest.raises(ValueError, match="larger than the model's 8 top-level layers"):
        balance_stages(costs, 9)
    assert check_boundaries([0, 3, 5], 8, 3) == [(0, 3), (3, 5), (5, 8)]
    with pytest.raises(ValueError, match="contiguous stage ranges"):
        check_boundaries([0, 5, 3], 8, 3)
