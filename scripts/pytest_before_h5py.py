"""A pytest plugin of ``scripts/test.sh``: ``tests/unit`` while h5py is not installed yet.

``scripts/test.sh`` runs ``tests/unit`` beside the linters and the documentation,
while the MPI build of h5py may still be going on (a new machine: about 4 minutes).
So that the run is the same on every machine, this plugin makes ``import h5py``
fail as it does there (``sys.modules["h5py"] = None``, before any test module is
imported). A test, or a test module, that stops on that import (or skips on
``pytest.importorskip("h5py")``) is reported as skipped ("deferred: needs h5py")
and its id is written, one a line, to the file named by ``MPISHARD_DEFERRED``;
``scripts/test.sh`` runs those ids again once h5py is installed. Any other failure
stays a failure.

Use: ``PYTHONPATH=scripts MPISHARD_DEFERRED=FILE python -m pytest -p
pytest_before_h5py tests/unit``.
"""

from __future__ import annotations

import os
import sys

import pytest

__all__: list[str] = []

sys.modules["h5py"] = None   # type: ignore[assignment]  (import h5py: ModuleNotFoundError)

REASON = "deferred: needs h5py (scripts/test.sh runs it again after the h5py build)"
# What Python says of an import that sys.modules[...] = None blocks (pytest.importorskip
# repeats it in its message): nothing else says it.
BLOCKED = "import of h5py halted"


def _defer(nodeid: str) -> None:
    path = os.environ.get("MPISHARD_DEFERRED")
    if path:
        with open(path, "a") as f:
            f.write(nodeid + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A module that imports h5py at its top: skipped now, run after the build."""
    outcome = yield
    report = outcome.get_result()
    if not report.passed and BLOCKED in str(report.longrepr):
        _defer(report.nodeid)
        report.outcome = "skipped"
        report.longrepr = (str(collector.path), 0, REASON)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that stops on importing h5py: skipped now, run after the build."""
    outcome = yield
    report = outcome.get_result()
    if call.excinfo is not None and BLOCKED in str(call.excinfo.value):
        _defer(item.nodeid)
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, REASON)
