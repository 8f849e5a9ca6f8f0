"""The test files' names are unique across the test folders.

Without packages, pytest imports each test file by its base name: two folders
holding the same name fail the collection of ``tests/`` as a whole ("import file
mismatch"), as ``scripts/gpu-check.sh`` collects it.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_file_name_is_unique():
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert [n for n, count in names.items() if count > 1] == []
