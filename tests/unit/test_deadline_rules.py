"""Deadlines by kind (``mpishard.comm.deadlines``): precedence, checks and names. Pure."""

from __future__ import annotations

import numpy as np
import pytest

from mpishard.comm.deadlines import KINDS, Deadlines


def test_timeout_alone_bounds_every_kind():
    assert Deadlines.build(30) == Deadlines(30.0, 30.0, 30.0)
    assert Deadlines.build(None) == Deadlines(None, None, None)
    assert Deadlines.build() == Deadlines(None, None, None)


@pytest.mark.parametrize("data, io, expected", [
    (None, "timeout", (5.0, None, 5.0)),
    ("timeout", 600, (5.0, 5.0, 600.0)),
    (0.5, None, (5.0, 0.5, None)),
    (np.float32(2.5), np.int64(7), (5.0, 2.5, 7.0)),
])
def test_a_kind_given_wins_over_timeout(data, io, expected):
    got = Deadlines.build(5, data, io)
    assert (got.peer, got.data, got.io) == expected
    assert all(type(v) is float for v in (got.peer, got.data, got.io) if v is not None)


def test_a_kind_may_have_a_limit_without_timeout():
    assert Deadlines.build(None, 10, None) == Deadlines(None, 10.0, None)


@pytest.mark.parametrize("argument, value", [
    ("timeout", 0), ("timeout", -1.0), ("timeout", True), ("timeout", "30"),
    ("data_timeout", 0), ("data_timeout", "forever"), ("io_timeout", float("nan")),
    ("io_timeout", [1])])
def test_bad_seconds_are_refused_naming_the_argument(argument, value):
    kwargs = {"timeout": 5.0, "data_timeout": "timeout", "io_timeout": "timeout",
              argument: value}
    with pytest.raises(ValueError) as info:
        Deadlines.build(kwargs["timeout"], kwargs["data_timeout"], kwargs["io_timeout"])
    assert str(info.value) == f"{argument} must be positive seconds or None, got {value!r}"


def test_each_kind_is_named_by_its_argument():
    d = Deadlines.build(60, None, 600)
    assert d.of("peer") == 60 and d.of("data") is None and d.of("io") == 600
    assert d.explain("peer") == "timeout=60: a wait for the other ranks of the group"
    assert d.explain("data") == ("data_timeout=None: a wait for the slowest rank's data "
                                 "(its stream's next batch)")
    assert d.explain("io") == "io_timeout=600: a wait for file I/O (checkpoint or HDF5)"
    assert sorted(KINDS) == ["data", "io", "peer"]
    with pytest.raises(ValueError, match=r"expecting a deadline kind among \['data', 'io', "
                                         r"'peer'\], got 'disk'"):
        d.of("disk")


def test_deadlines_pass_through_build():
    d = Deadlines(1.0, 2.0, 3.0)
    assert Deadlines.build(d) is d
