"""Every list of the data-parallel strategies in the docs names every strategy of the registry.

A passage is found by a pattern that starts it and one that ends it (the end's
first match after the start); each entry of ``mpishard.strategies.STRATEGIES``
must appear in it by its title (``ZeRO-3``), its public class
(``ZeRO3Optimizer``), its core (``ZeRO3Core``) or its name (``zero3``), as the
passage spells them. A new strategy in the registry fails here until each
passage names it; a passage moved or reworded fails here until the pattern
follows it.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from mpishard.strategies import STRATEGIES

ROOT = Path(__file__).resolve().parents[2]


def _class(path: str) -> str:
    return path.rpartition(":")[2]


SPELLINGS = {
    "title": lambda e: e.title,
    "class": lambda e: _class(e.public),
    "core": lambda e: _class(e.core),
    "name": lambda e: e.name,
}

#: (file, start pattern, end pattern, spelling): one strategy list each.
PASSAGES = [
    ("README.md", r"^Distributed training over MPI", r"^$", "title"),
    ("README.md", r"^## The strategies", r"^## ", "class"),
    ("README.md", r"^\| elastic \|", r"$", "title"),
    ("docs/index.md", r"^\| strategy \| class", r"^$", "class"),
    ("docs/architecture.md", r"^\| parallel \|", r"$", "title"),
    ("docs/architecture.md", r"^Each public strategy of", r"^$", "class"),
    ("docs/guide/strategies.md", r"^# Strategies", r"^## Optimizer state", "title"),
    ("docs/guide/reproducible.md", r"\*\*the same bits\*\*", r"^It does \*\*not\*\*", "title"),
    ("docs/guide/data.md", r"^# Training data", r"^$\n^\|", "class"),
    ("docs/guide/training-loop.md", r"^One loop", r"^$", "class"),
    ("docs/api/index.md", r"^\| \[mpishard.strategies\]", r"$", "class"),
    ("docs/api/index.md", r"^\| \[mpishard.parallel\]", r"$", "core"),
    ("mkdocs.yml", r"^site_description:", r"^\w", "title"),
    ("mpishard/__init__.py", r'^"""', r"$", "title"),
    ("mpishard/config.py", r"^        reproducible: train", r"^        \w+:", "title"),
    ("mpishard/strategies/hybrid.py", r"^    \"\"\"", r"^    Args:", "title"),
    ("mpishard/strategies/hybrid.py", r"^        data_parallel:", r"^        model:", "name"),
    ("mpishard/strategies/elastic.py", r"^A \[`Strategy`\]", r"^$", "title"),
    ("mpishard/checkpoint/state.py", r"^    With a strategy \(", r"\) as$", "class"),
    ("mpishard/checkpoint/state.py", r"expecting a training strategy", r"or None", "class"),
]


def passage(file: str, start: str, end: str) -> str:
    text = (ROOT / file).read_text()
    first = re.search(start, text, re.MULTILINE)
    assert first, f"{file}: no line matches {start!r} (the passage moved: update PASSAGES)"
    last = re.compile(end, re.MULTILINE).search(text, first.end())
    assert last, f"{file}: nothing matches {end!r} after {start!r}"
    return text[first.start():last.start()]


@pytest.mark.parametrize("file, start, end, spelling", PASSAGES,
                         ids=[f"{p[0]}:{p[1][:24]}" for p in PASSAGES])
def test_each_strategy_list_names_every_strategy(file, start, end, spelling):
    text = passage(file, start, end)
    missing = [SPELLINGS[spelling](e) for e in STRATEGIES.values()
               if not re.search(rf"\b{re.escape(SPELLINGS[spelling](e))}\b", text)]
    assert not missing, f"{file}, the passage from {start!r}: misses {missing}\n{text}"


def test_strategy_guide_has_a_section_per_strategy():
    text = (ROOT / "docs/guide/strategies.md").read_text()
    for entry in STRATEGIES.values():
        assert re.search(rf"^## {re.escape(entry.title)}$", text, re.MULTILINE), entry.title


def test_train_help_lists_every_strategy():
    """``mpishard train --help`` offers and explains each name (one process, no MPI)."""
    out = subprocess.run([sys.executable, "-m", "mpishard", "train", "--help"],
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout
    out = " ".join(out.split())     # argparse wraps the help text
    for entry in STRATEGIES.values():
        assert f"{entry.name}: {entry.summary}" in out
    assert "{" + ",".join([*STRATEGIES, "hybrid"]) + "}" in out


def test_api_reference_renders_the_registry():
    text = (ROOT / "docs/api/strategies.md").read_text()
    assert "::: mpishard.strategies.registry" in text
