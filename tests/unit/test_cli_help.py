"""``mpishard --help`` and every subcommand's help: plain text, every subcommand named.

The help texts are read in a terminal: no reStructuredText or mkdocstrings markup
(double backquotes, ``:class:`` roles) may reach them (issue 34, item 6).
"""

from __future__ import annotations

import argparse
import re

import pytest

from mpishard.cli import build_parser

MARKUP = re.compile(r"``|:(class|mod|func|meth|attr|data|exc):`")


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _every_parser() -> list[tuple[str, argparse.ArgumentParser]]:
    found, todo = [], [("mpishard", build_parser())]
    while todo:
        name, parser = todo.pop()
        found.append((name, parser))
        todo += [(f"{name} {sub}", p) for sub, p in _subparsers(parser).items()]
    return found


def test_top_help_describes_every_subcommand():
    parser = build_parser()
    names = list(_subparsers(parser))
    assert {"info", "train", "ckpt", "plot", "plan", "run"} <= set(names)
    description = parser.description or ""
    missing = [name for name in names if not re.search(rf"\b{name}\b", description)]
    assert not missing, f"mpishard --help's description does not name {missing}:\n{description}"


@pytest.mark.parametrize("name", [name for name, _ in _every_parser()])
def test_help_has_no_markup(name):
    text = dict(_every_parser())[name].format_help()
    assert not MARKUP.search(text), f"{name} --help shows markup:\n{text}"


def test_fault_tolerance_help_says_what_recovery_does():
    # The faults guide's table: 3D layouts with 2 or more replicas go on in place
    # (the replicas that lost a rank dropped); only with no whole replica exit 75.
    train = _subparsers(build_parser())["train"]
    text = " ".join(next(a.help for a in train._actions if "--fault-tolerance" in a.option_strings)
                    .split())
    assert "2 or more data-parallel replicas" in text and "goes on" in text, text
    assert "no whole replica left exits 75" in text, text
